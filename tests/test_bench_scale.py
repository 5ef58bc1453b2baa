"""``benchmarks/bench_scale.py``'s CPU accounting: per round and role, from snapshots at round ends.

The benchmark itself needs 10,000 devices and minutes (``make bench-scale``); what can go wrong
quietly is the arithmetic that turns its ``/proc`` snapshots into the table, so that is checked here
on snapshots made up for the purpose, and the sampler once on a real child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.orchestrator import ROOT
from tests.conftest import wait_for

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale import CpuSampler, cpu_table


def _sampler(snapshots: list[tuple[int, dict[int, float]]]) -> CpuSampler:
    s = CpuSampler(parent=1, rounds_csv=Path("/nonexistent"))
    s.roles = {10: "client", 11: "client", 20: "broker", 30: "server"}
    s.snapshots = snapshots
    return s


def test_per_round_skips_the_warm_up_and_the_last_round_and_sums_roles() -> None:
    snaps = [
        (1, {10: 5.0, 11: 6.0, 20: 9.0, 30: 1.0}),  # round 1 (warm-up) ends
        (2, {10: 6.0, 11: 7.5, 20: 10.0, 30: 1.2}),
        (3, {10: 7.0, 11: 9.0, 20: 11.0, 30: 1.4}),  # round 3 ends: the last one counted of 4
        (4, {10: 99.0, 11: 99.0, 20: 99.0, 30: 99.0}),  # the last round: the run's end follows
    ]
    n, cpu = _sampler(snaps).per_round(4) or (0, {})
    assert n == 2  # rounds 2 and 3
    assert cpu == pytest.approx({"client": (2.0 + 3.0) / 2, "broker": 1.0, "server": 0.2})


def test_per_round_leaves_out_a_process_missing_at_either_end_and_needs_three_rounds() -> None:
    snaps = [(1, {10: 5.0, 11: 6.0, 20: 9.0, 30: 1.0}), (2, {10: 6.0, 20: 10.0, 30: 1.5})]
    n, cpu = _sampler(snaps).per_round(3) or (0, {})
    assert (n, cpu) == (1, pytest.approx({"client": 1.0, "broker": 1.0, "server": 0.5}))
    assert _sampler(snaps).per_round(2) is None  # no round between the warm-up and the last
    assert _sampler(snaps[1:]).per_round(3) is None  # round 1's end was never seen


def test_cpu_table_totals_shares_and_the_cores_bound() -> None:
    r = {
        "cpu_s_per_round": {"client": 3.0, "broker": 1.0},
        "cpu_rounds": 2,
        "cores": 2,
        "round_s": [9.0, 2.5, 2.5, 9.0],
        "floor_s": [9.0, 1.0, 1.0, 9.0],
    }
    text = "\n".join(cpu_table(r))
    assert "| client hosts | 3.00 | 75% | 3.00 |" in text
    assert "| **all** | 4.00 | 100% | 4.00 |" in text
    assert "/ 2 cores = 2.00 s" in text and "(2.00x the floor; the mean round took 1.25x that bound)" in text
    assert "not measured" in "\n".join(cpu_table({**r, "cpu_s_per_round": {}}))


def test_the_sampler_snapshots_real_processes_as_rounds_csv_grows(tmp_path: Path) -> None:
    """A parent whose child (named like a service: ``python -m services.cli server``) burns CPU, and
    a ``rounds.csv`` that grows: one snapshot per new round, the child's CPU rising between them, and
    this process counted as ``bench``."""
    fake = tmp_path / "fake"
    (fake / "services").mkdir(parents=True)
    (fake / "services" / "__init__.py").write_text("")
    # busy until its parent is gone (so a failed test leaves nothing spinning)
    (fake / "services" / "cli.py").write_text(
        "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(10000))\n"
    )
    spawn = "import subprocess, sys; subprocess.run([sys.executable, '-m', 'services.cli', 'server'])"
    parent = subprocess.Popen([sys.executable, "-c", spawn], cwd=fake)
    csv = tmp_path / "rounds.csv"
    sampler = CpuSampler(parent.pid, csv)
    try:
        wait_for(lambda: "server" in _children_roles(parent.pid), 30, "the fake service")
        sampler.start()
        for done in (1, 2, 3):
            csv.write_text("round\n" + "".join(f"{i}\n" for i in range(1, done + 1)))
            wait_for(lambda d=done: len(sampler.snapshots) >= d, 10, f"snapshot {done}")
            time.sleep(0.3)
    finally:
        sampler.stop()
        parent.kill()
        parent.wait()
    assert [d for d, _ in sampler.snapshots] == [1, 2, 3]
    assert sampler.roles[os.getpid()] == "bench"
    per_round = sampler.per_round(3)
    assert per_round is not None
    n, cpu = per_round
    assert n == 1 and cpu.get("server", 0.0) > 0.1  # ~0.3 s of a busy loop between rounds 1 and 2


def _children_roles(parent: int) -> list[str]:
    from bench_rounds import _roles

    return list(_roles(parent, broker=False).values())
