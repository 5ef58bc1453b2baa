"""No silent success (#19, item 6): a round the broker lost is named ``lost`` and repeated, or the run fails.

The rule that tells "lost to the broker" from "the emulated fleet could not deliver" is
``RoundState.lost_to_broker``; it is checked here case by case, then end to end in one process: a
broker that confirms a round's tasks and then loses them (what a host queue on a lost node does)
is simulated by dropping the server's task and payload publishes of one attempt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common import PublishItem
from services.orchestrator import InprocCluster
from services.server.round import RepeatPolicy, RoundState
from shared import metrics
from shared.config import load_config
from shared.experiment import Experiment
from shared.schemas import Kind, Ready, Receipt, Reject, RoundOpen
from tests.conftest import tap_inproc_publishes, write_config

ROUNDS = 3
#: the wall-clock deadline of a round: what a lost attempt waits before it is declared lost. A first
#: round on a loaded machine can take longer (torch warming up); it is then lost and repeated, and the
#: late updates count for the repeat — which the assertions below allow for
TIMEOUT_S = 5.0


def _round(selected: list[int]) -> RoundState:
    announcement = RoundOpen(selected=selected, deadline_unix=0.0, round_key="00" * 16)
    return RoundState(
        number=2,
        selected=selected,
        offline=0,
        key="00" * 16,
        started=0.0,
        deadline=0.0,
        announcement=announcement,
        last_announced=0.0,
    )


def _receipt(device: int) -> Receipt:
    return Receipt(device_id=device, aggregator_id="a", update_bytes=100, dense_bytes=100, num_samples=10)


# -- the rule ------------------------------------------------------------------------------------------
def test_a_round_nobody_answered_is_lost() -> None:
    rs = _round([1, 2, 3])
    why = rs.lost_to_broker(set(), broker_fault=False)
    assert why is not None and "none of the 3 devices" in why
    assert rs.missing(set()) == {1, 2, 3}


def test_unreachable_and_host_lost_devices_count_as_missing() -> None:
    """Neither is the emulation's doing: a task nobody could receive, a host whose heartbeats stopped."""
    rs = _round([1, 2])
    rs.unreachable.add(1)
    rs.discarded[2] = "host-lost"
    assert rs.lost_to_broker(set(), broker_fault=False) is not None


def _all_refused(rs: RoundState) -> None:
    rs.rejects.update({d: Reject(device_id=d, reason="memory") for d in rs.selected})


def _all_dropped_out(rs: RoundState) -> None:
    rs.discarded.update(dict.fromkeys(rs.selected, "dropout"))


def _all_late(rs: RoundState) -> None:
    rs.readies.update({d: Ready(device_id=d, finish_s=9.0, update_bytes=100) for d in rs.selected})
    rs.discarded.update(dict.fromkeys(rs.selected, "deadline"))


@pytest.mark.parametrize(
    "answer",
    [_all_refused, _all_dropped_out, _all_late],
    ids=["all-refused", "all-dropped-out", "all-past-the-emulated-deadline"],
)
def test_a_round_the_emulation_emptied_stays_below_quorum(answer: Callable[[RoundState], None]) -> None:
    """Refusals, dropout notices and late finishers are answers: repeating the round repeats them."""
    rs = _round([1, 2, 3])
    answer(rs)
    assert rs.missing(set()) == set()
    assert rs.lost_to_broker(set(), broker_fault=False) is None
    assert rs.lost_to_broker(set(), broker_fault=True) is None


def test_silent_dropouts_in_real_time_are_the_emulations() -> None:
    """In ``real`` time a dropped-out device sends no notice; the server knows it dropped out."""
    rs = _round([1, 2])
    assert rs.lost_to_broker({1, 2}, broker_fault=False) is None
    assert rs.lost_to_broker({1}, broker_fault=False) is not None  # device 2 should have answered


def test_in_real_time_silence_alone_is_stragglers() -> None:
    """Devices throttled in wall time may all be stragglers at the deadline: only a fault the
    server's transport saw makes such a round lost."""
    rs = _round([1, 2])
    assert rs.lost_to_broker(set(), broker_fault=False, real_time=True) is None
    assert rs.lost_to_broker(set(), broker_fault=True, real_time=True) is not None


def test_some_answers_and_a_broker_fault_make_a_lost_round() -> None:
    """One device refused, the other stayed silent: only a fault the server saw makes that lost."""
    rs = _round([1, 2])
    rs.rejects[1] = Reject(device_id=1, reason="memory")
    assert rs.lost_to_broker(set(), broker_fault=False) is None
    why = rs.lost_to_broker(set(), broker_fault=True)
    assert why is not None and "1 devices stayed silent" in why


def test_a_round_with_a_participant_is_never_lost() -> None:
    rs = _round([1, 2, 3])
    rs.receipt(_receipt(1))
    rs.covered.add(1)
    assert rs.lost_to_broker(set(), broker_fault=True) is None


def test_repeat_pauses_back_off_to_their_bound() -> None:
    policy = RepeatPolicy(repeats=3, budget_s=60, backoff_s=0.25, backoff_max_s=0.6)
    assert [policy.pause(a) for a in (1, 2, 3)] == [0.25, 0.5, 0.6]


# -- end to end, in one process ------------------------------------------------------------------------
def _cluster(tmp_path: Path, name: str) -> InprocCluster:
    cfg = load_config(write_config(tmp_path / f"{name}.yaml", rounds=ROUNDS, round_timeout_s=TIMEOUT_S))
    run = tmp_path / name
    run.mkdir()
    cluster = InprocCluster(Experiment.build(cfg), run, f"lost-{name}", aggregators=2, clients=2)
    cluster.server.repeat = RepeatPolicy(repeats=2, budget_s=120, backoff_s=0.05, backoff_max_s=0.2)
    return cluster


def _lose_tasks(cluster: InprocCluster, number: int, attempts: set[int]) -> list[int]:
    """Make the broker lose round ``number``'s tasks and payloads in ``attempts``: the publish is
    confirmed, nothing reaches a host. Returns the list the attempts that lost them are added to."""
    server = cluster.server
    publish = server._publish_many
    hit: list[int] = []
    lose = (Kind.TASK, Kind.TASKS, Kind.PAYLOAD)

    def lossy(items: list[PublishItem]) -> set[str]:
        rs = server.rs
        if rs is None or rs.number != number or rs.attempt not in attempts:
            return publish(items)
        if any(item.kind in (Kind.TASK, Kind.TASKS) for item in items):
            hit.append(rs.attempt)
        kept = [item for item in items if item.kind not in lose]
        return publish(kept) if kept else set()

    server._publish_many = lossy  # type: ignore[method-assign]
    return hit


def _model(run: Path) -> dict[str, np.ndarray]:
    with np.load(run / "global_model.npz") as z:
        return {k: z[k] for k in z.files}


def _lost_count(exp: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "fedfleet_rounds_total", {"experiment": exp, "algorithm": "fedavg", "outcome": "lost"}
    )
    return value or 0.0


def test_a_lost_round_is_repeated_and_the_model_is_the_clean_runs(tmp_path: Path) -> None:
    clean = _cluster(tmp_path, "clean")
    assert clean.run(max_steps=2_000_000) == 0
    faulty = _cluster(tmp_path, "faulty")
    hit = _lose_tasks(faulty, 2, {1})
    assert faulty.run(max_steps=2_000_000) == 0
    assert hit == [1], "the fault was not injected"

    rows = faulty.server.rows
    assert next(r["outcome"] for r in rows if r["round"] == 2) == "lost"
    kept = [r for r in rows if r["outcome"] != "lost"]
    assert [r["round"] for r in kept] == list(range(1, ROUNDS + 1))
    assert all(r["outcome"] == "completed" for r in kept)
    lost = [r for r in rows if r["outcome"] == "lost"]
    assert all(r["participants"] == 0 and r["dropped"] == r["selected"] > 0 for r in lost)
    # the repeat is the same round to the devices: same selection, same participants, same model
    clean_kept = [r for r in clean.server.rows if r["outcome"] != "lost"]
    assert [r["participants"] for r in kept] == [r["participants"] for r in clean_kept]
    got, want = _model(faulty.run_dir), _model(clean.run_dir)
    assert all(np.array_equal(got[k], want[k]) for k in want)

    summary = json.loads((faulty.run_dir / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS and summary["rounds_completed"] == ROUNDS
    assert summary["rounds_lost"] == len(lost) >= 1
    assert _lost_count("lost-faulty") == len(lost)
    assert _lost_count("lost-clean") == len(clean.server.rows) - len(clean_kept)


def test_a_round_lost_past_its_repeats_fails_the_run_with_one_line(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, "gone")
    hit = _lose_tasks(cluster, 2, {1, 2, 3, 4})
    assert cluster.run(max_steps=2_000_000) == 1
    assert hit == [1, 2, 3]  # the first attempt and its 2 repeats
    error = cluster.server.error
    assert error is not None and "\n" not in error
    assert error.startswith("round 2 was lost to the broker 3 times")
    rows = cluster.server.rows
    assert [r["outcome"] for r in rows if r["round"] == 2] == ["lost"] * 3
    assert [r["outcome"] for r in rows if r["round"] == 1][-1] == "completed"
    assert {r["round"] for r in rows} == {1, 2}
    summary = json.loads((cluster.run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 1
    assert summary["rounds_lost"] == sum(r["outcome"] == "lost" for r in rows) >= 3
    # the other services were told to stop: none is left waiting for a round that never comes
    assert all(svc.stopped for svc in cluster.services)


def test_updates_receipted_but_never_merged_make_a_lost_round() -> None:
    """The flush timed out with receipts no partial covered: the aggregators (or their partials) were
    lost after taking the updates — nothing the emulation does."""
    rs = _round([1, 2])
    rs.receipt(_receipt(1))
    rs.rejects[2] = Reject(device_id=2, reason="memory")
    assert rs.lost_to_broker(set(), broker_fault=False) is None  # a plain below-quorum close
    rs.flush_timed_out = True
    why = rs.lost_to_broker(set(), broker_fault=False)
    assert why is not None and "1 updates reached an aggregator" in why


def test_a_fleet_without_hosts_waits_then_fails(tmp_path: Path) -> None:
    """No client host serves any device (all lost the broker, say): the next round does not open
    with 0 devices; the server waits within the budget, then fails the run with one line."""
    cluster = _cluster(tmp_path, "hostless")
    server = cluster.server
    assert cluster.run(until=lambda: len(server.rows) >= 1, max_steps=2_000_000) == 0
    for host in list(server.leases.table.hosts):
        server.leases.table.remove(host)
    server.repeat = RepeatPolicy(repeats=2, budget_s=-1.0)  # any wait is past it
    assert not server._hosts_serve(2)
    assert server.phase == "waiting" and server.error is None
    assert not server._hosts_serve(2)  # past the budget
    assert server.error is not None and server.error.startswith("round 2: no client host served any device")
    assert server.stopped


def test_a_device_that_leaves_its_host_while_its_task_waits_for_the_payload_is_not_trained_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 2's payload is lost on its first publish, so its tasks wait on their host while the
    host fetches it; one of the waiting devices moves away before the payload comes. Its task is
    dead-lettered ``unknown-device`` (as one arriving after the move would be), never trained on a
    host that no longer serves it, and the run still ends."""
    from services.client.service import Client

    moved: list[int] = []
    on_payload = Client.on_payload

    def leave_first(self: Client, env: Any, msg: Any, d: Any) -> None:
        waiting = self.waiting.get(msg.digest, [])
        if waiting and not moved:
            dev = waiting[0][1].device_id
            del self.data[dev]
            moved.append(dev)
        on_payload(self, env, msg, d)

    monkeypatch.setattr(Client, "on_payload", leave_first)
    cluster = _cluster(tmp_path, "moved")
    server = cluster.server
    publish = server._publish_many
    lost: list[int] = []

    def no_payload(items: list[PublishItem]) -> set[str]:
        rs = server.rs
        payloads = [item for item in items if item.kind is Kind.PAYLOAD]
        if payloads and rs is not None and rs.number == 2 and not lost:
            lost.append(len(payloads))
            kept = [item for item in items if item.kind is not Kind.PAYLOAD]
            return publish(kept) if kept else set()
        return publish(items)

    server._publish_many = no_payload  # type: ignore[method-assign]
    rejected: list[tuple[str, str]] = []
    trained: list[tuple[int, int]] = []
    for client in cluster.clients:

        def record(d: Any, reason: str, detail: str, orig: Any = client.reject) -> None:
            rejected.append((reason, detail))
            orig(d, reason, detail)

        def count(env: Any, task: Any, device: Any, orig: Any = client._train) -> Any:
            trained.append((env.round, device.device_id))
            return orig(env, task, device)

        client.reject = record  # type: ignore[method-assign, assignment]
        client._train = count  # type: ignore[method-assign]
    assert cluster.run(max_steps=2_000_000) == 0
    assert lost and len(moved) == 1, "no task waited for its payload: the fault was not injected"
    assert [r[0] for r in rejected] == ["unknown-device"]
    assert rejected[0][1].startswith(f"device {moved[0]} is not hosted by ")
    assert (2, moved[0]) not in trained
    assert all(r["outcome"] == "completed" for r in server.rows if r["round"] != 2)


@pytest.mark.parametrize("lose", ["all", "one"])
def test_updates_a_broker_restart_loses_leave_their_devices_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lose: str
) -> None:
    """Updates are published transient (``RABBITMQ_UPDATE_DELIVERY``), so a classic broker that
    restarts loses those still queued. Emulated here by dropping round 2's updates after the broker
    took them. ``all``: the round merged nothing, so it is lost and repeated, and the run ends with
    the model of a clean run. ``one``: the round completes with the others, and the lost message's
    devices (a host's flush of updates, in one ``updates``) count as dropped, as if their host had
    crashed."""
    from shared.schemas import Updates, decode
    from shared.transport.base import KEY_UPDATE

    cluster = _cluster(tmp_path, f"restart-{lose}")
    server = cluster.server
    dropped: list[int] = []

    def lossy(key: str, body: bytes, transient: bool) -> bool:
        rs = server.rs
        if key == KEY_UPDATE and rs is not None and rs.number == 2 and rs.attempt == 1:
            assert transient, "an update was published persistent"
            if lose == "all" or not dropped:
                msg = decode(body, max_bytes=len(body))[1]
                dropped.append(len(msg.messages) if isinstance(msg, Updates) else 1)
                return False  # taken by the broker, then lost with it
        return True

    tap_inproc_publishes(monkeypatch, lossy)
    assert cluster.run(max_steps=2_000_000) == 0
    assert dropped, "no update of round 2 was published: the fault was not injected"
    round2 = [r for r in server.rows if r["round"] == 2]
    monkeypatch.undo()
    clean = _cluster(tmp_path, "restart-clean")
    assert clean.run(max_steps=2_000_000) == 0
    (clean2,) = [r for r in clean.server.rows if r["round"] == 2]
    if lose == "all":
        assert [r["outcome"] for r in round2] == ["lost", "completed"]
        got, want = _model(cluster.run_dir), _model(clean.run_dir)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    else:
        (n,) = dropped
        (row,) = round2
        assert row["outcome"] == "completed" and 1 <= n < clean2["participants"]
        assert row["participants"] == clean2["participants"] - n
        assert row["dropped"] == clean2["dropped"] + n


def test_a_merged_update_without_its_receipt_is_not_settled_but_answers() -> None:
    """A partial goes ahead of its updates' receipts: merged but not yet receipted, a device keeps
    the round from being settled (its receipt carries its bytes), yet it has answered (quorum)."""
    rs = _round([1, 2, 3])
    rs.covered.update({1, 2})
    assert not rs.settled() and rs.answering() == 2
    rs.receipt(_receipt(1))
    rs.receipt(_receipt(2))
    assert rs.settled() and rs.answering() == 2
    rs.receipt(_receipt(3))  # receipted, its partial not merged yet
    assert not rs.settled() and rs.answering() == 3
    rs.covered.add(3)
    assert rs.settled()


def test_a_repeat_takes_a_lost_attempts_receipts_for_what_an_aggregator_still_merges() -> None:
    """An aggregator that outlived a lost attempt still holds the updates it receipted then, and
    merges them in the repeat without receipting them again (their new uploads are duplicates to
    it): the repeat is settled by the earlier receipts, not held until the flush deadline."""
    rs = _round([1, 2])
    rs.receipt(_receipt(1))
    repeat = _round([1, 2])
    repeat.earlier_receipts = frozenset(rs.receipts)
    repeat.covered.update({1, 2})
    assert not repeat.settled()  # device 2: merged, its receipt not in yet
    repeat.receipt(_receipt(2))
    assert repeat.settled()
