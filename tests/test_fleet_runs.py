"""The emulated fleet inside real runs: memory admission, virtual link/compute time, availability,
over-selection, and bad fleet files refused at start."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from services.cli import main
from services.orchestrator import run_inproc
from shared.config import load_config
from shared.experiment import Experiment
from shared.schemas import Kind, decode, message_parts
from tests.conftest import read_rounds, unbundled, write_config


def _run(tmp_path: Path, name: str, exp_id: str | None = None, **overrides: Any) -> tuple[Path, Experiment]:
    cfg_path = write_config(tmp_path / f"{name}.yaml", **overrides)
    cfg = load_config(cfg_path)
    run = tmp_path / name
    run.mkdir()
    # (the experiment id travels in every envelope, so equal ids give byte-identical messages)
    assert run_inproc(cfg, run, exp_id or f"{name}-{tmp_path.name}") == 0
    return run, Experiment.build(cfg)


def _devices(run: Path) -> list[dict[str, str]]:
    with (run / "devices.csv").open() as f:
        return list(csv.DictReader(f))


def test_devices_below_the_footprint_are_refused_every_time(tmp_path: Path) -> None:
    fleet = {
        "tiers": {
            "small": {
                "fraction": 0.3,
                "memory_fraction": 0.6,
                "uplink_bps": 1e7,
                "downlink_bps": 1e7,
                "latency_s": 0.01,
                "flops_per_s": 1e9,
            },
            "big": {
                "fraction": 0.7,
                "memory_fraction": 1.0,
                "uplink_bps": 1e7,
                "downlink_bps": 1e7,
                "latency_s": 0.01,
                "flops_per_s": 1e9,
            },
        }
    }
    before = REGISTRY.get_sample_value(
        "fedfleet_rejections_total",
        {"experiment": f"mem-{tmp_path.name}", "algorithm": "fedavg", "tier": "small", "reason": "memory"},
    )
    run, exp = _run(tmp_path, "mem", num_devices=10, devices_per_round=5, rounds=4, fleet=fleet)
    small = {d.device_id for d in exp.fleet if d.tier == "small"}
    assert len(small) == 3
    # the budget of a small device really is below the task's footprint, and a big one's is not
    footprint = exp.strategy.task_footprint(exp.strategy.plan(exp.strategy.init_state(), 1, [0], {})[0]).total
    assert all(d.profile.memory_bytes < footprint for d in exp.fleet if d.tier == "small")
    assert all(d.profile.memory_bytes >= footprint for d in exp.fleet if d.tier == "big")
    rows = _devices(run)
    for row in rows:
        dev, selected = int(row["device_id"]), int(row["selected"])
        if dev in small:
            assert row["tier"] == "small"
            assert int(row["rejected"]) == selected and int(row["completed"]) == 0
        else:
            assert int(row["rejected"]) == 0 and int(row["completed"]) == selected
    assert sum(int(r["selected"]) for r in rows if int(r["device_id"]) in small) > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 4
    assert summary["tiers"]["small"]["rejected"] == summary["tiers"]["small"]["selected"] > 0
    counted = REGISTRY.get_sample_value(
        "fedfleet_rejections_total",
        {"experiment": f"mem-{tmp_path.name}", "algorithm": "fedavg", "tier": "small", "reason": "memory"},
    )
    assert (counted or 0) - (before or 0) == summary["tiers"]["small"]["rejected"]
    assert sum(int(r["rejected"]) for r in read_rounds(run)) == summary["tiers"]["small"]["rejected"]


def _uniform(bps: float) -> dict[str, Any]:
    return {
        "tiers": {
            "phone": {
                "fraction": 1.0,
                "memory_fraction": 2.0,
                "uplink_bps": bps,
                "downlink_bps": bps,
                "latency_s": 0.05,
                "flops_per_s": 5e8,
            }
        }
    }


@pytest.mark.parametrize("bps", [1e6, 1e8])
def test_virtual_round_time_is_bytes_over_bandwidth_plus_latency_plus_compute(
    tmp_path: Path, bps: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # virtual mode computes durations and never paces: every emulation call the client makes must
    # take the virtual path (checked here instead of timing the run, which a loaded machine skews)
    import services.client.service as client_service

    modes: list[str] = []
    for name in ("emulate_transfer", "emulate_compute"):
        real_fn = getattr(client_service, name)

        def recording(*args: Any, _fn: Any = real_fn, **kwargs: Any) -> float:
            modes.append(kwargs.get("mode", "virtual"))
            return float(_fn(*args, **kwargs))

        monkeypatch.setattr(client_service, name, recording)
    run, exp = _run(
        tmp_path,
        f"bw{int(bps)}",
        rounds=3,
        model={"name": "mlp", "options": {"hidden": [256, 256]}},
        fleet=_uniform(bps),
    )
    strategy = exp.strategy
    task = strategy.plan(strategy.init_state(), 1, [0], {})[0]
    for row in read_rounds(run):
        k = int(row["participants"])
        down = int(row["bytes_down"]) / k  # FedAvg: every device gets the same bytes...
        up = int(row["bytes_up"]) / k  # ...and sends an update of the same size
        samples = max(len(exp.device_data(d).y_train) for d in range(exp.cfg.num_devices))
        expected = 2 * 0.05 + (down + up) * 8 / bps + strategy.task_flops(task, samples) / 5e8
        assert float(row["virtual_seconds"]) == pytest.approx(expected, rel=0.01)
    summary = json.loads((run / "summary.json").read_text())
    if bps == 1e6:
        # 330 KB each way at 1 Mbit/s is ~5 emulated seconds per round, none of them slept
        assert summary["virtual_seconds"] > 12
    assert modes and set(modes) == {"virtual"}


def test_availability_dropouts_and_over_selection(tmp_path: Path) -> None:
    fleet = {
        "tiers": {
            "flaky": {
                "fraction": 1.0,
                "memory_fraction": 2.0,
                "uplink_bps": 1e6,
                "downlink_bps": 4e6,
                "latency_s": {"min": 0.01, "max": 0.5},
                "flops_per_s": {"min": 1e8, "max": 4e9},
                "p_online": 0.7,
                "p_dropout": 0.2,
            }
        }
    }
    overrides = {
        "num_devices": 20,
        "devices_per_round": 4,
        "rounds": 6,
        "fleet": fleet,
        "emulation": {"over_selection": 1.5, "round_deadline_s": 60},
    }
    run_a, _ = _run(tmp_path, "flaky", "flaky", **overrides)
    rows = read_rounds(run_a)
    assert sum(int(r["offline"]) for r in rows) > 0, "nobody was ever offline: p_online had no effect"
    assert sum(int(r["dropped"]) for r in rows) > 0, "nobody ever dropped out: p_dropout had no effect"
    for r in rows:
        assert int(r["selected"]) <= math.ceil(4 * 1.5)
        assert int(r["participants"]) <= 4  # keep the first K, even when more finished
    assert any(int(r["selected"]) > 4 for r in rows), "over-selection never invited extra devices"
    # the same seed gives the same run: availability and the first-K cut are deterministic
    run_b, _ = _run(tmp_path, "flaky2", "flaky", **overrides)
    key = ("selected", "participants", "dropped", "offline", "virtual_seconds", "accuracy")
    assert [tuple(r[k] for k in key) for r in rows] == [tuple(r[k] for k in key) for r in read_rounds(run_b)]


def _assert_same_run(a: Path, b: Path) -> None:
    """Two runs of one experiment that differ only in how messages were batched: the same rounds,
    the same bytes and emulated seconds per device, the same global model."""
    import numpy as np

    key = (
        "selected",
        "participants",
        "dropped",
        "virtual_seconds",
        "accuracy",
        "loss",
        "bytes_down",
        "bytes_up",
    )
    assert [tuple(r[k] for k in key) for r in read_rounds(a)] == [
        tuple(r[k] for k in key) for r in read_rounds(b)
    ]
    assert _devices(a) == _devices(b)  # per device: the same bytes down and up, the same seconds
    with np.load(a / "global_model.npz") as x, np.load(b / "global_model.npz") as y:
        assert all(np.array_equal(x[k], y[k]) for k in x.files)


def _tap_batches(
    monkeypatch: pytest.MonkeyPatch, lone: Kind, batch: Kind, entries: str
) -> list[tuple[str, Kind, int]]:
    """Record every ``lone`` or ``batch`` message published in one process: (routing key, kind, how
    many entries it carries, ``entries`` being the batch body's list field)."""
    from shared.transport.inproc import InprocTransport

    sent: list[tuple[str, Kind, int]] = []
    publish = InprocTransport.publish

    def tapped(self: InprocTransport, key: str, body: bytes, *args: Any, **kwargs: Any) -> None:
        kind = message_parts(body).kind
        if kind is batch:
            sent.append((key, kind, len(getattr(decode(body, max_bytes=len(body))[1], entries))))
        elif kind is lone:  # (not decoded: an update may name a layout only its round announced)
            sent.append((key, kind, 1))
        publish(self, key, body, *args, **kwargs)

    monkeypatch.setattr(InprocTransport, "publish", tapped)
    return sent


def test_each_host_gets_its_rounds_goes_in_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first-finishers round sends each host one ``gos`` with all its devices' decisions (both
    versions this build writes have ``gos``), split only past ``MAX_GOS``, with the same model."""
    import numpy as np

    from shared.schemas import KIND_SINCE, PREVIOUS_VERSION

    assert KIND_SINCE[Kind.GOS] <= PREVIOUS_VERSION  # the server sends ``gos`` to every host
    sent = _tap_batches(monkeypatch, Kind.GO, Kind.GOS, "goes")  # (routing key, kind, decisions)
    overrides = {
        "num_devices": 20,
        "devices_per_round": 4,
        "rounds": 3,
        "emulation": {"over_selection": 2.0},
        "processes": {"clients": 2, "aggregators": 1},
    }
    new_run, _ = _run(tmp_path, "gos", "gos", **overrides)
    by_kind = {k: [x for x in sent if x[1] is k] for k in (Kind.GO, Kind.GOS)}
    assert not by_kind[Kind.GO] and by_kind[Kind.GOS]
    invited = sum(int(r["selected"]) - int(r["dropped"]) - int(r["rejected"]) for r in read_rounds(new_run))
    assert sum(n for _, _, n in by_kind[Kind.GOS]) == invited  # every ready device got its decision
    assert len(by_kind[Kind.GOS]) <= 2 * 3  # at most one per host and round
    assert len({key for key, _, _ in by_kind[Kind.GOS]}) == 2

    # a host with more decisions than one ``gos`` may carry gets them in several
    import services.server.service as server_module

    sent.clear()
    monkeypatch.setattr(server_module, "MAX_GOS", 1)
    chunked, _ = _run(tmp_path, "gos-chunked", "gos", **overrides)
    assert {x[1] for x in sent} == {Kind.GOS} and [x[2] for x in sent] == [1] * invited
    with np.load(new_run / "global_model.npz") as a, np.load(chunked / "global_model.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in a.files)


@pytest.mark.parametrize("over_selection", [1.0, 2.0])
def test_each_host_gets_its_rounds_tasks_in_one_message_or_one_each_if_it_is_of_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over_selection: float
) -> None:
    """A round sends each host one ``tasks`` with all its devices' tasks; a host of the previous
    schema version (6: it has no ``tasks``) one ``task`` per device. Either way the same devices
    train, each is charged the same download bytes (a lone ``task``'s), and the run ends with the
    same model; with over-selection too (``ready`` answers a part of a ``tasks``, then ``gos``)."""

    import services.server.fanout as fanout_module
    from shared.schemas import KIND_SINCE, PREVIOUS_VERSION
    from shared.schemas.peers import PeerVersions
    from shared.transport import key_host

    assert KIND_SINCE[Kind.TASKS] > PREVIOUS_VERSION
    sent = _tap_batches(monkeypatch, Kind.TASK, Kind.TASKS, "tasks")  # (routing key, kind, tasks)
    overrides: dict[str, Any] = {
        "num_devices": 20,
        "devices_per_round": 4,
        "rounds": 3,
        "emulation": {"over_selection": over_selection},
        "processes": {"clients": 2, "aggregators": 1},
    }
    new_run, _ = _run(tmp_path, "tasks", "tasks", **overrides)
    selected = sum(int(r["selected"]) for r in read_rounds(new_run))
    assert {x[1] for x in sent} == {Kind.TASKS}
    assert sum(n for _, _, n in sent) == selected  # every selected device got its task
    assert len(sent) <= 2 * 3 and len({key for key, _, _ in sent}) == 2  # one per host and round
    assert not json.loads((new_run / "summary.json").read_text()).get("dead_lettered")

    sent.clear()  # a host with more tasks than one ``tasks`` may carry gets them in several
    monkeypatch.setattr(fanout_module, "MAX_TASKS", 1)
    chunked, _ = _run(tmp_path, "tasks-chunked", "tasks", **overrides)
    assert {x[1] for x in sent} == {Kind.TASKS} and [x[2] for x in sent] == [1] * selected

    sent.clear()
    version_for = PeerVersions.version_for

    def hosts_of_the_previous_version(self: PeerVersions, key: str) -> int:
        """What the server writes to a host's key, as if every host were of the previous build."""
        v = version_for(self, key)
        return min(v, PREVIOUS_VERSION) if key.startswith(key_host("")) else v

    # in real time a host gets lone tasks: its devices' transfers are slept through one by one,
    # and one message for all of them would stay unacknowledged for the host's whole round
    sent.clear()
    real = {
        **overrides,
        "rounds": 1,
        "emulation": {"over_selection": over_selection, "time_mode": "real", "time_factor": 1000.0},
    }
    real_run, _ = _run(tmp_path, "tasks-real", "tasks-real", **real)
    assert {x[1] for x in sent} == {Kind.TASK} and len(sent) == int(read_rounds(real_run)[0]["selected"])

    sent.clear()
    monkeypatch.setattr(PeerVersions, "version_for", hosts_of_the_previous_version)
    old_run, _ = _run(tmp_path, "task", "tasks", **overrides)
    assert {x[1] for x in sent} == {Kind.TASK} and len(sent) == selected
    for other in (chunked, old_run):
        _assert_same_run(new_run, other)


def test_a_hosts_answers_of_a_turn_go_in_one_message_with_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In virtual time a host sends the readies (and rejects) that one turn of its loop queued
    as one ``answers`` message, each entry the lone message with its MAC, which the server checks
    and handles as if it had come alone. The run is the one the lone messages make (with
    ``FEDFLEET_BUNDLE=false``, set for ``fedfleet run``); an entry that fails on the server (a bug,
    once) is dead-lettered alone and the others count."""

    from services.server.service import Server

    sent = _tap_batches(monkeypatch, Kind.READY, Kind.ANSWERS, "messages")
    updates = _tap_batches(monkeypatch, Kind.UPDATE, Kind.UPDATES, "messages")
    overrides: dict[str, Any] = {
        "num_devices": 20,
        "devices_per_round": 4,
        "rounds": 3,
        "emulation": {"over_selection": 2.0},
        "processes": {"clients": 2, "aggregators": 1},
    }
    bundled, _ = _run(tmp_path, "answers", "answers", **overrides)
    assert {k for _, k, _ in sent} == {Kind.ANSWERS}
    assert len(sent) <= 2 * 3  # one per host and round: each host's readies of its ``tasks``
    entries = sum(n for _, _, n in sent)
    sent.clear()
    updates.clear()
    # ``FEDFLEET_BUNDLE=false`` (a rollout of hosts before their readers), through the command a
    # user runs: every ready and every update goes alone, and the run is the same
    monkeypatch.setenv("FEDFLEET_BUNDLE", "false")
    cfg = write_config(tmp_path / "lone.yaml", **overrides)
    argv = ["run", str(cfg), "--transport", "inproc", "--runs-dir", str(tmp_path), "--run-id", "lone"]
    assert main(argv) == 0
    lone = tmp_path / "lone"
    assert {k for _, k, _ in sent} == {Kind.READY} and len(sent) == entries > 8
    assert {k for _, k, _ in updates} == {Kind.UPDATE}
    monkeypatch.delenv("FEDFLEET_BUNDLE")
    _assert_same_run(bundled, lone)

    failed = _a_bug_once_in_round_2(monkeypatch, Server, "on_ready")
    # the lost ready keeps round 2 open until its deadline (round 1 must fit in it, warm-up and all)
    run, _ = _run(tmp_path, "answers-bug", "answers", **{**overrides, "round_timeout_s": 8})
    # (a ready lost this way leaves the server waiting for it until round 2's deadline, as a lone
    # one would; the others of that ``answers`` were handled, and only the one is a dead letter)
    rows = read_rounds(run)
    assert [rows[0]["outcome"], rows[2]["outcome"]] == ["completed"] * 2 and len(failed) == 1
    # (its late round-2 updates, if any, are dead-lettered by the aggregators as stale)
    letters = [json.loads(line) for line in (run / "dead_letters.jsonl").read_text().splitlines()]
    assert not [x for x in letters if x["kind"] == "answers"]
    (letter,) = [x for x in letters if x["reason"] == "handler-error"]
    assert (letter["kind"], letter["round"]) == ("ready", 2)  # the entry as its lone message


def _a_bug_once_in_round_2(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> list[int]:
    """Make ``cls.method(env, msg, d)`` raise once, for the first message of round 2 (a bug in
    handling one entry of a bundle); returns the list its device id is added to."""
    failed: list[int] = []
    real = getattr(cls, method)

    def once_a_bug(self: Any, env: Any, msg: Any, d: Any) -> None:
        if env.round == 2 and not failed:
            failed.append(msg.device_id)
            raise RuntimeError(f"a bug in {method}")
        real(self, env, msg, d)

    monkeypatch.setattr(cls, method, once_a_bug)
    return failed


def test_a_hosts_updates_of_a_flush_go_in_one_message_with_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In virtual time a host sends the updates one flush of its outbox holds as one ``updates``
    message, each entry the lone update with its MAC, which the aggregator checks, reduces and
    receipts as if it had come alone. The run is the one the lone messages make (same rounds,
    same bytes per device, same model); the wire-bytes counter of kind ``update`` still counts
    every update's bytes, and an entry that fails on the aggregator (a bug, once) is
    dead-lettered alone, as its lone message, while the others of its ``updates`` count."""
    from prometheus_client import REGISTRY

    import services.client.service as client_module
    from services.aggregator.service import Aggregator
    from services.common import ServiceBase

    # a host's turn goes in one flush, however slow the machine (not split by upload age)
    monkeypatch.setattr(client_module, "UPLOAD_WAIT_S", 60.0)
    sent = _tap_batches(monkeypatch, Kind.UPDATE, Kind.UPDATES, "messages")
    overrides: dict[str, Any] = {
        "num_devices": 24,
        "devices_per_round": 12,
        "rounds": 3,
        "processes": {"clients": 2, "aggregators": 1},
    }

    def wire(exp: str, kind: str) -> float:
        labels = {"experiment": exp, "algorithm": "fedavg", "service": "client", "direction": "up"}
        return REGISTRY.get_sample_value("fedfleet_wire_bytes_total", {**labels, "kind": kind}) or 0.0

    bundled, _ = _run(tmp_path, "updates", "updates-b", **overrides)
    # (a flush that held one update sends it alone: a slow machine's timer may split a flush)
    assert Kind.UPDATES in {k for _, k, _ in sent} and {k for _, k, _ in sent} <= {Kind.UPDATES, Kind.UPDATE}
    entries = sum(n for _, _, n in sent)
    participants = sum(int(r["participants"]) for r in read_rounds(bundled))
    # 12 a round over 2 hosts, each host's in one flush (a small round: far from the flush's bounds)
    assert entries == participants == 36 and len(sent) <= 2 * 3
    summary = json.loads((bundled / "summary.json").read_text())
    # every update's bytes under kind="update" (device uplink plus telemetry), the framing apart
    assert wire("updates-b", "update") == summary["bytes_up"] + summary["telemetry_bytes_up"]
    assert 0 < wire("updates-b", "updates") < 64 * sum(k is Kind.UPDATES for _, k, _ in sent)
    sent.clear()
    with monkeypatch.context() as m:
        m.setattr(ServiceBase, "_bundle", unbundled(Kind.UPDATES))
        lone, _ = _run(tmp_path, "lone-updates", "updates-l", **overrides)
    assert {k for _, k, _ in sent} == {Kind.UPDATE} and len(sent) == entries
    _assert_same_run(bundled, lone)

    failed = _a_bug_once_in_round_2(monkeypatch, Aggregator, "on_update")
    # the lost update keeps round 2 open until its deadline (round 1 must fit in it, warm-up and all)
    run, _ = _run(tmp_path, "updates-bug", "updates-x", **{**overrides, "round_timeout_s": 8})
    rows = read_rounds(run)
    assert [r["outcome"] for r in rows] == ["completed"] * 3 and len(failed) == 1
    assert [int(r["participants"]) for r in rows] == [12, 11, 12]
    letters = [json.loads(line) for line in (run / "dead_letters.jsonl").read_text().splitlines()]
    assert not [x for x in letters if x["kind"] == "updates"]
    (letter,) = [x for x in letters if x["reason"] == "handler-error"]
    assert (letter["kind"], letter["round"]) == ("update", 2)  # the entry as its lone message


@pytest.mark.parametrize("kind", ["task", "go"])
def test_an_entry_that_fails_is_dead_lettered_alone_and_the_hosts_other_devices_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One host serves every device: its round's tasks come in one ``tasks``, its decisions in one
    ``gos``. If handling one entry raises (a bug), that entry is dead-lettered (``handler-error``,
    as the lone message it stands for) and the host's other devices of the round still take part;
    before, the whole message was dead-lettered and the round lost all of them."""
    from services.client.service import Client

    failed = _a_bug_once_in_round_2(monkeypatch, Client, "_dispatch_task" if kind == "task" else "_go")
    overrides: dict[str, Any] = {
        "num_devices": 12,
        "devices_per_round": 6,
        "rounds": 3,
        # the failed device never answers: round 2 ends at its deadline (which round 1, warm-up
        # and all, must fit in)
        "round_timeout_s": 8,
        "processes": {"clients": 1, "aggregators": 1},
    }
    if kind == "go":
        overrides["emulation"] = {"over_selection": 1.5}
    run, _ = _run(tmp_path, f"entry-{kind}", **overrides)
    rows = read_rounds(run)
    assert [r["outcome"] for r in rows] == ["completed"] * 3 and len(failed) == 1
    # every other invited device of round 2 answered (one kept device fewer for ``go``: it was
    # ranked, kept, and its upload never came)
    assert int(rows[1]["participants"]) == 5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dead_lettered"] == 1 and summary["dead_letter_reasons"] == {"handler-error": 1}
    (letter,) = [json.loads(line) for line in (run / "dead_letters.jsonl").read_text().splitlines()]
    assert (letter["kind"], letter["round"]) == (kind, 2)  # the entry as its lone message


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ("0,big,1000000,1e6,1e6,0.01,1e9,1,0,\n1,big,1000000,1e6,,0.01,1e9,1,0,", "row 2"),
        ("0,big,1000000,1e6,1e6,0.01,1e9,1,0,\n1,big,1000000,1e6,-8e6,0.01,1e9,1,0,", "downlink_bps"),
        ("0,big,1000000,1e6,1e6,0.01,1e9,1,0,\n1,huge,1000000,1e6,1e6,0.01,1e9,1,0,", "huge"),
        ("0,big,0,1e6,1e6,0.01,1e9,1,0,\n1,big,1000000,1e6,1e6,0.01,1e9,1,0,", "memory_bytes"),
    ],
)
def test_bad_fleet_files_are_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: str, fragment: str
) -> None:
    header = (
        "device_id,tier,memory_bytes,uplink_bps,downlink_bps,latency_s,flops_per_s,p_online,p_dropout,trace"
    )
    (tmp_path / "fleet.csv").write_text(f"{header}\n{row}\n")
    tiers: dict[str, Any] | None = {"big": {}} if fragment == "huge" else None
    fleet: dict[str, Any] = {"trace_file": "fleet.csv"}
    if tiers:
        fleet["tiers"] = tiers
    cfg = write_config(tmp_path / "c.yaml", num_devices=2, devices_per_round=1, fleet=fleet)
    rc = main(["run", str(cfg), "--transport", "inproc", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "fleet.csv" in err and fragment in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
