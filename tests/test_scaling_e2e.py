"""Scaling the client hosts of a running experiment, the way ``make scale CLIENTS=n`` does.

Client processes are interchangeable hosts: started with no device arguments, they are leased a
share of the fleet by the server. Kubernetes does nothing more than start processes, SIGTERM them
(a scale-down) or lose them (a crashed node), so this test does exactly that with OS processes over
the local RabbitMQ, running SpaFL so that every device carries personal state:

* **scale up, then down:** two hosts start; a third joins around round 5; one of the first two gets
  SIGTERM around round 10, hands its devices back and exits 0. The run ends with the same global
  model and the same personal state for every device as the same run without scaling (the
  in-process run, which the contract suite holds equal to a run over RabbitMQ).
* **a crash:** the same, with SIGKILL instead of SIGTERM. The run finishes, no round after the kill
  waits for its deadline, and every device is selected again after the kill (its lease expired and
  went to the surviving hosts, with its state).

Rounds are paced in wall time by the fleet (``time_mode: real``, about 0.3 s of emulated compute
per task), so the run is still going when a new process — which needs seconds just to start —
joins. Which devices each round selected is read off the broker by a spy queue bound to every
device's task key.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pytest

from services.orchestrator import ServiceProcess as Proc
from services.orchestrator import run_inproc
from shared.config import load_config
from shared.schemas import Kind, Task, Tasks, decode
from shared.transport.amqp import AmqpTransport
from tests.conftest import log_events, read_rounds, wait_for, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

RUN_TIMEOUT = 300.0
ROUNDS = 20
NUM_DEVICES = 8
#: the round's deadline in wall time: only a round a killed host's devices were in may wait for it
ROUND_TIMEOUT_S = 60
LEASE_TIMEOUT_S = 6.0
#: about 0.3 s of emulated compute per task, slept in real mode
FLEET = {"preset": "uniform", "overrides": {"default": {"flops_per_s": "8MFLOP/s"}}}


def _config(tmp_path: Path, devices_per_round: int) -> Path:
    return write_config(
        tmp_path / "c.yaml",
        seed=2,
        rounds=ROUNDS,
        num_devices=NUM_DEVICES,
        devices_per_round=devices_per_round,
        round_timeout_s=ROUND_TIMEOUT_S,
        quorum_fraction=0.25,
        dataset={"name": "digits", "partition": "iid", "train_limit": 800, "local_test_fraction": 0.25},
        algorithm={"name": "spafl"},
        train={"local_epochs": 1, "batch_size": 16, "lr": 0.1},
        fleet=FLEET,
        emulation={"time_mode": "real", "time_factor": 1.0},
        hosts={"heartbeat_s": 0.5, "lease_timeout_s": LEASE_TIMEOUT_S, "join_quiet_s": 0.5},
    )


def _events(proc: Proc) -> list[dict[str, Any]]:
    return log_events(proc.text())


def _count(proc: Proc, event: str) -> int:
    return sum(e.get("event") == event for e in _events(proc))


def _wait(predicate: Any, what: str, procs: list[Proc], alive: list[Proc]) -> None:
    """``wait_for`` that stops early, with the logs, if a process it depends on has exited."""

    def done() -> bool:
        if predicate():
            return True
        dead = [p.name for p in alive if p.p.poll() is not None]
        if dead:
            tails = "\n".join(f"--- {p.name} (exit {p.p.poll()})\n{p.text()[-2000:]}" for p in procs)
            raise AssertionError(f"{dead} exited while waiting for {what}\n{tails}")
        return False

    wait_for(done, RUN_TIMEOUT, what, interval=0.05)


def _spy(url: str, experiment: str) -> str:
    spy = AmqpTransport(url, experiment)
    queue = spy.names.client_queue("spy")
    spy.declare_queue(queue, ["host.*"])  # everything the server sends to any host
    spy.close()
    return queue


def _drain_spy(url: str, queue: str) -> dict[int, set[int]]:
    """Empty and delete the spy queue: round → devices the server sent a task to."""
    out: dict[int, set[int]] = {}
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        while True:
            method, _props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                break
            env, msg = decode(body, max_bytes=len(body) + 1)
            if isinstance(msg, Task) and env.kind is Kind.TASK:
                out.setdefault(env.round, set()).add(msg.device_id)
            if isinstance(msg, Tasks):
                out.setdefault(env.round, set()).update(t.device_id for t in msg.tasks)
        ch.queue_delete(queue)
    finally:
        conn.close()
    return out


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a if a[k].size)


def _scale(c: Any, signum: int) -> tuple[Proc, Proc, Proc, Proc, dict[str, int]]:
    """Two hosts, a third from round 2 (it joins when its process is up), ``signum`` to one of the
    first two around round 10 (at least three rounds after the third joined)."""
    agg = c.aggregator("agg-0")
    first, second = c.client("c0"), c.client("c1")
    server = c.server()
    _wait(lambda: _count(server, "round_open") >= 2, "round 2", c.procs, [server, agg, first, second])
    third = c.client("c2")  # scale up: a new process, mid-run; it starts in a few seconds
    _wait(
        lambda: any("host c2 joined" in e.get("msg", "") for e in _events(server)),
        "the third host to join",
        c.procs,
        [server, agg, first, second, third],
    )
    joined = _count(server, "round_open")
    # a loaded machine can start a process slower than the run's rounds go: leave the new host a
    # few rounds of its own before the next change, whenever it joined
    at = max(10, joined + 3)
    assert at < ROUNDS - 1, f"the third host joined only in round {joined} of {ROUNDS}"
    _wait(lambda: _count(server, "round_open") >= at, f"round {at}", c.procs, [server, agg, first, third])
    signalled = _count(server, "round_open")
    second.p.send_signal(signum)  # scale down (SIGTERM) or a crash (SIGKILL), mid-round
    return server, first, second, third, {"joined": joined, "signalled": signalled}


def test_hosts_join_and_leave_mid_run_and_nothing_changes(cluster: Any, tmp_path: Path) -> None:
    config = _config(tmp_path, devices_per_round=4)
    c = cluster(config)
    spy = _spy(c.url, c.experiment_id)
    try:
        server, first, second, third, at = _scale(c, signal.SIGTERM)
        assert second.p.wait(RUN_TIMEOUT) == 0, second.text()[-3000:]  # handed back, then exit 0
        assert server.p.wait(RUN_TIMEOUT) == 0, server.text()[-3000:]
    finally:
        tasks = _drain_spy(c.url, spy)
    for survivor in (first, third):  # the stop broadcast reaches every host still running
        assert survivor.p.wait(60) == 0, survivor.text()[-2000:]
    assert 2 <= at["joined"] < at["signalled"] < ROUNDS, at
    # the leaving host kept serving its devices until their leases moved, between two rounds
    assert any(e.get("event") == "host_leaving" for e in _events(second))
    assert any(e.get("event") == "host_left" for e in _events(second)), second.text()[-2000:]
    opened, released_after = 0, None
    for e in _events(server):
        if e.get("event") == "round_open":
            opened = e["round"]
        elif e.get("event") == "lease" and "host c1 serves 0 devices" in e["msg"]:
            released_after = opened
    assert released_after is not None and at["signalled"] <= released_after <= at["signalled"] + 1, (
        f"c1's devices went back after round {released_after}; it was signalled in round {at['signalled']}"
    )
    leases = [e["msg"] for e in _events(server) if e.get("event") == "lease"]
    assert any("host c2 serves" in m and "serves 0 devices" not in m for m in leases), leases
    rows = read_rounds(c.run_dir)
    assert [r["outcome"] for r in rows] == ["completed"] * ROUNDS
    assert all(int(r["participants"]) == 4 for r in rows)
    assert set(tasks) == set(range(1, ROUNDS + 1))

    # the same run without any scaling, in one process: the same global model and personal states
    reference = tmp_path / "reference"
    reference.mkdir()
    assert run_inproc(load_config(config), reference, f"ref-{c.experiment_id}", show_progress=False) == 0
    assert _max_diff(_arrays(c.run_dir / "global_model.npz"), _arrays(reference / "global_model.npz")) <= 1e-6
    ours = sorted(p.relative_to(c.run_dir) for p in (c.run_dir / "device-state").rglob("*.npz"))
    theirs = sorted(p.relative_to(reference) for p in (reference / "device-state").rglob("*.npz"))
    assert ours == theirs and len(ours) >= NUM_DEVICES, (ours, theirs)
    for rel in ours:
        assert _max_diff(_arrays(c.run_dir / rel), _arrays(reference / rel)) <= 1e-6, rel


def test_a_killed_host_costs_one_round_at_most_and_its_devices_come_back(
    cluster: Any, tmp_path: Path
) -> None:
    config = _config(tmp_path, devices_per_round=NUM_DEVICES)  # every device, every round
    c = cluster(config)
    spy = _spy(c.url, c.experiment_id)
    try:
        server, *_ = _scale(c, signal.SIGKILL)
        killed_at = time.time()
        assert server.p.wait(RUN_TIMEOUT) == 0, server.text()[-3000:]
    finally:
        tasks = _drain_spy(c.url, spy)
    rows = read_rounds(c.run_dir)
    assert len(rows) == ROUNDS and all(r["outcome"] == "completed" for r in rows)
    lost = [e for e in _events(server) if e.get("event") == "host_lost"]
    assert len(lost) == 1 and "c1" in lost[0]["msg"], lost
    open_ts = {e["round"]: e["ts"] for e in _events(server) if e.get("event") == "round_open"}
    after = [r for r in rows if open_ts[int(r["round"])] > killed_at]
    assert len(after) >= 2, f"the kill came too late: rounds after it {[r['round'] for r in after]}"
    # the round that was open at the kill waited for the lease to expire, not for its deadline;
    # every later round is as quick as any
    for r in rows:
        assert float(r["round_seconds"]) < ROUND_TIMEOUT_S / 2, r
    for r in after:
        assert int(r["participants"]) == NUM_DEVICES, r  # every device, its lease re-granted
        assert tasks[int(r["round"])] == set(range(NUM_DEVICES)), (r["round"], tasks[int(r["round"])])
