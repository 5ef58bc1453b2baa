"""The server: owns the experiment — device registry, round loop, selection, deadlines, global state.

A round, as a state machine driven by messages and ``tick``:

``registering`` → (enough devices) → ``open``: select devices, tell the aggregators which devices may
answer (``round_open``), send each device its task. Receipts (from aggregators) and rejects (from
devices) arrive. When every selected device is accounted for — or the deadline passes with at least
the quorum — → ``flushing``: ask the aggregators for their partials and merge them, until every
receipted device is covered by exactly one accepted partial → finalize with the strategy, evaluate,
record, checkpoint → next round, or ``done`` (broadcast ``stop``).

Exactly-once: aggregators hold their acks until the server accepts the partial that contains an
update. A partial that overlaps devices already covered is refused: a normal partial's updates are
requeued and come back one by one (``singleton`` partials, built from redelivered messages), and a
singleton for a covered device is a duplicate. So a crashed aggregator or a replayed update changes
nothing in the result.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from services.common import MessageHandler, ServiceBase, decode_tensors, encode_tensors
from shared import metrics
from shared.algorithms.base import Partial, ServerState, TaskSpec, derive_seed
from shared.config import ExperimentConfig
from shared.devices import is_online, over_select
from shared.experiment import Experiment
from shared.results import DeviceStats, plot_run, write_devices, write_rounds, write_summary
from shared.schemas import Decision as DecisionMsg
from shared.schemas import (
    DeviceInfo,
    Envelope,
    EvalResult,
    Flush,
    Go,
    Heartbeat,
    Kind,
    Ready,
    Receipt,
    Register,
    Reject,
    RoundOpen,
    RoundSummary,
    Stop,
    Task,
    encode,
    task_token,
    token_ok,
)
from shared.schemas import (
    Partial as PartialMsg,
)
from shared.transport import (
    KEY_AGGREGATORS,
    KEY_CLIENTS,
    KEY_SERVER,
    KEY_UPDATE,
    Delivery,
    Transport,
    Unroutable,
    key_aggregator,
    key_task,
)

FLUSH_RETRY_S = 1.0
#: how often an open round's ``round_open`` is repeated for aggregators that started after it
ROUND_OPEN_REPEAT_S = 2.0


class Server(ServiceBase):
    service = "server"

    def __init__(
        self,
        transport: Transport,
        exp: Experiment,
        run_dir: Path,
        *,
        experiment_id: str,
        flush_timeout_s: float = 30.0,
    ) -> None:
        cfg = exp.cfg
        super().__init__(transport, experiment_id, cfg.algorithm.name, cfg.processes.max_message_bytes)
        self.exp = exp
        self.cfg: ExperimentConfig = cfg
        self.strategy = exp.strategy
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoint"
        self.flush_timeout_s = flush_timeout_s
        self.incarnation = uuid.uuid4().hex[:12]
        self.registry: dict[int, DeviceInfo] = {}
        #: key of the open round's (or the evaluation's) task tokens; see ``shared.schemas.task_token``
        self.task_key = ""
        self.strategy.fleet = self.registry  # live view for budget-aware planning
        self.devices: dict[int, DeviceStats] = {}
        self.rows: list[dict[str, Any]] = []
        self.totals = {"bytes_up": 0, "bytes_down": 0, "dense_bytes_up": 0, "dense_bytes_down": 0}
        self.wall_offset = 0.0  # wall seconds spent before a resume
        self.round = 0
        self.phase = "registering"
        self.state: ServerState = self.strategy.init_state()
        self.started = time.time()
        self.registration_deadline = self.started + cfg.registration_timeout_s
        self._reset_round()
        self.eval_expected: set[int] = set()
        self.eval_results: dict[int, EvalResult] = {}
        self.eval_bytes = 0
        self.eval_deadline = math.inf
        self.resumed = self._load_checkpoint()
        self.error: str | None = None

        transport.declare_queue(transport.names.server_queue, [KEY_SERVER])
        transport.declare_queue(transport.names.updates_queue, [KEY_UPDATE])
        handlers: dict[Kind, MessageHandler] = {
            Kind.REGISTER: self.on_register,
            Kind.HEARTBEAT: self.on_heartbeat,
            Kind.RECEIPT: self.on_receipt,
            Kind.REJECT: self.on_reject,
            Kind.PARTIAL: self.on_partial,
            Kind.READY: self.on_ready,
            Kind.EVAL_RESULT: self.on_eval_result,
        }
        transport.consume(transport.names.server_queue, lambda d: self.dispatch(d, handlers), prefetch=64)
        metrics.DENSITY.labels(self.experiment, self.algorithm).set(self.strategy.density(self.state))
        # Create the labelled series now: a histogram appears only at its first observation, and a
        # short run could otherwise end between two scrapes with nothing for rate() to work on.
        labels = (self.experiment, self.algorithm)
        metrics.ROUND_DURATION.labels(*labels)
        metrics.ROUND_VIRTUAL_DURATION.labels(*labels)
        for outcome in ("completed", "below-quorum"):
            metrics.ROUNDS_COMPLETED.labels(*labels, outcome)
        self.log.info(
            "server ready",
            extra={"event": "server_ready", "f_incarnation": self.incarnation, "f_resumed_round": self.round},
        )

    # -- round bookkeeping -----------------------------------------------------------------------
    def _reset_round(self) -> None:
        self.selected: list[int] = []
        self.receipts: dict[int, Receipt] = {}
        self.rejects: dict[int, Reject] = {}
        self.unreachable: set[int] = set()
        self.covered: set[int] = set()
        self.merged: Partial | None = None
        self.round_started = 0.0
        self.deadline = math.inf
        self.flush_deadline = math.inf
        self.last_flush = 0.0
        self.round_open_msg: RoundOpen | None = None
        self.last_round_open = 0.0
        self.round_down_bytes = 0
        self.round_dense_down = 0
        self.task_bytes: dict[int, int] = {}
        self.readies: dict[int, Ready] = {}
        self.go_sent = False
        #: selected devices that will not be aggregated, with why: dropout, deadline, surplus
        self.discarded: dict[int, str] = {}
        self.offline = 0

    def _stats(self, device_id: int) -> DeviceStats:
        st = self.devices.get(device_id)
        if st is None:
            tier = self.registry[device_id].tier if device_id in self.registry else "default"
            st = self.devices[device_id] = DeviceStats(device_id, tier)
        return st

    # -- handlers --------------------------------------------------------------------------------
    def on_register(self, env: Envelope, msg: Register, d: Delivery) -> None:
        new = 0
        for info in msg.devices:
            if info.device_id >= self.cfg.num_devices:
                self.log.warning(
                    "ignoring device %d outside the fleet", info.device_id, extra={"event": "register"}
                )
                continue
            new += info.device_id not in self.registry
            self.registry[info.device_id] = info
            self._stats(info.device_id).tier = info.tier
        if new:
            tiers: dict[str, int] = {}
            for info in self.registry.values():
                tiers[info.tier] = tiers.get(info.tier, 0) + 1
            for tier, n in tiers.items():
                metrics.REGISTERED_DEVICES.labels(self.experiment, tier).set(n)
            self.log.info(
                "%d devices registered by %s (%d known)",
                new,
                msg.client_id,
                len(self.registry),
                extra={"event": "register"},
            )
        d.ack()

    def on_heartbeat(self, env: Envelope, msg: Heartbeat, d: Delivery) -> None:
        d.ack()

    def _current(self, env: Envelope) -> bool:
        return env.inc == self.incarnation and env.round == self.round and self.phase in ("open", "flushing")

    def on_receipt(self, env: Envelope, msg: Receipt, d: Delivery) -> None:
        if self._current(env) and msg.device_id in self.selected:
            self.receipts.setdefault(msg.device_id, msg)
        d.ack()

    def on_reject(self, env: Envelope, msg: Reject, d: Delivery) -> None:
        if not (self._current(env) and msg.device_id in self.selected):
            d.ack()
            return
        if self._forged(msg.device_id, msg.token, d, "refusal"):
            return
        if msg.reason == "dropout":
            # a virtual-time dropout notice: the device will never answer (see the client)
            self.discarded.setdefault(msg.device_id, "dropout")
        elif msg.device_id not in self.rejects:
            self.rejects[msg.device_id] = msg
            tier = self._stats(msg.device_id).tier
            metrics.REJECTIONS.labels(self.experiment, self.algorithm, tier, msg.reason).inc()
            metrics.MEMORY_FOOTPRINT_BYTES.labels(self.experiment, self.algorithm, tier).set(
                msg.footprint_bytes
            )
            self.log.info(
                "device %d refused its task: %s (%s)",
                msg.device_id,
                msg.reason,
                msg.detail,
                extra={"event": "reject", "device": msg.device_id, "reason": msg.reason},
            )
        d.ack()

    def on_ready(self, env: Envelope, msg: Ready, d: Delivery) -> None:
        if self._current(env) and msg.device_id in self.selected and not self.go_sent:
            if self._forged(msg.device_id, msg.token, d, "ready"):
                return
            self.readies[msg.device_id] = msg
        d.ack()

    def _decide_uploads(self) -> None:
        """Keep the first ``devices_per_round`` finishers within the emulated deadline; discard the rest.

        Ranked by emulated finish time (ties by device id), so the choice is deterministic in virtual
        time and does not depend on which process happened to answer first.
        """
        self.go_sent = True
        deadline = self.cfg.emulation.round_deadline_s
        ranked = sorted(self.readies.values(), key=lambda r: (r.finish_s, r.device_id))
        kept = 0
        for ready in ranked:
            if deadline is not None and ready.finish_s > deadline:
                upload, reason = False, "deadline"
            elif kept >= self.cfg.devices_per_round:
                upload, reason = False, "surplus"
            else:
                upload, reason = True, ""
                kept += 1
            if not upload:
                self.discarded[ready.device_id] = reason
            with contextlib.suppress(Unroutable):
                self.send(
                    key_task(ready.device_id),
                    Kind.GO,
                    Go(device_id=ready.device_id, upload=upload, reason=reason),
                    round=self.round,
                    inc=self.incarnation,
                )

    def on_partial(self, env: Envelope, msg: PartialMsg, d: Delivery) -> None:
        def decide(accepted: bool, reason: str = "") -> None:
            self.send(
                key_aggregator(msg.aggregator_id),
                Kind.DECISION,
                DecisionMsg(seq=msg.seq, accepted=accepted, reason=reason),
                round=env.round,
                inc=env.inc,
            )

        if not self._current(env):
            decide(False, "stale")
        elif set(msg.devices) & self.covered:
            decide(False, "duplicate" if msg.singleton else "overlap")
            self.log.info(
                "refused partial %s/%d: devices already covered",
                msg.aggregator_id,
                msg.seq,
                extra={"event": "partial_refused"},
            )
        elif not set(msg.devices) <= set(self.selected):
            decide(False, "unknown-device")
        else:
            partial = Partial.from_wire(decode_tensors(msg.tensors), msg.scalars)
            self.merged = partial if self.merged is None else self.strategy.merge(self.merged, partial)
            self.covered.update(msg.devices)
            decide(True)
        d.ack()

    # -- timers ----------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.time()
        if self.phase == "registering":
            if len(self.registry) >= self.cfg.num_devices:
                self._next()
            elif now > self.registration_deadline:
                if len(self.registry) >= self.cfg.devices_per_round:
                    self.log.warning(
                        "starting with %d of %d devices registered",
                        len(self.registry),
                        self.cfg.num_devices,
                        extra={"event": "registration_timeout"},
                    )
                    self._next()
                else:
                    self.error = (
                        f"only {len(self.registry)} of {self.cfg.num_devices} devices registered within "
                        f"{self.cfg.registration_timeout_s:.0f}s "
                        f"(need at least {self.cfg.devices_per_round}); "
                        "are the client processes running and pointed at the same broker and experiment?"
                    )
                    self.log.error(self.error, extra={"event": "registration_failed"})
                    self.stopped = True
        elif self.phase == "waiting":
            if now - self.last_flush >= FLUSH_RETRY_S:
                self.last_flush = now
                self._open_round()
        elif self.phase == "evaluating":
            if set(self.eval_results) >= self.eval_expected or now >= self.eval_deadline:
                missing = sorted(self.eval_expected - set(self.eval_results))
                if missing:
                    self.log.warning(
                        "evaluation closed without %d devices: %s",
                        len(missing),
                        missing[:10],
                        extra={"event": "evaluation_incomplete"},
                    )
                self._finish()
        elif self.phase == "open":
            silent = set(self.rejects) | self.unreachable | set(self.discarded)
            if self.ready_protocol and not self.go_sent:
                if set(self.readies) | silent >= set(self.selected) or now >= self.deadline:
                    self._decide_uploads()
                return
            if now - self.last_round_open >= ROUND_OPEN_REPEAT_S:
                self._repeat_round_open(now)
            accounted = set(self.receipts) | silent
            if accounted >= set(self.selected):
                self._start_flush(now)
            elif now >= self.deadline:
                if len(self.receipts) >= self.quorum and self.receipts:
                    self._start_flush(now)
                else:
                    self._finalize("below-quorum")
        elif self.phase == "flushing":
            if self.covered >= set(self.receipts):
                self._finalize("completed")
            elif now >= self.flush_deadline:
                lost = sorted(set(self.receipts) - self.covered)
                self.log.error(
                    "flush timed out; %d receipted updates never arrived in a partial: %s",
                    len(lost),
                    lost[:10],
                    extra={"event": "flush_timeout"},
                )
                self._finalize("completed" if self.covered else "below-quorum")
            elif now - self.last_flush >= FLUSH_RETRY_S:
                self._broadcast_flush(now)

    @property
    def ready_protocol(self) -> bool:
        emu = self.cfg.emulation
        return emu.over_selection > 1 or emu.round_deadline_s is not None

    @property
    def quorum(self) -> int:
        target = min(self.cfg.devices_per_round, len(self.selected))
        return max(1, math.ceil(self.cfg.quorum_fraction * target))

    # -- the round -------------------------------------------------------------------------------
    def _select(self, round: int) -> tuple[list[int], int]:
        """Uniform random selection among the registered devices that are online this round.

        With over-selection, ceil(K x factor) are invited (FedScale-style over-commitment) and the
        first K finishers are kept. Returns (selected, number of registered devices offline).
        """
        rng = np.random.default_rng(derive_seed(self.cfg.seed, "select", round) % (2**32))
        fleet = self.exp.fleet
        registered = sorted(self.registry)
        online = [d for d in registered if is_online(fleet[d], round, self.cfg.seed)]
        picked = over_select(online, self.cfg.devices_per_round, self.cfg.emulation.over_selection, rng)
        return sorted(int(x) for x in picked), len(registered) - len(online)

    def _open_round(self) -> None:
        selected, offline = self._select(self.round + 1)
        started = time.time()
        deadline = started + self.cfg.round_timeout_s
        self.task_key = secrets.token_hex(16)
        round_open = RoundOpen(selected=selected, deadline_unix=deadline, round_key=self.task_key)
        try:
            self.send(
                KEY_AGGREGATORS, Kind.ROUND_OPEN, round_open, round=self.round + 1, inc=self.incarnation
            )
        except Unroutable:
            # No aggregator is listening (not started yet, or all gone): nothing could be aggregated,
            # so the round waits rather than burning its deadline.
            if self.phase != "waiting":
                self.log.warning("no aggregator is running; waiting", extra={"event": "no_aggregator"})
            self.phase = "waiting"
            return
        self._reset_round()
        self.round += 1
        self.phase = "open"
        self.round_open_msg, self.last_round_open = round_open, time.time()
        self.selected = selected
        self.offline = offline
        self.round_started = started
        self.deadline = deadline
        labels = (self.experiment, self.algorithm)
        metrics.ROUND.labels(*labels).set(self.round)
        metrics.ROUND_OPEN.labels(*labels).set(1)
        metrics.ROUND_STARTED.labels(*labels).set(self.round_started)
        metrics.ROUND_DEADLINE.labels(*labels).set(self.deadline)
        tasks = self.strategy.plan(self.state, self.round, self.selected)
        batch = self._encode_tasks(Kind.TASK, tasks, self.selected)
        for dev in self.selected:
            st = self._stats(dev)
            st.selected += 1
            metrics.SELECTED.labels(self.experiment, self.algorithm, st.tier).inc()
        # one broker round trip for the whole fan-out, not one confirm per device
        unroutable = self.publish_batch(Kind.TASK, batch)
        for dev, (key, data, dense) in zip(self.selected, batch, strict=True):
            if key in unroutable:
                self.unreachable.add(dev)
                self.log.warning("no client hosts device %d any more", dev, extra={"event": "unreachable"})
                continue
            st = self._stats(dev)
            n = len(data)
            self.task_bytes[dev] = n
            self.round_down_bytes += n
            self.round_dense_down += dense
            st.bytes_down += n
            metrics.DEVICE_ROUND_BYTES.labels(self.experiment, self.algorithm, "down", st.tier).observe(n)
        self.log.info(
            "round %d opened with %d devices",
            self.round,
            len(self.selected),
            extra={"event": "round_open", "round": self.round},
        )

    def _broadcast(self, key: str, kind: Kind, body: Any, *, round: int, inc: str) -> None:
        """A broadcast nobody is bound for is not an error (e.g. every aggregator has exited)."""
        with contextlib.suppress(Unroutable):
            self.send(key, kind, body, round=round, inc=inc)

    def _participant_metrics(self, participants: list[int]) -> dict[str, float]:
        """Means of the metrics the round's participants reported.

        ``eval_*`` metrics are weighted by each device's ``eval_samples`` (its personal test split),
        the rest by its training samples, so a device with more data counts for more — as in the
        papers' "mean personalised accuracy" weighted over test samples.
        """
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for dev in participants:
            r = self.receipts.get(dev)
            if r is None:
                continue
            for key, value in r.metrics.items():
                eval_metric = key.startswith("eval_")
                w = r.metrics.get("eval_samples", 1.0) if eval_metric else float(r.num_samples or 1)
                sums[key] = sums.get(key, 0.0) + w * value
                weights[key] = weights.get(key, 0.0) + w
        return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}

    def _repeat_round_open(self, now: float) -> None:
        """Send the open round's ``round_open`` again (aggregators ignore a repeat).

        Why: an aggregator that starts after the round opened -- a late start, a scale-up, a
        restart -- never saw it, and cannot validate that round's updates: it can only put them
        back. If the aggregator that held them crashed, they would bounce between the broker and the
        newcomer until the flush deadline dropped them. Repeating the announcement lets it join.
        """
        self.last_round_open = now
        if self.round_open_msg is not None:
            with contextlib.suppress(Unroutable):
                self.send(
                    KEY_AGGREGATORS,
                    Kind.ROUND_OPEN,
                    self.round_open_msg,
                    round=self.round,
                    inc=self.incarnation,
                )

    def _broadcast_flush(self, now: float) -> None:
        self.last_flush = now
        self._repeat_round_open(now)  # first, so a late aggregator knows the round it is asked to flush
        with contextlib.suppress(Unroutable):  # every aggregator gone: the flush deadline decides
            self.send(KEY_AGGREGATORS, Kind.FLUSH, Flush(), round=self.round, inc=self.incarnation)

    def _start_flush(self, now: float) -> None:
        self.phase = "flushing"
        self.flush_deadline = now + self.flush_timeout_s
        self._broadcast_flush(now)

    def _finalize(self, outcome: str) -> None:
        labels = (self.experiment, self.algorithm)
        merged = self.merged if outcome == "completed" else None
        self.state = self.strategy.finalize(self.state, merged, self.round)
        participants = sorted(self.covered) if merged is not None else []
        # Uplink bytes: every update that reached an aggregator in this round, aggregated or not (a
        # round below quorum still cost its devices the upload).
        up = dense_up = 0
        for dev, r in self.receipts.items():
            st = self._stats(dev)
            up += r.update_bytes
            dense_up += r.dense_bytes
            st.bytes_up += r.update_bytes
            metrics.DEVICE_ROUND_BYTES.labels(self.experiment, self.algorithm, "up", st.tier).observe(
                r.update_bytes
            )
        vsec = 0.0
        for dev in participants:
            st = self._stats(dev)
            st.completed += 1
            receipt = self.receipts.get(dev)
            if receipt is not None:
                t = sum(receipt.timings.values())
                st.virtual_seconds += t
                vsec = max(vsec, t)
            metrics.PARTICIPANTS.labels(self.experiment, self.algorithm, st.tier).inc()
        for dev in self.rejects:
            self._stats(dev).rejected += 1
        dropped = [
            d
            for d in self.selected
            if d not in self.covered and d not in self.rejects and self.discarded.get(d) != "surplus"
        ]
        for dev in dropped:
            st = self._stats(dev)
            st.dropped += 1
            reason = "unreachable" if dev in self.unreachable else self.discarded.get(dev, "deadline")
            metrics.DROPOUTS.labels(self.experiment, self.algorithm, st.tier, reason).inc()
        if self.ready_protocol:
            # emulated round time: the last kept finisher, or the deadline if the round had to wait for it
            finishes = [self.readies[d].finish_s for d in participants if d in self.readies]
            short = len(participants) < min(self.cfg.devices_per_round, len(self.selected))
            deadline = self.cfg.emulation.round_deadline_s
            vsec = deadline if short and deadline is not None else max(finishes, default=0.0)
        metrics.ROUND_VIRTUAL_DURATION.labels(self.experiment, self.algorithm).observe(vsec)
        pm = self._participant_metrics(participants)
        ev: dict[str, float] = {}
        if self.strategy.personalised:
            # Devices evaluate their own personalised models on their own test split and report it.
            ev = {k: pm[f"eval_{k}"] for k in ("accuracy", "loss") if f"eval_{k}" in pm}
        elif self.round % self.cfg.eval_every == 0 or self.round == self.cfg.rounds:
            ev = self.strategy.evaluate(self.state, self.exp.dataset.x_test, self.exp.dataset.y_test)
            if "accuracy" in ev:
                metrics.ACCURACY.labels(*labels).set(ev["accuracy"])
            if "loss" in ev:
                metrics.LOSS.labels(*labels).set(ev["loss"])
        density = pm.get("density", self.strategy.density(self.state))
        metrics.DENSITY.labels(*labels).set(density)
        self.totals["bytes_up"] += up
        self.totals["bytes_down"] += self.round_down_bytes
        self.totals["dense_bytes_up"] += dense_up
        self.totals["dense_bytes_down"] += self.round_dense_down
        now = time.time()
        row = {
            "round": self.round,
            "outcome": outcome,
            "accuracy": ev.get("accuracy"),
            "loss": ev.get("loss"),
            "bytes_up": up,
            "bytes_down": self.round_down_bytes,
            "dense_bytes_up": dense_up,
            "dense_bytes_down": self.round_dense_down,
            "cum_bytes_up": self.totals["bytes_up"],
            "cum_bytes_down": self.totals["bytes_down"],
            "participants": len(participants),
            "selected": len(self.selected),
            "rejected": len(self.rejects),
            "dropped": len(dropped),
            "offline": self.offline,
            "wall_seconds": self.wall_offset + now - self.started,
            "round_seconds": now - self.round_started,
            "virtual_seconds": vsec,
            "density": density,
            "train_flops": pm.get("train_flops"),
            "train_loss": pm.get("train_loss"),
        }
        # every other metric the devices reported (weighted mean), so algorithms need no server change
        shown = {"density", "train_flops", "train_loss", "eval_accuracy", "eval_loss"}
        row.update({f"m_{k}": v for k, v in pm.items() if k not in shown})
        # and every other number the server-side evaluation returned (e.g. FedMef's accuracy before
        # and after a mask adjustment), so diagnostics need no side channel
        row.update({f"e_{k}": v for k, v in ev.items() if k not in ("accuracy", "loss")})
        self.rows.append(row)
        metrics.ROUND_DURATION.labels(*labels).observe(now - self.round_started)
        metrics.ROUNDS_COMPLETED.labels(self.experiment, self.algorithm, outcome).inc()
        metrics.ROUND_OPEN.labels(*labels).set(0)
        self.log.info(
            "round %d %s: %d/%d participants, accuracy %s",
            self.round,
            outcome,
            len(participants),
            len(self.selected),
            f"{ev['accuracy']:.4f}" if "accuracy" in ev else "-",
            extra={"event": "round_done", "round": self.round, "f_outcome": outcome},
        )
        self._broadcast(
            KEY_AGGREGATORS,
            Kind.ROUND_SUMMARY,
            RoundSummary(
                outcome=outcome,
                accuracy=ev.get("accuracy"),
                loss=ev.get("loss"),
                participants=len(participants),
            ),
            round=self.round,
            inc=self.incarnation,
        )
        write_rounds(self.run_dir, self.rows)
        self._save_checkpoint()
        self.phase = "between"
        self._next()

    def _next(self) -> None:
        """Open the next round, or — after the last — evaluate every device (personalised) or finish."""
        if self.round < self.cfg.rounds:
            self._open_round()
        elif self.strategy.personalised:
            self._start_evaluation()
        else:
            self._finish()

    def _encode_tasks(
        self, kind: Kind, tasks: dict[int, TaskSpec], devices: list[int]
    ) -> list[tuple[str, bytes, int]]:
        """(routing key, message, dense bytes) per device; a TaskSpec shared by several devices (e.g.
        FedAvg's one global model) has its tensors encoded once."""
        encoded: dict[int, tuple[dict[str, Any], int]] = {}
        batch: list[tuple[str, bytes, int]] = []
        for dev in devices:
            spec = tasks[dev]
            if id(spec) not in encoded:
                encoded[id(spec)] = encode_tensors(spec.tensors)
            tensors, dense = encoded[id(spec)]
            body = Task(
                device_id=dev, tensors=tensors, config=spec.config, token=task_token(self.task_key, dev)
            )
            data = encode(
                kind, body, exp=self.experiment, round=self.round, sender=self.service, inc=self.incarnation
            )
            batch.append((key_task(dev), data, dense))
        return batch

    def _start_evaluation(self) -> None:
        """Ask every registered device to evaluate its personalised model on its own test split.

        The papers report the mean over all devices; a round's participants are only a sample. The
        evaluation messages are their own kind, so their bytes never mix with training traffic.
        """
        devices = sorted(self.registry)
        tasks = self.strategy.plan_evaluation(self.state, devices)
        self.task_key = secrets.token_hex(16)
        batch = self._encode_tasks(Kind.EVALUATE, tasks, devices)
        unroutable = self.publish_batch(Kind.EVALUATE, batch)
        self.eval_expected = {
            dev for dev, (key, _, _) in zip(devices, batch, strict=True) if key not in unroutable
        }
        self.eval_bytes = sum(len(data) for key, data, _ in batch if key not in unroutable)
        self.eval_results = {}
        self.eval_deadline = time.time() + self.cfg.round_timeout_s
        self.phase = "evaluating"
        self.log.info(
            "evaluating the personalised models of %d devices",
            len(self.eval_expected),
            extra={"event": "evaluate"},
        )

    def on_eval_result(self, env: Envelope, msg: EvalResult, d: Delivery) -> None:
        if self.phase == "evaluating" and env.inc == self.incarnation and msg.device_id in self.eval_expected:
            if self._forged(msg.device_id, msg.token, d, "evaluation result"):
                return
            self.eval_results[msg.device_id] = msg
        d.ack()

    def _forged(self, device_id: int, token: str, d: Delivery, what: str) -> bool:
        """Dead-letter (reason ``forged``) a message whose token is not the device's task token."""
        if token_ok(self.task_key, device_id, token):
            return False
        self.reject(d, "forged", f"{what} for device {device_id} does not carry that device's task token")
        return True

    def _finish(self) -> None:
        self.phase = "done"
        self.write_results()  # before stopping the others: a caller may treat their exit as "done"
        for key in (KEY_CLIENTS, KEY_AGGREGATORS):
            self._broadcast(key, Kind.STOP, Stop(), round=self.round, inc=self.incarnation)
        self.stopped = True

    # -- results and checkpoints -----------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        accs = [r["accuracy"] for r in self.rows if r.get("accuracy") is not None]
        tiers: dict[str, dict[str, float]] = {}
        per_device = (
            "selected",
            "completed",
            "rejected",
            "dropped",
            "bytes_up",
            "bytes_down",
            "virtual_seconds",
        )
        for st in self.devices.values():
            t = tiers.setdefault(st.tier, dict.fromkeys(("devices", *per_device), 0))
            t["devices"] += 1
            for k in per_device:
                t[k] += getattr(st, k)
        return {
            "experiment": self.experiment,
            "name": self.cfg.name,
            "algorithm": self.algorithm,
            "transport": self.transport.kind,
            "dataset": self.cfg.dataset.name,
            "model": self.cfg.model.name,
            "seed": self.cfg.seed,
            "rounds": len(self.rows),
            "rounds_completed": sum(r["outcome"] == "completed" for r in self.rows),
            "final_accuracy": accs[-1] if accs else None,
            "best_accuracy": max(accs) if accs else None,
            **self.totals,
            "compression_up": self.totals["bytes_up"] / self.totals["dense_bytes_up"]
            if self.totals["dense_bytes_up"]
            else None,
            "wall_seconds": self.rows[-1]["wall_seconds"] if self.rows else 0.0,
            "virtual_seconds": sum(r["virtual_seconds"] for r in self.rows),
            "final_density": self.rows[-1]["density"] if self.rows else 1.0,
            "tiers": tiers,
            **self._evaluation_summary(),
        }

    def _evaluation_summary(self) -> dict[str, Any]:
        """All-device personalised results (mean over devices, weighted by test samples, best)."""
        results = [
            r.metrics for r in self.eval_results.values() if r.supported and "eval_accuracy" in r.metrics
        ]
        if not results:
            return {}
        accs = [m["eval_accuracy"] for m in results]
        weights = [m.get("eval_samples", 1.0) for m in results]
        out: dict[str, Any] = {
            "evaluated_devices": len(results),
            "personal_accuracy_mean": float(np.mean(accs)),
            "personal_accuracy_weighted": float(np.average(accs, weights=weights)) if sum(weights) else None,
            "personal_accuracy_best": max(accs),
            "personal_accuracy_worst": min(accs),
            "bytes_eval_down": self.eval_bytes,
        }
        densities = [m["density"] for m in results if "density" in m]
        if densities:
            out["personal_density_mean"] = float(np.mean(densities))
        return out

    def write_results(self) -> None:
        for dev, result in self.eval_results.items():
            if result.supported and "eval_accuracy" in result.metrics:
                self._stats(dev).eval_accuracy = result.metrics["eval_accuracy"]
        write_rounds(self.run_dir, self.rows)
        write_devices(self.run_dir, list(self.devices.values()))
        write_summary(self.run_dir, self.summary())
        np.savez(self.run_dir / "global_model.npz", **self.state.arrays)  # type: ignore[arg-type]
        plot_run(self.run_dir, self.rows, f"{self.cfg.name} ({self.algorithm})")

    def _save_checkpoint(self) -> None:
        """Atomically write the state after a finished round (write to a temp dir, then rename).

        A directory holds a whole checkpoint once its ``state.json`` (written last) exists. A kill
        between the two renames leaves only ``checkpoint.old`` whole; ``_load_checkpoint`` restores
        it (that round is then run again, with the same seeds).
        """
        tmp = self.run_dir / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        np.savez(tmp / "state.npz", **self.state.arrays)  # type: ignore[arg-type]
        meta = {
            "round": self.round,
            "state_meta": self.state.meta,
            "registry": {str(k): v.model_dump() for k, v in self.registry.items()},
            "devices": [asdict(s) for s in self.devices.values()],
            "rows": self.rows,
            "totals": self.totals,
            "wall_seconds": self.wall_offset + time.time() - self.started,
        }
        (tmp / "state.json").write_text(json.dumps(meta))
        old = self.run_dir / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.ckpt_dir.exists():
            self.ckpt_dir.rename(old)
        tmp.rename(self.ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)

    def _load_checkpoint(self) -> bool:
        # ``checkpoint.tmp`` is never trusted: a kill can leave it half written
        old = self.run_dir / "checkpoint.old"
        if not (self.ckpt_dir / "state.json").exists() and (old / "state.json").exists():
            self.log.warning(
                "no checkpoint at %s (the server was stopped while replacing it); restoring %s",
                self.ckpt_dir,
                old,
                extra={"event": "checkpoint_fallback"},
            )
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
            old.rename(self.ckpt_dir)  # so the next save cannot delete the only whole checkpoint
        if not (self.ckpt_dir / "state.json").exists():
            return False
        meta = json.loads((self.ckpt_dir / "state.json").read_text())
        with np.load(self.ckpt_dir / "state.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        self.state = ServerState(arrays, meta["state_meta"])
        self.round = int(meta["round"])
        self.registry = {int(k): DeviceInfo.model_validate(v) for k, v in meta["registry"].items()}
        self.devices = {d["device_id"]: DeviceStats(**d) for d in meta["devices"]}
        self.rows = meta["rows"]
        self.totals = meta["totals"]
        self.wall_offset = float(meta["wall_seconds"])
        self.log.info("resuming after round %d from %s", self.round, self.ckpt_dir, extra={"event": "resume"})
        if self.round >= self.cfg.rounds and not self.strategy.personalised:
            self.phase = "done"  # (a personalised run still owes its all-device evaluation)
        return True

    def run(self, poll_s: float = 0.05) -> None:
        if self.phase == "done":  # resumed a finished run: rewrite results and say so
            self.write_results()
            return
        super().run(poll_s)
