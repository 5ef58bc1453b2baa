"""The contract every registered algorithm keeps, generated from the registry.

Why generated: a new algorithm is one new module in ``shared/algorithms``; it must not need new test
code to be held to what the framework promises about *every* algorithm. For each name
``fedfleet reference`` lists, on one short experiment with a tiered memory mix (so budget-aware
algorithms size tasks, and others meet refusals):

* **transport**: the run over RabbitMQ (one connection per service) and the run over the in-process
  broker end with the same global model and the same per-round participants;
* **resume**: a run whose services are all killed — right after round k, or in the middle of round
  k+1 after some devices trained — and resumed from the checkpoint and the devices' persisted state,
  ends exactly like the uninterrupted run: the global model, every device's personal state, every
  round's row;
* **memory**: every task a device trains fits its memory budget (the footprint recomputed by a fresh
  strategy, so an accounting cache cannot hide a mismatch), and no refused task is trained;
* **bytes**: the wire bytes in ``summary.json`` equal the bytes of the task and update messages
  counted per message by Prometheus, and equal the bytes the transport really carried;
* **options**: every ``train.*`` option is honoured (changing it changes what a device sends) or the
  configuration is refused by validation.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY as PROM

from services.orchestrator import InprocCluster
from services.server.service import Server
from shared import algorithms
from shared.algorithms.base import DeviceContext, TaskSpec, UpdateSpec
from shared.codec.tensorset import LayoutCache
from shared.config import ExperimentConfig, parse_config
from shared.devices import admit
from shared.experiment import Experiment
from shared.schemas import (
    DEVICE_ENVELOPE_BUDGET,
    Answers,
    Kind,
    RoundOpen,
    Task,
    Tasks,
    Updates,
    decode,
    device_bytes,
    information_bytes,
)
from shared.transport import Transport
from tests.conftest import lone_tasks

ALGORITHMS = sorted(algorithms.REGISTRY)
ROUNDS = 4


def contract_config(algorithm: str, name: str) -> ExperimentConfig:
    """A short run every algorithm must complete: 8 devices of the EmbracingFL memory mix (strong
    devices fit the full model, moderate and weak ones do not), label skew, momentum."""
    return parse_config(
        {
            "name": name,
            "seed": 3,
            "rounds": ROUNDS,
            "num_devices": 8,
            "devices_per_round": 4,
            "round_timeout_s": 120,
            "quorum_fraction": 0.25,
            "registration_timeout_s": 60,
            "dataset": {
                "name": "digits",
                "partition": "dirichlet",
                "alpha": 0.5,
                "train_limit": 600,
                "local_test_fraction": 0.25,
            },
            "model": {"name": "mlp", "options": {"hidden": [32, 16]}},
            "algorithm": {"name": algorithm},
            "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.1, "momentum": 0.5},
            "processes": {"aggregators": 2, "clients": 2, "prefetch": 8},
            "hosts": {"join_quiet_s": 0.0},
            "fleet": {"preset": "embracingfl-mix"},
        },
        f"<contract {algorithm}>",
    )


# -- observing a run ---------------------------------------------------------------------------------
@dataclass
class Observed:
    """What a run did, seen from outside the services."""

    #: (round, device, task) of every training call
    trained: list[tuple[int, int, TaskSpec]] = field(default_factory=list)
    #: bytes the transports carried, by message kind
    carried: dict[str, int] = field(default_factory=dict)
    #: what the emulated devices downloaded, by kind: each task plus the payload it refers to
    device_down: dict[str, int] = field(default_factory=dict)
    #: what the emulated devices uploaded: their updates without the telemetry
    device_up: int = 0
    #: payload bytes by the kind of the tasks that follow them (training or evaluation)
    payload_for: dict[str, int] = field(default_factory=dict)
    _payloads: int = 0
    #: the layouts the server announced (an update may name its layout by digest)
    layouts: LayoutCache = field(default_factory=LayoutCache)
    #: the largest envelope of a device message, by kind (task, update): its bytes beyond its
    #: information and its telemetry (as ``benchmarks/bench_envelope.py`` counts them)
    envelope: dict[str, int] = field(default_factory=dict)

    def count(self, key: str, body: bytes) -> None:
        env, msg = decode(body, max_bytes=len(body) + 1, layouts=self.layouts)
        for layout in [*env.layouts, *(msg.layouts if isinstance(msg, RoundOpen) else [])]:
            self.layouts.learn(layout)
        kind = env.kind.value
        if isinstance(msg, Answers | Updates):  # each entry a lone message, the bundle's own its framing
            self.carried[kind] = self.carried.get(kind, 0) + len(body) - sum(map(len, msg.messages))
            for entry in msg.messages:
                self.count(key, entry)
            return
        self.carried[kind] = self.carried.get(kind, 0) + len(body)
        if env.kind in (Kind.TASK, Kind.UPDATE):
            over = len(body) - information_bytes(msg) - env.telemetry_bytes
            self.envelope[kind] = max(self.envelope.get(kind, 0), over)
        if isinstance(msg, Task):
            self.device_down[kind] = self.device_down.get(kind, 0) + len(body) + msg.payload_bytes
            # a fan-out publishes its payloads just before its tasks
            self.payload_for[kind] = self.payload_for.get(kind, 0) + self._payloads
            self._payloads = 0
        if isinstance(msg, Tasks):  # each entry is what its device downloads: a lone ``task``
            for task, lone in lone_tasks(body):
                self.device_down["task"] = self.device_down.get("task", 0) + len(lone) + task.payload_bytes
                over = len(lone) - information_bytes(task)
                self.envelope["task"] = max(self.envelope.get("task", 0), over)
            self.payload_for["task"] = self.payload_for.get("task", 0) + self._payloads
            self._payloads = 0
        if env.kind is Kind.PAYLOAD:
            self._payloads += len(body)
        if env.kind is Kind.UPDATE:
            self.device_up += device_bytes(body)


def _observe(exp: Experiment, seen: Observed) -> None:
    """Record every training call of the experiment's strategy (all in-process clients share it)."""
    strategy = exp.strategy
    real_train = strategy.train

    def train(task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        seen.trained.append((device.round, device.device_id, task))
        return real_train(task, device)

    strategy.train = train  # type: ignore[method-assign]


def _counting(make: Callable[[str], Transport], seen: Observed) -> Callable[[str], Transport]:
    """Wrap each service's transport so every published body is tallied by kind."""

    def factory(user: str) -> Transport:
        t = make(user)
        publish, publish_many = t.publish, t.publish_many
        batching = [False]  # a batch may be published message by message: count it once

        def counted_publish(
            key: str, body: bytes, headers: dict[str, Any] | None = None, *, transient: bool = False
        ) -> None:
            publish(key, body, headers, transient=transient)
            if not batching[0]:
                seen.count(key, body)

        def counted_many(items: Any, *, transient: bool = False) -> set[str]:
            batching[0] = True
            try:
                unroutable = publish_many(items, transient=transient)
            finally:
                batching[0] = False
            for key, body in items:
                if key not in unroutable:
                    seen.count(key, body)
            return unroutable

        t.publish = counted_publish  # type: ignore[method-assign]
        t.publish_many = counted_many  # type: ignore[method-assign]
        return t

    return factory


def _inproc(experiment_id: str) -> Callable[[str], Transport]:
    from shared.transport.inproc import InprocBroker, InprocTransport

    broker = InprocBroker()
    return lambda user: InprocTransport(broker, experiment_id, user)


class _Killed(Exception):
    """Raised from a round hook to stop every service at once."""


@dataclass
class Run:
    run_dir: Path
    server: Server
    seen: Observed
    exp: Experiment


def _run(
    cfg: ExperimentConfig,
    run_dir: Path,
    experiment_id: str,
    transport: Callable[[str], Transport],
    *,
    stop_when: Callable[[InprocCluster], bool] | None = None,
    kill_after_round: int | None = None,
) -> Run:
    """Run ``cfg`` in this process. ``stop_when`` kills every service (no clean-up) once it holds
    after any service's turn; ``kill_after_round`` kills them the moment that round's row is
    written."""
    exp = Experiment.build(cfg)
    seen = Observed()
    _observe(exp, seen)
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = InprocCluster(exp, run_dir, experiment_id, transport=_counting(transport, seen))
    server = cluster.server

    def on_round(srv: Server) -> None:
        if len(srv.rows) == kill_after_round:
            raise _Killed

    def on_step() -> None:
        if stop_when is not None and stop_when(cluster):
            raise _Killed

    try:
        cluster.run(on_round=on_round, on_step=on_step, max_steps=2_000_000)
    except _Killed:
        pass
    finally:
        cluster.close()
    return Run(run_dir, server, seen, exp)


# -- comparing runs ---------------------------------------------------------------------------------
def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    diffs = [np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))) for k in a if a[k].size]
    return float(max(diffs, default=0.0))


def _device_states(state_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every array a device keeps, by file relative to the devices' state directory."""
    return {str(p.relative_to(state_dir)): _arrays(p) for p in sorted(state_dir.rglob("*.npz"))}


VOLATILE = {"wall_seconds", "round_seconds", "broker_bytes"}  # timing-dependent (heartbeats)


def _rows(run_dir: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO((run_dir / "rounds.csv").read_text())))
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def _assert_same_run(a: Path, b: Path) -> None:
    assert _max_diff(_arrays(a / "global_model.npz"), _arrays(b / "global_model.npz")) <= 1e-6
    assert _rows(a) == _rows(b)
    assert (a / "devices.csv").read_text() == (b / "devices.csv").read_text()
    sa, sb = _device_states(a / "device-state"), _device_states(b / "device-state")
    assert set(sa) == set(sb), sorted(set(sa) ^ set(sb))[:5]
    for name in sa:
        assert _max_diff(sa[name], sb[name]) <= 1e-6, name


# -- the suite --------------------------------------------------------------------------------------
#: the uninterrupted in-process run of every algorithm, made once and compared by every test
_CLEAN: dict[str, Run] = {}


def _clean(algorithm: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    if algorithm not in _CLEAN:
        exp_id = f"contract-{algorithm}"
        run_dir = tmp_path_factory.mktemp(f"clean-{algorithm}")
        _CLEAN[algorithm] = _run(contract_config(algorithm, exp_id), run_dir, exp_id, _inproc(exp_id))
        assert _CLEAN[algorithm].server.phase == "done", f"{algorithm}: the clean run did not finish"
    return _CLEAN[algorithm]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_trained_task_fits_the_devices_memory(
    algorithm: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _clean(algorithm, tmp_path_factory)
    fleet = {d.device_id: d for d in run.exp.fleet}
    # the check means something: the mix has devices that cannot train the full model
    assert min(d.profile.memory_bytes for d in fleet.values()) < run.exp.full_footprint_bytes
    assert run.seen.trained, f"{algorithm}: no device trained anything"
    fresh = Experiment.build(run.exp.cfg)  # recomputes every footprint (no accounting cache)
    for rnd, dev, task in run.seen.trained:
        n = len(fresh.device_data(dev).y_train)
        verdict = admit(
            fresh.strategy.task_footprint(task),
            fleet[dev].profile.memory_bytes,
            extra=fresh.strategy.task_extra_peak(task, n),
        )
        assert verdict.admitted, f"round {rnd}: device {dev} trained a task over its budget: {verdict.detail}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_summary_bytes_are_the_bytes_of_every_message(
    algorithm: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _clean(algorithm, tmp_path_factory)

    summary = json.loads((run.run_dir / "summary.json").read_text())
    exp_id = summary["experiment"]

    def counted(metric_name: str, **labels: str) -> float:
        total = 0.0
        for metric in PROM.collect():
            for s in metric.samples:
                mine = s.name == metric_name and s.labels.get("experiment") == exp_id
                if mine and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    carried, device_down = run.seen.carried, run.seen.device_down
    # what the emulated devices moved: the papers' figure, in the summary, in Prometheus, and
    # equal to what the messages really held (each task plus the payload it refers to)
    assert summary["bytes_down"] > 0 and summary["bytes_up"] > 0
    assert (
        summary["bytes_down"]
        == device_down["task"]
        == counted("fedfleet_device_bytes_total", direction="down")
    )
    assert summary["bytes_up"] == run.seen.device_up == counted("fedfleet_device_bytes_total", direction="up")
    assert carried["update"] > run.seen.device_up  # the broker also carried the updates' telemetry
    if "bytes_eval_down" in summary:
        assert summary["bytes_eval_down"] == device_down["evaluate"]
    # what crossed the broker: every publish counted once, by kind
    for kind, nbytes in carried.items():
        assert counted("fedfleet_wire_bytes_total", kind=kind) == nbytes, kind
    # the rounds' broker bytes hold every task, payload, update, receipt and partial, and no more
    # than everything the run published
    rows = csv.DictReader(io.StringIO((run.run_dir / "rounds.csv").read_text()))
    rounds_broker = sum(int(r["broker_bytes"]) for r in rows)
    assert rounds_broker == summary["broker_bytes"]
    core = sum(carried.get(k, 0) for k in ("task", "tasks", "update", "receipts", "partial", "round_open"))
    core += run.seen.payload_for.get("task", 0)  # the evaluation's payloads are not a round's
    assert core <= rounds_broker <= sum(carried.values())
    if algorithm == "fedavg":  # one model for every device: it crossed the broker once per host
        assert (
            carried.get("task", 0) + carried.get("tasks", 0) + carried["payload"]
            < summary["bytes_down"] * 0.75
        )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_device_message_is_within_the_envelope_budget(
    algorithm: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 16: a task or an update carries at most 64 bytes beyond its tensors' information
    (routing facts, MAC, layout digest or references, counts, framing), telemetry apart — for
    every algorithm, every message of the run."""
    run = _clean(algorithm, tmp_path_factory)
    assert set(run.seen.envelope) == {"task", "update"}, run.seen.envelope
    assert max(run.seen.envelope.values()) <= DEVICE_ENVELOPE_BUDGET, run.seen.envelope


@pytest.mark.broker
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_rabbitmq_run_equals_the_inprocess_run(
    algorithm: str, tmp_path_factory: pytest.TempPathFactory, broker_url: str, experiment_id: str
) -> None:
    from shared.transport.amqp import AmqpTransport

    clean = _clean(algorithm, tmp_path_factory)
    run_dir = tmp_path_factory.mktemp(f"amqp-{algorithm}")
    cfg = contract_config(algorithm, clean.exp.cfg.name)
    made: list[AmqpTransport] = []

    def amqp(user: str) -> Transport:  # every service as the test broker's one user: dev mode
        made.append(AmqpTransport(broker_url, experiment_id))
        return made[-1]

    try:
        over_amqp = _run(cfg, run_dir, experiment_id, amqp)
    finally:
        cleaner = AmqpTransport(broker_url, experiment_id)
        names = cleaner.names
        cleaner.delete_experiment(
            [names.server_queue, names.updates_queue, *(names.client_queue(f"client-{i}") for i in range(2))]
        )
        cleaner.close()
    assert over_amqp.server.phase == "done"
    _assert_same_run_but_transport(clean.run_dir, over_amqp.run_dir)


def _assert_same_run_but_transport(a: Path, b: Path) -> None:
    assert _max_diff(_arrays(a / "global_model.npz"), _arrays(b / "global_model.npz")) <= 1e-6
    keep = ("round", "outcome", "participants", "selected", "rejected", "dropped", "accuracy")
    assert [{k: r[k] for k in keep} for r in _rows(a)] == [{k: r[k] for k in keep} for r in _rows(b)]
    sa, sb = _device_states(a / "device-state"), _device_states(b / "device-state")
    assert set(sa) == set(sb)
    for name in sa:
        assert _max_diff(sa[name], sb[name]) <= 1e-6, name


@pytest.mark.parametrize("when", ["after-round-2", "mid-round-3"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_killed_and_resumed_run_equals_the_uninterrupted_one(
    algorithm: str, when: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clean = _clean(algorithm, tmp_path_factory)
    cfg = contract_config(algorithm, clean.exp.cfg.name)
    exp_id = cfg.name
    run_dir = tmp_path_factory.mktemp(f"resume-{algorithm}-{when}")

    def mid_round_3(cluster: InprocCluster) -> bool:
        # an aggregator reduced round 3 updates, whose partial the server has not merged: an
        # aggregator holding every device's update sends its partial unasked, and the server may
        # merge it and finish the round in its next turn, so the kill comes right after the
        # aggregator's turn
        return cluster.server.round == 3 and any(a.round == 3 and a.seen for a in cluster.aggregators)

    if when == "after-round-2":  # before any device trains for round 3
        first = _run(cfg, run_dir, exp_id, _inproc(exp_id), kill_after_round=2)
    else:  # some devices trained round 3 and their updates were reduced
        first = _run(cfg, run_dir, exp_id, _inproc(exp_id), stop_when=mid_round_3)
    assert first.server.phase != "done" and len(first.server.rows) == 2
    resumed = _run(cfg, run_dir, exp_id, _inproc(exp_id))
    assert resumed.server.resumed and resumed.server.phase == "done"
    _assert_same_run(clean.run_dir, resumed.run_dir)


#: each ``train.*`` option, set to a value that must change what training does
TRAIN_VARIANTS: dict[str, dict[str, Any]] = {
    "momentum": {"momentum": 0.9},
    "weight_decay": {"weight_decay": 0.05},
    "clip_grad_norm": {"clip_grad_norm": 1e-3},
    "drop_last": {"drop_last": True},
    "local_steps": {"local_steps": 1},
    "local_epochs": {"local_epochs": 2},
    "batch_size": {"batch_size": 7},
    "lr": {"lr": 0.02},
}


def _train_once(cfg: ExperimentConfig, state_dir: Path) -> dict[str, np.ndarray]:
    """Train round 1's task on one device; what it sends and what it keeps, as arrays."""
    from shared import codec

    exp = Experiment.build(cfg)
    s = exp.strategy
    # a device whose data size does not divide into batches, so drop_last has a batch to drop
    dev = next(d for d in range(cfg.num_devices) if len(exp.device_data(d).y_train) % 16 not in (0, 1))
    task = s.plan(s.init_state(), 1, [dev], {})[dev]
    ctx = DeviceContext(dev, 1, exp.device_data(dev), state_dir / f"device-{dev}", seed=11)
    update = s.train(task, ctx)

    def values(t: codec.Tensor) -> np.ndarray:
        return np.asarray(t.array if isinstance(t, codec.Dense | codec.Threshold) else t.to_dense())

    out = {f"up/{k}": values(t) for k, t in update.tensors.items()}
    for name, arrays in _device_states(state_dir).items():
        out.update({f"{name}/{k}": v for k, v in arrays.items()})
    return out


@pytest.mark.parametrize("option", sorted(TRAIN_VARIANTS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_train_option_is_honoured_or_refused(algorithm: str, option: str, tmp_path: Path) -> None:
    base = contract_config(algorithm, "options")
    changed = base.model_copy(update={"train": base.train.model_copy(update=TRAIN_VARIANTS[option])})
    try:
        algorithms.check_train(algorithm, changed.train)
    except ValueError as err:  # refused at validation, with the reason: honest
        assert option in str(err)
        return
    before = _train_once(base, tmp_path / "base")
    after = _train_once(changed, tmp_path / "changed")
    assert set(before) == set(after)
    assert _max_diff(before, after) > 0, f"{algorithm} ignores train.{option}"
