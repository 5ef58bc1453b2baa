"""Scaling the client processes of a running experiment, the way ``make scale CLIENTS=n`` does.

Issue 6, "scaling semantics": client replicas added mid-experiment register their devices and can be
selected from the next round; replicas removed mid-round are handled by the deadline and the quorum;
the server never waits forever on a device that is gone. Kubernetes does nothing more than start or
kill client processes, so this test does exactly that with OS processes over the local RabbitMQ:

1. the run starts with two client processes (6 of the fleet's 8 devices); the server waits
   ``registration_timeout_s`` for the other two, then starts with the 6 it has;
2. a third client process (devices 6-7) is started after round 1 has opened;
3. one of the first two is SIGKILLed as soon as the last round opens, while its devices are still
   computing; they never answer, the round closes at its deadline with the quorum, the run finishes.

Rounds are paced in wall time by the fleet (``time_mode: real``, about a second of emulated compute
per task), so the run is still going when the third process — which needs many seconds just to start
on a busy machine — registers, and so the kill lands while the killed client's devices are mid-task.
Only the last round waits for its deadline, which keeps the test short; that a killed client's
devices cost every later round its deadline is test_e2e_amqp's SIGKILL test.

Which devices the server selected in each round is read off the broker by a spy queue bound to every
device's task key (a task's envelope names its round), so "selected from the next round" is
checked round by round, not inferred from totals.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import pika
import pytest

from services.orchestrator import ServiceProcess as Proc
from shared.schemas import Task, decode
from shared.transport import key_task
from shared.transport.amqp import AmqpTransport
from tests.conftest import read_rounds, wait_for, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

RUN_TIMEOUT = 300.0
ROUNDS = 10
NUM_DEVICES = 8
#: Six of eight devices per round. With seed 1 every draw over all eight devices (rounds 2-15) includes
#: device 6 or 7 and one of 3-5, so whichever round the third client joins in, the next one selects
#: its devices, and the last round selects the killed client's; a draw without 6 and 7 happens 1 time
#: in 28, which is why the seed is pinned.
DEVICES_PER_ROUND = 6
SEED = 1
#: long enough for a client's first task (torch's first backward can take over 10 s on a loaded
#: machine); only the round with the killed client waits for it
ROUND_TIMEOUT_S = 20
#: about 1 s of emulated compute per task (2.02 MFLOP per task of this workload), slept in real mode
FLEET = {"preset": "uniform", "overrides": {"default": {"flops_per_s": "2MFLOP/s"}}}
FIRST, SECOND, THIRD = "0-2", "3-5", "6-7"
THIRD_DEVICES = {6, 7}
SECOND_DEVICES = {3, 4, 5}


def _events(proc: Proc) -> list[dict[str, Any]]:
    """The server's structured log lines (one JSON object per line; anything else is skipped)."""
    out = []
    for line in proc.text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


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


def _drain_spy(url: str, queue: str, keep: bool) -> dict[int, set[int]]:
    """Empty and delete the spy queue; with ``keep``: round → devices the server sent a task to.

    A fresh connection: an AMQP connection left idle through a two-minute run would miss heartbeats.
    """
    out: dict[int, set[int]] = {}
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        while keep:
            method, _props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                break
            env, task = decode(body, max_bytes=len(body) + 1)
            assert isinstance(task, Task)
            out.setdefault(env.round, set()).add(task.device_id)
        ch.queue_delete(queue)
    finally:
        conn.close()
    return out


def test_add_a_client_mid_run_and_kill_one_mid_round(cluster: Any, tmp_path: Path) -> None:
    """``make scale`` up then down, as processes: see the module docstring for the scenario."""
    config = write_config(
        tmp_path / "c.yaml",
        seed=SEED,
        rounds=ROUNDS,
        num_devices=NUM_DEVICES,
        devices_per_round=DEVICES_PER_ROUND,
        round_timeout_s=ROUND_TIMEOUT_S,
        quorum_fraction=0.15,  # one update is a quorum: the kill must cost time, not rounds
        registration_timeout_s=6,
        fleet=FLEET,
        emulation={"time_mode": "real", "time_factor": 1.0},
    )
    c = cluster(config)
    spy = AmqpTransport(c.url, c.experiment_id)
    spy_queue = spy.names.client_queue("spy")
    spy.declare_queue(spy_queue, [key_task(d) for d in range(NUM_DEVICES)])
    spy.close()
    tasks: dict[int, set[int]] = {}
    try:
        agg = c.aggregator("agg-0")
        first = c.client("c0", FIRST)
        second = c.client("c1", SECOND)
        # The clients are up (and retrying registration) before the server starts, so the
        # registration timeout is about the third client only, not about slow process start-up.
        _wait(
            lambda: all('"client_ready"' in p.text() for p in (first, second)),
            "the first two clients",
            c.procs,
            [agg, first, second],
        )
        server = c.server()
        _wait(lambda: _count(server, "round_open") >= 1, "round 1", c.procs, [server, first, second])

        third = c.client("c2", THIRD)  # scale up: a new process, mid-run
        last_round = lambda: _count(server, "round_open") >= ROUNDS  # noqa: E731
        _wait(last_round, "the last round", c.procs, [server, first, second, third])
        second.kill()  # scale down, mid-round: no goodbye; its durable queue keeps its tasks
        killed_at = time.time()

        rc = server.p.wait(RUN_TIMEOUT)
        assert rc == 0, f"server exited with {rc}:\n{server.text()[-3000:]}"
        tasks = _drain_spy(c.url, spy_queue, keep=True)
    finally:
        if not tasks:
            _drain_spy(c.url, spy_queue, keep=False)

    events = _events(server)
    rows = read_rounds(c.run_dir)
    summary = json.loads((c.run_dir / "summary.json").read_text())
    with (c.run_dir / "devices.csv").open() as f:
        devices = {int(d["device_id"]): d for d in csv.DictReader(f)}

    # -- the run finished: every round closed, none waited forever ---------------------------------
    assert summary["rounds"] == ROUNDS and len(rows) == ROUNDS
    assert any(e.get("event") == "registration_timeout" for e in events), (
        "the server should have started with the first two clients' 6 devices"
    )
    for survivor in (first, third, agg):  # the stop broadcast reaches every process still running
        assert survivor.p.wait(60) == 0, survivor.text()[-2000:]

    # -- scale up: the third client's devices are selected from the round after they registered ----
    opened = 0
    joined_in = None
    for e in events:
        if e.get("event") == "round_open":
            opened = e["round"]
        elif e.get("event") == "register" and "registered by c2" in e["msg"]:
            joined_in = opened
            break
    assert joined_in is not None, "the third client never registered"
    assert 1 <= joined_in < ROUNDS - 1, (
        f"c2 registered during round {joined_in} of {ROUNDS}: too late to see it take part"
    )
    assert set(tasks) == set(range(1, ROUNDS + 1)), f"the spy saw tasks for rounds {sorted(tasks)}"
    for rnd in range(1, joined_in + 1):
        assert not tasks[rnd] & THIRD_DEVICES, f"round {rnd} selected devices not yet registered"
    assert tasks[joined_in + 1] & THIRD_DEVICES, (
        f"round {joined_in + 1} (the first after c2 registered) selected {sorted(tasks[joined_in + 1])}; "
        "with the pinned seed every draw over 8 devices includes 6 or 7 — has selection changed?"
    )
    for dev in THIRD_DEVICES:  # devices.csv agrees with what crossed the broker
        assert int(devices[dev]["selected"]) == sum(dev in sel for sel in tasks.values())
    assert sum(int(devices[d]["completed"]) for d in THIRD_DEVICES) >= 1, (
        "the third client's devices were selected but never took part in a round"
    )

    # -- scale down: the round open at the kill closed at its deadline, with the quorum -----------
    open_ts = {e["round"]: e["ts"] for e in events if e.get("event") == "round_open"}
    done_ts = {e["round"]: e["ts"] for e in events if e.get("event") == "round_done"}
    assert open_ts[ROUNDS] <= killed_at < done_ts[ROUNDS], "c1 was not killed while the last round was open"
    killed_devices = tasks[ROUNDS] & SECOND_DEVICES
    assert killed_devices, f"the last round did not select the killed client's devices {SECOND_DEVICES}"
    last = rows[-1]
    assert last["outcome"] == "completed", last
    assert int(last["dropped"]) >= 1 and int(last["participants"]) >= 1, last
    assert float(last["round_seconds"]) >= ROUND_TIMEOUT_S, (
        f"the last round closed after {last['round_seconds']} s, before its {ROUND_TIMEOUT_S} s deadline, "
        "although the killed client's devices could not answer"
    )
    assert sum(int(devices[d]["dropped"]) for d in SECOND_DEVICES) >= 1
