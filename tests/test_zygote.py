"""The fork server (``services/zygote.py``): services forked from one process that imported torch
share its pages, and behave for the orchestrator as subprocesses do (exit codes, signals, command line).

No timings: sharing is read from ``/proc/<pid>/smaps_rollup`` (pages two processes map are "Shared"),
and waits only bound how long a failure takes to show.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.orchestrator import ROOT, ProcessCluster
from services.zygote import ForkServer, forkable
from tests.conftest import wait_for, write_config

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_rounds import _roles

MiB = 1024


def _rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[ForkServer]:
    fs = ForkServer(dict(os.environ, PYTHONPATH=str(ROOT)), tmp_path / "zygote.log")
    yield fs
    fs.close()


def _pair(broker_url: str, experiment_id: str, tmp_path: Path, fork: bool) -> ProcessCluster:
    config = write_config(tmp_path / f"cfg-{fork}.yaml")
    return ProcessCluster(broker_url, experiment_id, config, tmp_path / f"run-{fork}", fork_server=fork)


def test_a_forked_client_host_shares_the_zygotes_torch_pages(
    broker_url: str, experiment_id: str, tmp_path: Path
) -> None:
    """A client host (no server: it waits, holding torch) forked from the zygote has most of its
    memory in pages it shares; the same host as a new interpreter has almost none (torch's ~146 MB
    are private there). Anonymous pages that two processes map count as ``Shared_Dirty``."""
    shared: dict[bool, int] = {}
    for fork in (True, False):
        pc = _pair(broker_url, f"{experiment_id}-{fork}", tmp_path, fork)
        try:
            host = pc.client("client-0")
            assert host.forked is fork
            # torch is imported once the host has built its experiment and logs its first heartbeat
            wait_for(lambda h=host: "heartbeat" in h.text() or not h.alive(), 120, "the host to start")
            assert host.alive(), host.text()[-2000:]
            roll = _rollup(host.p.pid)
            shared[fork] = roll["Shared_Dirty"]  # Shared_Clean: also .so files other processes map
            if fork:  # at least torch's private memory of a new interpreter is shared here
                assert roll["Shared_Dirty"] > 100 * MiB, roll
                assert roll["Pss"] < roll["Rss"] - 50 * MiB, roll
        finally:
            pc.stop_all()
            pc.cleanup_broker()
    assert shared[False] < 16 * MiB, shared


def test_a_forked_service_is_this_process_child_and_looks_like_a_subprocess(
    broker_url: str, experiment_id: str, tmp_path: Path
) -> None:
    """Parent pid, command line and ``bench_rounds._roles``: what humans and the benchmarks find."""
    pc = _pair(broker_url, experiment_id, tmp_path, True)
    try:
        host = pc.client("client-0")
        agg = pc.aggregator("aggregator-0")
        assert host.forked and not agg.forked  # an aggregator stays a lean new interpreter
        stat = Path(f"/proc/{host.p.pid}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()
        args = Path(f"/proc/{host.p.pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")
        assert args[:6] == [sys.executable, "-m", "services.cli", "client", "--id", "client-0"]
        assert Path(f"/proc/{host.p.pid}/comm").read_text().strip() == "client-0"
        roles = _roles(os.getpid(), broker=False)
        assert roles[host.p.pid] == "client"
        assert roles[agg.p.pid] == "aggregator"
        assert roles[pc._zygote.proc.pid] == "zygote"  # type: ignore[union-attr]
    finally:
        pc.stop_all()
        pc.cleanup_broker()


@pytest.mark.parametrize(("args", "code"), [(["experiments/quickstart.yaml"], 0), (["missing.yaml"], 2)])
def test_exit_codes_are_the_services_own(
    zygote: ForkServer, tmp_path: Path, args: list[str], code: int
) -> None:
    """``fedfleet validate``: 0, or 2 for a config that cannot be read — as from a new interpreter,
    with the same output in the log file."""
    forked = zygote.spawn(["validate", *args], tmp_path / "forked.log", dict(os.environ), ROOT)
    assert forked.wait(120) == code
    assert forked.poll() == code and forked.returncode == code
    plain = subprocess.run(
        [sys.executable, "-m", "services.cli", "validate", *args], cwd=ROOT, capture_output=True, timeout=120
    )
    assert plain.returncode == code
    assert (tmp_path / "forked.log").read_bytes() == plain.stdout + plain.stderr


def test_signals_reach_a_forked_service_as_a_subprocess(
    zygote: ForkServer, broker_url: str, experiment_id: str, tmp_path: Path
) -> None:
    """SIGSTOP/SIGCONT stop and resume it; SIGKILL ends it with -9, reported by ``poll``/``wait``."""
    config = write_config(tmp_path / "cfg.yaml")
    argv = ["client", "--id", "client-0", "--config", str(config), "--experiment", experiment_id]
    env = dict(os.environ, RABBITMQ_URL=broker_url, PYTHONPATH=str(ROOT))
    p = zygote.spawn([*argv, "--metrics-port", "0"], tmp_path / "c.log", env, ROOT)
    log = tmp_path / "c.log"
    wait_for(lambda: "heartbeat" in log.read_text(), 120, "the host to start")

    def state() -> str:
        return Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    p.send_signal(signal.SIGSTOP)
    wait_for(lambda: state() == "T", 30, "the host to stop")
    p.send_signal(signal.SIGCONT)
    wait_for(lambda: state() != "T", 30, "the host to resume")
    assert p.poll() is None
    p.kill()
    assert p.wait(30) == -signal.SIGKILL
    assert p.poll() == -signal.SIGKILL


def test_sigterm_and_sigint_end_a_forked_service_as_a_new_interpreter(
    zygote: ForkServer, tmp_path: Path
) -> None:
    """A forked service starts with a new interpreter's signal dispositions (the zygote itself
    ignores SIGINT): with no handlers of its own it dies of SIGTERM (-15), and of SIGINT after a
    KeyboardInterrupt traceback (-2), as ``python -m ...`` does."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        ready, log = tmp_path / f"ready-{sig}", tmp_path / f"{sig}.log"
        p = zygote.spawn(["block", str(ready)], log, dict(os.environ), ROOT, module="tests.zygote_probe")
        wait_for(ready.exists, 60, "the probe to start")
        p.send_signal(sig)
        assert p.wait(30) == -sig, log.read_text()
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in log.read_text()


def test_numpy_global_rng_is_reseeded_in_each_forked_service(zygote: ForkServer, tmp_path: Path) -> None:
    """Two forked services draw different numbers from numpy's legacy global RNG, as two new
    interpreters do (without re-seeding both would repeat the zygote's state)."""
    draws = []
    for i in range(2):
        out, log = tmp_path / f"draw{i}", tmp_path / f"p{i}.log"
        p = zygote.spawn(["draw", str(out)], log, dict(os.environ), ROOT, module="tests.zygote_probe")
        assert p.wait(60) == 0, log.read_text()
        draws.append(out.read_text())
    assert draws[0] != draws[1]


def test_only_runtime_settings_may_differ_for_a_forked_service() -> None:
    base = {"PATH": "/bin", "RABBITMQ_URL": "amqp://a"}
    assert forkable("client", {**base, "RABBITMQ_URL": "amqp://b", "FEDFLEET_LINGER_S": "2"}, base)
    assert forkable("server", base, base)
    assert not forkable("aggregator", base, base)
    assert not forkable("client", {**base, "OMP_NUM_THREADS": "4"}, base)  # read at import time


def test_the_setting_turns_the_fork_server_off(broker_url: str, experiment_id: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg.yaml")
    for value, expected in (("false", False), ("0", False), ("true", True)):
        env = dict(os.environ, FEDFLEET_FORK_SERVER=value)
        pc = ProcessCluster(broker_url, experiment_id, config, tmp_path / "run", env=env)
        assert pc.fork_server is expected


def test_other_orphans_are_not_adopted_outside_a_fork(zygote: ForkServer, tmp_path: Path) -> None:
    """This process is a subreaper only while a fork is under way: a process orphaned at any other
    time goes to init as before, not to this process (which would never reap it: a zombie)."""
    p = zygote.spawn(
        ["draw", str(tmp_path / "d")], tmp_path / "d.log", dict(os.environ), ROOT, module="tests.zygote_probe"
    )
    assert p.wait(60) == 0
    sh = subprocess.run(["sh", "-c", "sleep 30 & echo $!"], capture_output=True, text=True, check=True)
    orphan = int(sh.stdout)
    try:
        ppid = int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid != os.getpid()
    finally:
        os.kill(orphan, signal.SIGKILL)
