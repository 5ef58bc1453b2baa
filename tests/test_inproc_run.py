"""Whole experiments in one process over the in-process broker: results files, reduction algebra,
exactly-once under an aggregator crash, and the report/compare commands."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cli import main
from services.common import ServiceBase
from services.orchestrator import InprocCluster, run_inproc
from shared.algorithms.base import UpdateSpec
from shared.codec import Dense
from shared.config import load_config
from shared.experiment import Experiment
from shared.schemas import Kind
from shared.transport.inproc import InprocTransport
from tests.conftest import reduce_two_ways, tap_inproc_publishes, unbundled, write_config

SUMMARY_KEYS = {
    "algorithm",
    "transport",
    "rounds",
    "final_accuracy",
    "best_accuracy",
    "bytes_up",
    "bytes_down",
    "dense_bytes_up",
    "dense_bytes_down",
    "wall_seconds",
}
ROUND_KEYS = {
    "round",
    "accuracy",
    "loss",
    "bytes_up",
    "bytes_down",
    "dense_bytes_up",
    "dense_bytes_down",
    "participants",
    "wall_seconds",
}


def test_inproc_run_writes_readable_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(write_config(tmp_path / "c.yaml", rounds=4))
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(cfg, run, "inproc-test") == 0
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert summary["transport"] == "inproc" and summary["rounds"] == 4
    assert summary["final_accuracy"] > 0.5  # 10 classes: chance is 0.1
    # FedAvg sends dense float32: wire bytes are the dense bytes plus headers (envelope, metrics,
    # timings: ~0.8 KB on this 2,410-parameter model)
    assert 1.0 <= summary["bytes_up"] / summary["dense_bytes_up"] < 1.10
    rows = list(csv.DictReader((run / "rounds.csv").open()))
    assert set(rows[0]) >= ROUND_KEYS and len(rows) == 4
    assert [int(r["participants"]) for r in rows] == [4, 4, 4, 4]
    devices = list(csv.DictReader((run / "devices.csv").open()))
    assert len(devices) == 8 and sum(int(d["selected"]) for d in devices) == 16
    for png in ("accuracy_vs_round.png", "accuracy_vs_bytes.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(run)]) == 0
    assert main(["compare", str(run), str(run), "--plot", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "final accuracy" in out and "comparison" in out and "cmp.png" in out
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=2, max_size=8), st.randoms(use_true_random=False))
def test_fedavg_reduction_is_associative_and_commutative(weights: list[int], rnd: Any) -> None:
    exp = Experiment.build(load_config(write_config(Path("/tmp/fedfleet-cfg.yaml"))))
    strategy = exp.strategy
    updates = [UpdateSpec({k: Dense(v) for k, v in _arrays(i).items()}, n) for i, n in enumerate(weights)]
    one, merged = reduce_two_ways(strategy, updates, rnd)
    for k in one.arrays:
        np.testing.assert_allclose(one.arrays[k], merged.arrays[k], rtol=1e-12, atol=1e-12)
    assert one.scalars["weight"] == merged.scalars["weight"] == sum(weights)


def _cluster(cfg_path: Path, run: Path, exp_id: str) -> InprocCluster:
    """Two aggregators and one client hosting every device, over the in-process broker."""
    exp = Experiment.build(load_config(cfg_path))
    return InprocCluster(exp, run, exp_id, aggregators=2, clients=1, state_dir=run / "state")


#: more devices a round than an aggregator's window (``prefetch`` 8): the first aggregator cannot
#: hold every update of a round (it would send its partial unasked), so when it crashes it holds
#: updates in a partial sent but not decided and updates in no partial yet, and both must count once
WIDE = {"num_devices": 12, "devices_per_round": 10}


def _dead_letters(cluster: InprocCluster) -> list[tuple[str, bytes]]:
    """(reason, body) of every dead letter the in-process broker holds for the cluster's run."""
    transport = cluster.server.transport
    assert isinstance(transport, InprocTransport)
    held = transport.broker.queues.get(transport.names.dead_letter_queue, ())
    return [(m.headers["x-fedfleet-reason"], m.body) for m in held]


@pytest.mark.parametrize("bundled", [False, True], ids=["lone-updates", "updates-bundles"])
def test_aggregator_crash_counts_every_update_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bundled: bool
) -> None:
    """An aggregator dies holding updates; every update counts once, the model is a clean run's.

    Lone updates (a host of the previous build, or real time) fill the aggregator's window one by
    one, so it dies with some updates in a partial not yet decided and some in none yet. A host's
    ``updates`` bundles (virtual time) reach it as two messages a round here, both handled in one
    turn; it dies with its partials undecided, and the bundles come back whole to the other
    aggregator, whose singletons the server refuses where the dead one's partial already counted.
    """
    if not bundled:
        monkeypatch.setattr(ServiceBase, "_bundle", unbundled(Kind.UPDATES))
    cfg = write_config(tmp_path / "c.yaml", rounds=3, **WIDE)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference = _cluster(cfg, tmp_path / "a", "clean")
    assert reference.run(max_steps=200_000) == 0
    clean = reference.server

    cluster = _cluster(cfg, tmp_path / "b", "crash")
    faulty = cluster.server
    agg0 = cluster.aggregators[0]
    crashed: list[tuple[int, int]] = []

    def crash_when_holding() -> None:
        # Crash agg-0 the first time it holds round-2 updates whose partial the server has not
        # accepted (not round 1's last partial, whose decision may still be on its way).
        if not crashed and agg0.round == 2 and agg0.seen and agg0.held_updates() >= 1:
            crashed.append((agg0.held_updates(), len(agg0.batch.deliveries)))
            cluster.crash(agg0)

    cluster.run(on_step=crash_when_holding, max_steps=200_000)
    assert crashed, "the crash never happened"
    held, unsent = crashed[0]
    if bundled:
        assert held == WIDE["devices_per_round"] and unsent == 0, crashed  # all in undecided partials
        letters = [d for d in _dead_letters(cluster) if d[0] == "duplicate"]
        assert 1 <= len(letters) <= held  # refused singletons of updates the dead one's partial merged
    else:
        assert held > unsent >= 1, crashed  # some in a partial awaiting its decision, some in none yet
    assert len(cluster.aggregators) == 1 and cluster.aggregators[0] is not agg0
    for name, arr in clean.state.arrays.items():
        np.testing.assert_allclose(faulty.state.arrays[name], arr, atol=1e-6, rtol=0)
    assert [r["participants"] for r in faulty.rows] == [r["participants"] for r in clean.rows]


def test_a_kill_between_the_checkpoint_renames_resumes_from_the_previous_one(tmp_path: Path) -> None:
    """The server replaces its checkpoint by two renames (checkpoint → .old, .tmp → checkpoint).

    Killed between them, only ``checkpoint.old`` is whole (``checkpoint.tmp`` may be half written):
    the restarted server must restore it, not start over and not read the half-written one, and
    the run must end with the model of an uninterrupted run.
    """
    cfg = write_config(tmp_path / "c.yaml", rounds=3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    clean_cluster = _cluster(cfg, tmp_path / "a", "clean")
    clean_cluster.run(max_steps=200_000)
    clean = clean_cluster.server

    run = tmp_path / "b"
    killed = _cluster(cfg, run, "killed")
    first = killed.server
    killed.run(until=lambda: len(first.rows) == 2, max_steps=200_000)  # round 2's checkpoint written
    assert len(first.rows) == 2 and (run / "checkpoint" / "state.json").exists()
    killed.close()
    shutil.rmtree(run / "checkpoint.old")  # a save first drops round 1 (the one before the previous)
    (run / "checkpoint").rename(run / "checkpoint.old")  # the kill: first rename done, not the second
    (run / "checkpoint.tmp").mkdir()
    (run / "checkpoint.tmp" / "state.json").write_text('{"round": 3, "sta')

    again_cluster = _cluster(cfg, run, "killed")
    resumed = again_cluster.server
    assert resumed.resumed and resumed.round == 2
    assert (run / "checkpoint" / "state.json").exists() and not (run / "checkpoint.old").exists()
    again_cluster.run(max_steps=200_000)
    assert [r["round"] for r in resumed.rows] == [1, 2, 3]
    for name, arr in clean.state.arrays.items():
        np.testing.assert_allclose(resumed.state.arrays[name], arr, atol=1e-6, rtol=0)

    # with neither whole, nothing is resumed: the run starts over rather than read a partial file
    fresh = tmp_path / "c"
    (fresh / "checkpoint.tmp").mkdir(parents=True)
    (fresh / "checkpoint.tmp" / "state.json").write_text('{"round": 3, "sta')
    again = _cluster(cfg, fresh, "fresh").server
    assert not again.resumed and again.round == 0


def test_aggregator_started_after_the_round_opened_joins_it(tmp_path: Path, monkeypatch: Any) -> None:
    """An aggregator that starts after a round opened (late start, scale-up, restart) learns the
    round from the server's repeated ``round_open``: when the only other aggregator then crashes
    holding updates, the newcomer aggregates their redeliveries and every update still counts once.
    (Without the repeat it could only requeue them until the flush deadline dropped them.)"""
    import services.server.service as server_service

    monkeypatch.setattr(server_service, "ROUND_OPEN_REPEAT_S", 0.0)  # repeat on every tick
    # lone updates: the holder fills its window one by one and dies holding some in no partial (a
    # host's bundles would all be handled in one turn and sent on in partials)
    monkeypatch.setattr(ServiceBase, "_bundle", unbundled(Kind.UPDATES))
    cfg = write_config(tmp_path / "c.yaml", rounds=2, **WIDE)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    clean_cluster = _cluster(cfg, tmp_path / "a", "clean")
    clean_cluster.run(max_steps=200_000)
    clean = clean_cluster.server

    cluster = _cluster(cfg, tmp_path / "b", "late")
    faulty = cluster.server
    cluster.crash(cluster.aggregators[1])  # start with one aggregator only
    holder = cluster.aggregators[0]
    events: list[str] = []

    def late_start_then_crash() -> None:
        if not events and faulty.round == 1 and faulty.phase == "open":
            cluster.add_aggregator("agg-late")
            events.append("late")
        if events == ["late"] and holder.held_updates() >= 1:
            unsent.append(len(holder.batch.deliveries))
            cluster.crash(holder)
            events.append("crash")

    unsent: list[int] = []
    cluster.run(on_step=late_start_then_crash, max_steps=200_000)
    assert events == ["late", "crash"], events
    assert unsent[0] >= 1  # the newcomer had updates no partial brought to aggregate
    for name, arr in clean.state.arrays.items():
        np.testing.assert_allclose(faulty.state.arrays[name], arr, atol=1e-6, rtol=0)
    assert [r["participants"] for r in faulty.rows] == [r["participants"] for r in clean.rows]


def test_the_first_round_waits_for_min_hosts_then_for_the_registration_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``hosts.min_hosts``: one host serving the whole fleet does not start the run while a second is
    wanted (a slow host would find every device leased and a short run over); once it joins, the
    first round shares the fleet between both. With more hosts wanted than ever join, the run starts
    at the registration deadline and says so."""
    from services.server.round import Phase

    cfg = write_config(tmp_path / "c.yaml", rounds=2, hosts={"join_quiet_s": 0.0, "min_hosts": 2})
    (tmp_path / "a").mkdir()
    cluster = InprocCluster(Experiment.build(load_config(cfg)), tmp_path / "a", "min-hosts", clients=1)
    server = cluster.server
    cluster.run(until=lambda: len(server.leases.table.available_ids()) == 8, max_steps=100_000)
    for _ in range(200):  # the one host serves every device: without min_hosts the run would start
        cluster.step()
    assert server.phase == Phase.REGISTERING
    cluster.add_client("client-late")
    cluster.run(until=lambda: server.phase != Phase.REGISTERING, max_steps=100_000)
    held = sorted(len(h.devices) for h in server.leases.table.hosts.values())
    assert held == [4, 4], held
    assert cluster.run(max_steps=200_000) == 0
    assert [r["participants"] for r in server.rows] == [4, 4]

    cfg = write_config(
        tmp_path / "d.yaml", rounds=1, registration_timeout_s=0.5, hosts={"join_quiet_s": 0.0, "min_hosts": 3}
    )
    (tmp_path / "b").mkdir()
    late = InprocCluster(Experiment.build(load_config(cfg)), tmp_path / "b", "min-hosts-deadline", clients=2)
    with caplog.at_level("WARNING", logger="fedfleet.server"):
        assert late.run(max_steps=1_000_000) == 0
    warned = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "registration_timeout"]
    assert warned == ["starting with 8 of 8 devices served by 2 host(s) (3 wanted)"], warned
    assert len(late.server.rows) == 1


def test_a_host_heartbeats_between_the_tasks_of_a_long_turn(tmp_path: Path, monkeypatch: Any) -> None:
    """A host takes ``client_prefetch`` tasks at once and trains them in one turn of its loop; its
    heartbeats must not wait for the turn's end, or slow tasks would cost it its lease."""
    import time

    cfg = write_config(
        tmp_path / "c.yaml",
        rounds=1,
        devices_per_round=8,
        hosts={"heartbeat_s": 0.05, "lease_timeout_s": 5.0},
        processes={"client_prefetch": 8},
    )
    exp = Experiment.build(load_config(cfg))
    train, started = exp.strategy.train, []

    def slow(task: Any, ctx: Any) -> Any:
        started.append(time.perf_counter())
        time.sleep(0.06)
        return train(task, ctx)

    monkeypatch.setattr(exp.strategy, "train", slow)
    (tmp_path / "a").mkdir()
    cluster = InprocCluster(exp, tmp_path / "a", "long-turn", aggregators=1, clients=1)
    host, beats = cluster.clients[0], list[float]()
    heartbeat = host.heartbeat

    def counted() -> None:
        beats.append(time.perf_counter())
        heartbeat()

    monkeypatch.setattr(host, "heartbeat", counted)
    turns: list[int] = []  # tasks started before each turn of the host
    turn = host.turn

    def counted_turn(poll_s: float) -> None:
        turns.append(len(started))
        turn(poll_s)

    monkeypatch.setattr(host, "turn", counted_turn)
    assert cluster.run(max_steps=100_000) == 0
    assert len(started) == 8 and 0 in turns and 8 in turns and not set(turns) & set(range(1, 8))
    during = [b for b in beats if started[0] < b < started[-1]]  # the 8 tasks trained in one turn
    assert len(during) >= 3, (len(during), len(beats))


def test_a_leave_asked_from_a_signal_handler_publishes_nothing_until_the_next_tick(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """SIGTERM runs ``terminate`` in a signal handler, which may interrupt a publish between its
    frames; a publish from there interleaves with it and the broker closes the connection (505
    UNEXPECTED_FRAME, seen in CI on a scale-down). So ``terminate`` only asks: the heartbeat that
    announces the leave goes from the loop's next tick, and the host still hands its devices back."""
    from shared.schemas import Heartbeat, decode
    from shared.transport import KEY_SERVER

    cfg = write_config(tmp_path / "c.yaml", rounds=3, devices_per_round=4)
    (tmp_path / "a").mkdir()
    cluster = InprocCluster(Experiment.build(load_config(cfg)), tmp_path / "a", "leave", clients=2)
    cluster.run(until=lambda: len(cluster.server.rows) >= 1, max_steps=100_000)
    host = cluster.clients[1]
    sent: list[tuple[str, bytes]] = []
    publish, publish_many = host.transport.publish, host.transport.publish_many

    def spied(
        key: str, body: bytes, headers: dict[str, Any] | None = None, *, transient: bool = False
    ) -> None:
        sent.append((key, body))
        publish(key, body, headers, transient=transient)

    def spied_many(items: Any, *, transient: bool = False) -> set[str]:
        sent.extend(items)
        return publish_many(items, transient=transient)

    monkeypatch.setattr(host.transport, "publish", spied)
    monkeypatch.setattr(host.transport, "publish_many", spied_many)
    host.terminate()
    assert host.leaving and sent == []
    host.tick()
    assert [key for key, _ in sent] == [KEY_SERVER]
    _, beat = decode(sent[0][1], max_bytes=1 << 20, exp="leave")
    assert isinstance(beat, Heartbeat) and beat.leaving
    assert cluster.run(max_steps=200_000) == 0
    assert host in cluster.exited and len(cluster.server.rows) == 3


def test_doc_block_is_replaced_between_markers_and_missing_markers_fail(tmp_path: Path) -> None:
    from shared.results import replace_doc_block

    doc = tmp_path / "doc.md"
    doc.write_text("# t\nprose\n<!-- r:begin -->\nold | 1\n<!-- r:end -->\nmore prose\n")
    replace_doc_block(doc, "r", "| new | 2 |\n")
    assert doc.read_text() == "# t\nprose\n<!-- r:begin -->\n| new | 2 |\n<!-- r:end -->\nmore prose\n"
    with pytest.raises(ValueError, match="needs exactly one"):
        replace_doc_block(doc, "other", "x")
    assert "| new | 2 |" in doc.read_text()  # untouched by the failed call


def test_run_inproc_once_reuses_a_finished_run_and_force_redoes_it(tmp_path: Path) -> None:
    """What every benchmark script relies on: a finished run is reused, ``force`` redoes it, and
    the resolved config sits beside the results."""
    from services.orchestrator import run_inproc_once

    cfg = load_config(write_config(tmp_path / "c.yaml", rounds=1))
    run = tmp_path / "run"
    assert run_inproc_once(cfg, run, "once-a") is True
    assert load_config(run / "config.yaml") == cfg
    first = (run / "summary.json").stat().st_mtime_ns
    assert run_inproc_once(cfg, run, "once-b") is False
    assert (run / "summary.json").stat().st_mtime_ns == first
    assert run_inproc_once(cfg, run, "once-c", force=True) is True
    assert (run / "summary.json").stat().st_mtime_ns != first


def test_only_updates_are_published_as_losable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every service's publishes over a short run: a device's update, and nothing else, goes out
    ``transient`` (the broker may drop it on a restart: its device falls silent in that round);
    tasks, payloads, leases, partials and round control stay persistent."""
    from shared.transport.base import KEY_UPDATE

    seen: list[tuple[str, bool]] = []

    def spied(key: str, body: bytes, transient: bool) -> bool:
        seen.append((key, transient))
        return True

    tap_inproc_publishes(monkeypatch, spied)
    cfg = write_config(tmp_path / "c.yaml", rounds=2)
    (tmp_path / "run").mkdir()
    assert run_inproc(load_config(cfg), tmp_path / "run", "modes", show_progress=False) == 0
    updates = [t for key, t in seen if key == KEY_UPDATE]
    others = [(key, t) for key, t in seen if key != KEY_UPDATE]
    assert updates and all(updates)
    assert others and not any(t for _, t in others)


def _partials_sent(monkeypatch: Any) -> list[tuple[int, int, int]]:
    """Record every partial an aggregator sends as (round, updates in it, partials then awaiting a
    decision)."""
    from services.aggregator.service import Aggregator

    sent: list[tuple[int, int, int]] = []
    send = Aggregator._send

    def recorded(self: Aggregator, batch: Any) -> None:
        sent.append((self.round, len(batch.devices), len(self.pending)))
        send(self, batch)

    monkeypatch.setattr(Aggregator, "_send", recorded)
    return sent


def _windowed(tmp_path: Path, *, aggregators: int, name: str) -> InprocCluster:
    """3 rounds of all 12 devices, 2 hosts and ``aggregators`` aggregators with a prefetch window of 4."""
    processes = {"aggregators": aggregators, "clients": 2, "prefetch": 4}
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml",
            rounds=3,
            num_devices=12,
            devices_per_round=12,
            quorum_fraction=1.0,
            processes=processes,
        )
    )
    return InprocCluster(Experiment.build(cfg), tmp_path / "run", name, aggregators=aggregators, clients=2)


def test_an_aggregator_sends_no_partial_while_one_awaits_its_decision(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Issue 16: with ``prefetch - 1`` updates held, the aggregator sends them as a partial; the
    updates the broker hands it before the server's decision wait for that decision (it frees
    the window) instead of going out as a partial of one or two, which costs the server a whole
    model's decode and merge. Here 12 devices a round, one aggregator, a window of 4: partials of
    3 updates (the last may be smaller), every round complete, every update merged once."""
    sent = _partials_sent(monkeypatch)
    cluster = _windowed(tmp_path, aggregators=1, name="held")
    assert cluster.run(max_steps=200_000) == 0
    assert [r["participants"] for r in cluster.server.rows] == [12, 12, 12]
    assert [r["outcome"] for r in cluster.server.rows] == ["completed"] * 3
    for rnd in (1, 2, 3):
        sizes = [n for r, n, _ in sent if r == rnd]
        assert sum(sizes) == 12, sent
        assert all(n == 3 for n in sizes[:-1]), sent  # before: 3, 1, 2, 1, ... (a partial per decision wait)
        # only the round's last partial (all devices in, or the server's flush) may go while
        # another awaits its decision
        assert all(w == 0 for w in [w for r, _, w in sent if r == rnd][:-1]), sent


def test_an_aggregator_holding_every_update_of_the_round_sends_it_unasked(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Issue 16: an aggregator that has reduced the update of every device selected for the round
    sends its partial at once; nothing more can reach it, so waiting for the server's flush (a
    round trip at the end of every round) buys nothing."""
    from services.server.service import Server

    flushes: list[int] = []
    start_flush = Server._start_flush

    def counted(self: Server, rs: Any, now: float) -> None:
        flushes.append(rs.number)
        start_flush(self, rs, now)

    monkeypatch.setattr(Server, "_start_flush", counted)
    sent = _partials_sent(monkeypatch)
    cfg = load_config(write_config(tmp_path / "c.yaml", rounds=3, processes={"aggregators": 1, "clients": 1}))
    cluster = InprocCluster(Experiment.build(cfg), tmp_path / "run", "unasked", aggregators=1, clients=1)
    assert cluster.run(max_steps=200_000) == 0
    assert [r["participants"] for r in cluster.server.rows] == [4, 4, 4]
    # one partial a round, of all four devices; the server found every receipted update merged
    # when the last receipt came, so it finished each round without a flush
    assert [(r, n) for r, n, _ in sent] == [(1, 4), (2, 4), (3, 4)]
    assert flushes == []


def test_a_merged_update_whose_receipt_is_late_still_counts_with_its_bytes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """An aggregator sends a partial ahead of its updates' receipts. In one transaction on classic
    queues, but one confirm each on quorum queues, so there the server can hold merged updates
    without their receipts for a moment. Here the receipts are held back past the round's
    deadline (the partial alone is published): the merged updates count toward the quorum (the
    round flushes instead of ending ``below-quorum`` and throwing them away), and the round ends
    only once their receipts are in, with every device's bytes — the same rows as a run whose
    receipts were never late."""
    from services.aggregator.service import Aggregator
    from services.common import ServiceBase
    from services.server.round import Phase

    overrides: dict[str, Any] = {"rounds": 2, "round_timeout_s": 3.0, "processes": {"aggregators": 1}}
    cfg = load_config(write_config(tmp_path / "c.yaml", **overrides))
    clean = InprocCluster(Experiment.build(cfg), tmp_path / "clean", "clean", aggregators=1, clients=1)
    assert clean.run(max_steps=200_000) == 0

    late = InprocCluster(Experiment.build(cfg), tmp_path / "late", "late", aggregators=1, clients=1)
    flush = Aggregator.flush
    held_back: list[int] = []

    def late_receipts(self: Aggregator) -> None:
        rs = late.server.rs
        if self.receipts and rs is not None and late.server.phase != Phase.FLUSHING:
            # the partial went; its receipts wait until the deadline has passed and the server
            # flushes (which it does only if the merged updates count toward the quorum)
            held_back.append(rs.number)
            ServiceBase.flush(self)  # what is queued (the partial), not the receipts
            return
        flush(self)

    monkeypatch.setattr(Aggregator, "flush", late_receipts)
    assert late.run(max_steps=2_000_000) == 0
    assert set(held_back) == {1, 2}
    keep = ("round", "outcome", "participants", "bytes_up", "dense_bytes_up", "accuracy")
    assert [{k: r[k] for k in keep} for r in late.server.rows] == [
        {k: r[k] for k in keep} for r in clean.server.rows
    ]
    assert [r["outcome"] for r in late.server.rows] == ["completed", "completed"]
    columns = ("device_id", "completed", "bytes_up", "virtual_seconds")

    def devices(run: Path) -> list[dict[str, str]]:
        return [{k: d[k] for k in columns} for d in csv.DictReader((run / "devices.csv").open())]

    assert devices(tmp_path / "late") == devices(tmp_path / "clean")


def test_a_partial_and_its_receipts_are_published_in_one_batch(tmp_path: Path) -> None:
    """Every partial an aggregator publishes goes in one ``publish_many`` (one broker transaction
    on classic queues) with the receipts of the updates in it that are not out yet (a turn that
    ends publishes the receipts it has), the partial first: a crash cannot land a partial without
    its receipts. Before, the partial was a confirmed publish of its own and its receipts followed."""
    from shared.schemas import Kind, Partial, Receipts, decode

    cluster = _windowed(tmp_path, aggregators=2, name="one-tx")
    batches: list[tuple[str, list[tuple[Any, Any]]]] = []
    for agg in cluster.aggregators:
        publish, publish_many = agg.transport.publish, agg.transport.publish_many
        batching = [False]  # the in-process transport publishes a batch message by message

        def lone(
            key: str,
            body: bytes,
            headers: Any = None,
            *,
            transient: bool = False,
            p: Any = publish,
            a: Any = agg,
            b: list[bool] = batching,
        ) -> None:
            if not b[0]:
                batches.append((a.aggregator_id, [decode(body, max_bytes=1 << 26)]))
            p(key, body, headers, transient=transient)

        def many(
            items: Any,
            *,
            transient: bool = False,
            p: Any = publish_many,
            a: Any = agg,
            b: list[bool] = batching,
        ) -> set[str]:
            batches.append((a.aggregator_id, [decode(body, max_bytes=1 << 26) for _, body in items]))
            b[0] = True
            try:
                return set(p(items, transient=transient))
            finally:
                b[0] = False

        agg.transport.publish = lone  # type: ignore[method-assign]
        agg.transport.publish_many = many  # type: ignore[method-assign]
    assert cluster.run(max_steps=500_000) == 0
    assert [r["outcome"] for r in cluster.server.rows] == ["completed"] * 3
    partials: dict[int, int] = {}  # round → partials sent
    receipted: dict[tuple[str, int], set[int]] = {}  # (aggregator, round) → devices receipted so far
    for agg_id, batch in batches:
        kinds = [env.kind for env, _ in batch]
        if Kind.PARTIAL in kinds and Kind.RECEIPTS in kinds:
            assert kinds.index(Kind.PARTIAL) < kinds.index(Kind.RECEIPTS), kinds  # the partial first
        for env, body in batch:
            if env.kind is Kind.RECEIPTS:
                assert isinstance(body, Receipts)
                receipted.setdefault((agg_id, env.round), set()).update(r.device_id for r in body.receipts)
        for env, body in batch:
            if env.kind is Kind.PARTIAL:
                assert isinstance(body, Partial)
                partials[env.round] = partials.get(env.round, 0) + 1
                assert set(body.devices) <= receipted.get((agg_id, env.round), set()), (agg_id, env.round)
    # 12 updates a round, a window of 4: each round takes several partials
    assert all(partials.get(r, 0) >= 2 for r in (1, 2, 3)), partials


def test_a_rounds_payloads_and_tasks_are_published_in_one_batch(tmp_path: Path) -> None:
    """A round's fan-out is one ``publish_many`` (one broker transaction on classic queues): each
    host's payload, then the ``tasks`` that refer to it. Before, the payloads were a transaction of
    their own and the tasks followed in a second one, whose commit the hosts waited for while they
    decoded the payloads (``services/server/fanout.py``)."""
    from shared.schemas import Kind, decode

    cluster = _windowed(tmp_path, aggregators=1, name="fanout-tx")
    server = cluster.server
    calls: list[list[tuple[Kind, str]]] = []
    publish_many = server.transport.publish_many

    def many(items: Any, *, transient: bool = False) -> set[str]:
        calls.append([(decode(body, max_bytes=1 << 26)[0].kind, key) for key, body in items])
        return set(publish_many(items, transient=transient))

    server.transport.publish_many = many  # type: ignore[method-assign]
    assert cluster.run(max_steps=200_000) == 0
    assert [r["outcome"] for r in server.rows] == ["completed"] * 3
    fanouts = [c for c in calls if any(kind in (Kind.PAYLOAD, Kind.TASKS) for kind, _ in c)]
    assert len(fanouts) == 3, [[k.value for k, _ in c] for c in calls]  # one per round, nothing else
    for call in fanouts:
        kinds = [kind for kind, _ in call]
        hosts = {key for _, key in call}
        assert len(hosts) == 2, call  # both hosts serve devices of every round
        for host in hosts:
            # this host's payload, then its tasks
            assert [k for k, key in call if key == host] == [Kind.PAYLOAD, Kind.TASKS], call
        assert kinds.index(Kind.TASKS) > max(i for i, k in enumerate(kinds) if k is Kind.PAYLOAD), kinds
