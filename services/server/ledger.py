"""The run ledger: every number a run reports, kept in one place and written to ``runs/<run-id>/``.

Why separate from the server's round logic: the rows of ``rounds.csv``, the per-device statistics of
``devices.csv``, the byte totals and the Prometheus counters must agree with each other whatever
path a round took (completed, below quorum, resumed from a checkpoint). The server decides *what
happened*; the ledger turns it into rows, totals and metrics, and writes them — the same way every
time, and restorable from a checkpoint.

A round the broker lost (``lost``) has a row of its own for each lost attempt, so the bytes it cost
stay in the totals and the rows; ``summary.json`` counts rounds by number (``rounds``) and the lost
attempts apart (``rounds_lost``), so a run that had to repeat a round is never mistaken for a clean one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.server.registry import DeviceRegistry
from services.server.round import EvaluationState, RoundState
from shared import metrics
from shared.algorithms.device_state import atomic_savez
from shared.results import (
    DEVICE_COLUMNS,
    DeviceStats,
    compression_ratio,
    device_row,
    plot_run,
    write_devices,
    write_rounds,
    write_summary,
)
from shared.schemas import MetricKey

#: device-reported metrics that have a column of their own in ``rounds.csv``
_OWN_COLUMNS = {MetricKey.DENSITY, MetricKey.TRAIN_FLOPS, MetricKey.TRAIN_LOSS, MetricKey.EVAL_ACCURACY}
_OWN_COLUMNS |= {MetricKey.EVAL_LOSS}
#: per-device counters summed per tier in ``summary.json``
_PER_DEVICE = ("selected", "completed", "rejected", "dropped", "bytes_up", "bytes_down", "virtual_seconds")


@dataclass
class RoundOutcome:
    """What the server decided about a finished round, for the ledger to record."""

    outcome: str
    participants: list[int]
    #: the server-side evaluation (global model) or the participants' own (personalised)
    evaluation: dict[str, float]
    #: sample-weighted means of what the participants reported
    reported: dict[str, float]
    density: float
    virtual_seconds: float
    #: every message this round put through the broker (tasks, payloads, updates, control)
    broker_bytes: int = 0


@dataclass
class RunLedger:
    experiment: str
    algorithm: str
    #: the statistics of every device that has been selected, evaluated or restored; a registered
    #: device never touched has none here (all its counters are 0): at 100,000 registered devices
    #: one object each cost the server ~30 MiB. ``all_devices`` makes the full list when written.
    devices: dict[int, DeviceStats] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, int] = field(
        default_factory=lambda: {
            "bytes_up": 0,
            "bytes_down": 0,
            "dense_bytes_up": 0,
            "dense_bytes_down": 0,
            "broker_bytes": 0,
        }
    )
    #: wall seconds spent before a resume
    wall_offset: float = 0.0
    started: float = field(default_factory=time.time)
    #: the server's registry (``registered``): tiers and the registered devices, for untouched ones
    _registry: DeviceRegistry | None = field(default=None, repr=False)
    #: what changed since the last checkpoint (``to_journal``): devices whose statistics were
    #: handed out for change, and how many rows the checkpoints already hold
    _changed: set[int] = field(default_factory=set, repr=False)
    _rows_journaled: int = field(default=0, repr=False)
    #: what ``write_rows`` last wrote to ``rounds.csv`` (rows, columns), so it can append
    _csv: tuple[int, list[str]] | None = field(default=None, repr=False)

    @property
    def labels(self) -> tuple[str, str]:
        return (self.experiment, self.algorithm)

    # -- devices -----------------------------------------------------------------------------------
    def stats(self, device: int) -> DeviceStats:
        """The device's statistics, for reading or changing (noted as changed for the journal)."""
        self._changed.add(device)
        st = self.devices.get(device)
        if st is None:
            st = self.devices[device] = self._fresh(device)
        return st

    def _fresh(self, device: int) -> DeviceStats:
        """A device's statistics before anything happened to it (its tier from the registry)."""
        registry = self._registry
        return (
            DeviceStats(device, tier=registry.tier(device))
            if registry is not None and device in registry
            else DeviceStats(device)
        )

    def all_devices(self) -> list[DeviceStats]:
        """Every registered device's statistics, in id order (untouched ones made, not kept), then
        any others recorded (devices restored from a checkpoint of a larger fleet)."""
        return list(self.iter_devices())

    def iter_devices(self) -> Iterator[DeviceStats]:
        """``all_devices()`` one at a time: written out at the end of a run, an untouched device's
        statistics are made, written and dropped, instead of a list of one object per registered
        device (~30 MiB at 100,000 devices, at the moment the run ends; issue 16)."""
        if self._registry is None:
            yield from sorted(self.devices.values(), key=lambda st: st.device_id)
            return
        for d in self._registry:
            yield self.devices.get(d) or self._fresh(d)
        yield from sorted(
            (st for d, st in self.devices.items() if d not in self._registry), key=lambda st: st.device_id
        )

    def registered(self, registry: DeviceRegistry) -> None:
        """Refresh the per-tier gauge of registered devices. Tiers come from the registry's own
        lookups (going through its values would make every device's ``DeviceInfo``), and a device's
        statistics are made when something happens to it, not here."""
        self._registry = registry
        for device, st in self.devices.items():
            if device in registry and st.tier != (tier := registry.tier(device)):
                st.tier = tier
                self._changed.add(device)  # journaled with the next checkpoint
        for tier, n in registry.tier_counts().items():
            metrics.REGISTERED_DEVICES.labels(self.experiment, tier).set(n)

    def selected(self, rs: RoundState) -> None:
        for dev in rs.selected:
            st = self.stats(dev)
            st.selected += 1
            metrics.SELECTED.labels(*self.labels, st.tier).inc()

    def task_sent(self, device: int, wire: int) -> None:
        """A task reached the device's host: ``wire`` is what the emulated device downloads."""
        st = self.stats(device)
        st.bytes_down += wire
        metrics.DEVICE_ROUND_BYTES.labels(*self.labels, "down", st.tier).observe(wire)
        metrics.DEVICE_BYTES.labels(*self.labels, "down", st.tier).inc(wire)

    def eval_sent(self, device: int, wire: int) -> None:
        """An evaluation task reached the device's host (its own direction: never training traffic)."""
        metrics.DEVICE_BYTES.labels(*self.labels, "eval_down", self.stats(device).tier).inc(wire)

    def refused(self, reject_reason: str, device: int, footprint: int) -> None:
        tier = self.stats(device).tier
        metrics.REJECTIONS.labels(*self.labels, tier, reject_reason).inc()
        metrics.MEMORY_FOOTPRINT_BYTES.labels(*self.labels, tier).set(footprint)

    # -- rounds ------------------------------------------------------------------------------------
    def record_round(self, rs: RoundState, result: RoundOutcome) -> dict[str, Any]:
        """Account a finalized round: device statistics, byte totals, Prometheus, and its row."""
        up, dense_up = self._uplink(rs)
        dropped = self._device_outcomes(rs, result.participants)
        metrics.ROUND_VIRTUAL_DURATION.labels(*self.labels).observe(result.virtual_seconds)
        metrics.DENSITY.labels(*self.labels).set(result.density)
        self.totals["bytes_up"] += up
        self.totals["bytes_down"] += rs.down_bytes
        self.totals["dense_bytes_up"] += dense_up
        self.totals["dense_bytes_down"] += rs.dense_down
        self.totals["broker_bytes"] = self.totals.get("broker_bytes", 0) + result.broker_bytes
        telemetry = sum(r.telemetry_bytes for r in rs.receipts.values())
        self.totals["telemetry_bytes_up"] = self.totals.get("telemetry_bytes_up", 0) + telemetry
        metrics.TELEMETRY_BYTES.labels(*self.labels).inc(telemetry)
        now = time.time()
        ev, pm = result.evaluation, result.reported
        row: dict[str, Any] = {
            "round": rs.number,
            "outcome": result.outcome,
            "accuracy": ev.get("accuracy"),
            "loss": ev.get("loss"),
            "bytes_up": up,
            "bytes_down": rs.down_bytes,
            "dense_bytes_up": dense_up,
            "dense_bytes_down": rs.dense_down,
            "broker_bytes": result.broker_bytes,
            "cum_bytes_up": self.totals["bytes_up"],
            "cum_bytes_down": self.totals["bytes_down"],
            "participants": len(result.participants),
            "selected": len(rs.selected),
            "rejected": len(rs.rejects),
            "dropped": len(dropped),
            "offline": rs.offline,
            "wall_seconds": self.wall_offset + now - self.started,
            "round_seconds": now - rs.started,
            "virtual_seconds": result.virtual_seconds,
            "density": result.density,
            "train_flops": pm.get(MetricKey.TRAIN_FLOPS),
            "train_loss": pm.get(MetricKey.TRAIN_LOSS),
        }
        # every other metric the devices reported (weighted mean), so algorithms need no server change
        row.update({f"m_{k}": v for k, v in pm.items() if k not in _OWN_COLUMNS})
        # and every other number the server-side evaluation returned (e.g. FedMef's accuracy before
        # and after a mask adjustment), so diagnostics need no side channel
        row.update({f"e_{k}": v for k, v in ev.items() if k not in ("accuracy", "loss")})
        self.rows.append(row)
        metrics.ROUND_DURATION.labels(*self.labels).observe(now - rs.started)
        metrics.ROUNDS_COMPLETED.labels(*self.labels, result.outcome).inc()
        metrics.ROUND_OPEN.labels(*self.labels).set(0)
        return row

    def _device_outcomes(self, rs: RoundState, participants: list[int]) -> list[int]:
        """Count each selected device's outcome (completed, refused, dropped); returns the dropped."""
        for dev in participants:
            st = self.stats(dev)
            st.completed += 1
            receipt = rs.receipts.get(dev)
            if receipt is not None:
                st.virtual_seconds += receipt.timings.total()
            metrics.PARTICIPANTS.labels(*self.labels, st.tier).inc()
        for dev in rs.rejects:
            self.stats(dev).rejected += 1
        dropped = rs.dropped()
        for dev in dropped:
            st = self.stats(dev)
            st.dropped += 1
            metrics.DROPOUTS.labels(*self.labels, st.tier, rs.drop_reason(dev)).inc()
        return dropped

    def _uplink(self, rs: RoundState) -> tuple[int, int]:
        """Every update that reached an aggregator this round, aggregated or not (a round below
        quorum still cost its devices the upload)."""
        up = dense_up = 0
        for dev, r in rs.receipts.items():
            st = self.stats(dev)
            up += r.update_bytes
            dense_up += r.dense_bytes
            st.bytes_up += r.update_bytes
            metrics.DEVICE_ROUND_BYTES.labels(*self.labels, "up", st.tier).observe(r.update_bytes)
            metrics.DEVICE_BYTES.labels(*self.labels, "up", st.tier).inc(r.update_bytes)
        return up, dense_up

    # -- results -----------------------------------------------------------------------------------
    def write_rows(self, run_dir: Path) -> None:
        """``rounds.csv`` so far (after every round: a live run can be plotted while it runs)."""
        self._csv = write_rounds(run_dir, self.rows, after=self._csv)

    def summary(self, meta: dict[str, Any], evaluation: EvaluationState | None) -> dict[str, Any]:
        accs = [r["accuracy"] for r in self.rows if r.get("accuracy") is not None]
        tiers: dict[str, dict[str, float]] = {}
        if self._registry is not None:  # untouched devices count, with zeros, in their tier
            for tier, n in self._registry.tier_counts().items():
                tiers[tier] = dict.fromkeys(("devices", *_PER_DEVICE), 0)
                tiers[tier]["devices"] = n
        # id order, not insertion order: a resumed ledger is rebuilt in id order, and float sums
        # must not depend on which of the two ran (summary.json equal to the last bit)
        for st in sorted(self.devices.values(), key=lambda st: st.device_id):
            t = tiers.get(st.tier)
            if t is None or self._registry is None or st.device_id not in self._registry:
                t = tiers.setdefault(st.tier, dict.fromkeys(("devices", *_PER_DEVICE), 0))
                t["devices"] += 1
            for k in _PER_DEVICE:
                t[k] += getattr(st, k)
        return {
            **meta,
            "rounds": len({r["round"] for r in self.rows}),
            "rounds_completed": sum(r["outcome"] == "completed" for r in self.rows),
            "rounds_lost": sum(r["outcome"] == "lost" for r in self.rows),
            "final_accuracy": accs[-1] if accs else None,
            "best_accuracy": max(accs) if accs else None,
            **self.totals,
            "compression_ratio_up": compression_ratio(self.totals["dense_bytes_up"], self.totals["bytes_up"]),
            "compression_ratio_down": compression_ratio(
                self.totals["dense_bytes_down"], self.totals["bytes_down"]
            ),
            "wall_seconds": self.rows[-1]["wall_seconds"] if self.rows else 0.0,
            "virtual_seconds": sum(r["virtual_seconds"] for r in self.rows),
            "final_density": self.rows[-1]["density"] if self.rows else 1.0,
            "tiers": tiers,
            **_evaluation_summary(evaluation),
        }

    def write(
        self,
        run_dir: Path,
        meta: dict[str, Any],
        arrays: dict[str, np.ndarray],
        evaluation: EvaluationState | None,
        title: str,
    ) -> None:
        """Write ``rounds.csv``, ``devices.csv``, ``summary.json``, the global model and the plots."""
        if evaluation is not None:
            for dev, result in evaluation.results.items():
                if result.supported and MetricKey.EVAL_ACCURACY in result.metrics:
                    self.stats(dev).eval_accuracy = result.metrics[MetricKey.EVAL_ACCURACY]
        self.write_rows(run_dir)
        write_devices(run_dir, self.iter_devices(), in_id_order=True)
        write_summary(run_dir, self.summary(meta, evaluation))
        atomic_savez(run_dir / "global_model.npz", arrays)
        plot_run(run_dir, self.rows, title)

    # -- checkpoint --------------------------------------------------------------------------------
    def to_checkpoint(self) -> dict[str, Any]:
        """The fixed-size part a checkpoint holds; what grows goes to the journal (``to_journal``)."""
        return {"totals": self.totals, "wall_seconds": self.wall_offset + time.time() - self.started}

    def to_journal(self, *, whole: bool = False) -> list[dict[str, Any]]:
        """What changed since the last checkpoint (``journaled``): the new rows and the statistics of
        the devices touched. A checkpoint's replay of all entries up to it rebuilds the ledger
        (``restore``); one entry per checkpoint keeps a save's cost to what the round changed.

        ``whole``: every row and every device instead, the first line of a compacted journal's
        new generation (``checkpoint.Journal.compacting``), which its replay starts from."""
        changed = sorted(self.devices if whole else (d for d in self._changed if d in self.devices))
        # a device's statistics as a list under the entry's column names (a third of the bytes of
        # one object each: at 1,300 devices a round the journal grows by what they take)
        return [
            {
                "rows": self.rows[0 if whole else self._rows_journaled :],
                "device_columns": DEVICE_COLUMNS,
                "devices": [list(device_row(self.devices[d]).values()) for d in changed],
            }
        ]

    def journaled(self) -> None:
        """The checkpoint holding ``to_journal``'s entry was saved: start the next one afresh."""
        self._changed.clear()
        self._rows_journaled = len(self.rows)

    def restore(self, meta: dict[str, Any], journal: Iterable[dict[str, Any]] = ()) -> None:
        """The ledger of a checkpoint: its fixed part, then its journal entries replayed in order (a
        checkpoint from before the journal holds the rows and devices itself)."""
        self.devices = {d["device_id"]: DeviceStats(**d) for d in meta.get("devices", ())}
        self.rows = list(meta.get("rows", ()))
        for entry in journal:
            self.rows.extend(entry["rows"])
            columns = entry["device_columns"]
            for values in entry["devices"]:
                st = DeviceStats(**dict(zip(columns, values, strict=True)))
                self.devices[st.device_id] = st
        self.totals = meta["totals"]
        self.wall_offset = float(meta["wall_seconds"])
        self._csv = None  # the file may hold rows this checkpoint does not: rewrite it
        if "rows" in meta:  # from before the journal, which starts empty: its first entry holds all
            self._changed, self._rows_journaled = set(self.devices), 0
        else:
            self._changed, self._rows_journaled = set(), len(self.rows)


def _evaluation_summary(evaluation: EvaluationState | None) -> dict[str, Any]:
    """All-device personalised results (mean over devices, weighted by test samples, best)."""
    if evaluation is None:
        return {}
    results = [
        r.metrics for r in evaluation.results.values() if r.supported and MetricKey.EVAL_ACCURACY in r.metrics
    ]
    if not results:
        return {}
    accs = [m[MetricKey.EVAL_ACCURACY] for m in results]
    weights = [m.get(MetricKey.EVAL_SAMPLES, 1.0) for m in results]
    out: dict[str, Any] = {
        "evaluated_devices": len(results),
        "personal_accuracy_mean": float(np.mean(accs)),
        "personal_accuracy_weighted": float(np.average(accs, weights=weights)) if sum(weights) else None,
        "personal_accuracy_best": max(accs),
        "personal_accuracy_worst": min(accs),
        "bytes_eval_down": evaluation.down_bytes,
    }
    densities = [m[MetricKey.DENSITY] for m in results if MetricKey.DENSITY in m]
    if densities:
        out["personal_density_mean"] = float(np.mean(densities))
    return out
