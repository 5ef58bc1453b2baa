"""``--jobs``: the experiment scripts' parallel runs must be the runs a sequential invocation makes.

Why: the Fashion-MNIST blocks of the FedDSE and EmbracingFL pages are written with ``--jobs 2``
(each run in a spawned worker with one torch thread) to fit a 2-core machine; a worker that built
another config (the digits base, a module global it did not inherit) or numbers that depend on the
worker count would put a table in the docs that a user re-running one row cannot get back.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.reproduce import ROOT

# imported by name, as services/reproduce.py does: mypy sees benchmarks/ as top-level scripts
feddse_bench = importlib.import_module("benchmarks.feddse_experiment")
efl_bench = importlib.import_module("benchmarks.embracingfl_experiment")


def _runs(out: Path) -> dict[str, object]:
    return json.loads((out / "results.json").read_text())["runs"]


def test_feddse_parallel_runs_equal_sequential_ones(tmp_path: Path) -> None:
    args = ["--setting", "fashion-cnn", "--checks", "C4", "--seeds", "0", "--rounds", "1"]
    assert feddse_bench.main([*args, "--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    assert feddse_bench.main([*args, "--jobs", "1", "--out", str(tmp_path / "one")]) == 0
    parallel, sequential = _runs(tmp_path / "two"), _runs(tmp_path / "one")
    assert set(parallel) == {"high/feddse", "high/fedrolex"}
    assert parallel == sequential
    # the workers built the Fashion-MNIST CNN setting, not the digits base
    for label in parallel:
        cfg = (tmp_path / "two" / f"{label.replace('/', '-')}-s0" / "config.yaml").read_text()
        assert "fashion-mnist" in cfg and "cnn_feddse" in cfg, label


def test_embracingfl_fashion_experiments_differ_from_digits_only_in_base_and_passes() -> None:
    digits = efl_bench._config("A", "56", "efl", 0, 0.5, 50)
    fashion = efl_bench._config("A", "56", "efl", 0, 0.5, 50, "fashion")
    assert digits["dataset"]["name"] == "digits" and digits["train"]["local_epochs"] == 10
    assert fashion["dataset"]["name"] == "fashion-mnist" and fashion["model"]["name"] == "lenet5_fmnist"
    assert fashion["train"]["local_epochs"] == 4
    # the experiment's own parts are the digits ones: fleet, participation, algorithm, α, seed
    for key in ("fleet", "num_devices", "devices_per_round", "algorithm", "seed", "rounds"):
        assert fashion[key] == digits[key], key
    assert fashion["dataset"]["alpha"] == digits["dataset"]["alpha"] == 0.5
    assert fashion["name"] != digits["name"]  # a Fashion run never reuses a digits run's directory
    # Experiment B: the Fashion-MNIST case grids' 2 passes (~12 steps), not the digits' 5
    assert efl_bench._config("B", "case 5", "efl", 0, 0.5, 50)["train"]["local_epochs"] == 5
    assert efl_bench._config("B", "case 5", "efl", 0, 0.5, 50, "fashion")["train"]["local_epochs"] == 2


def test_a_killed_parent_takes_its_workers_with_it() -> None:
    """A worker that outlived its parent went on with its queued runs, into the directories a rerun
    of the same block was writing; ``worker_pool`` workers now get SIGTERM when the parent dies."""
    script = (
        "import os, sys, time\n"
        "from services.reproduce import worker_pool\n"
        "pool = worker_pool(1)\n"
        "print(pool.submit(os.getpid).result(), flush=True)\n"
        "pool.submit(time.sleep, 120)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        os.kill(worker, 0)  # alive while its parent is
        parent.send_signal(signal.SIGKILL)  # no clean-up of any kind in the parent
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        raise AssertionError(f"worker {worker} outlived its killed parent")
    finally:
        parent.kill()


def test_grid_parallel_runs_equal_sequential_ones(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``services/reproduce.py grid --jobs 2`` makes the same runs, hence the same table, as one at a
    time, and its table pass reuses the pool's runs rather than making them again."""
    from services.reproduce import run_grid

    parallel = run_grid("fedmef-batch1", (0,), tmp_path / "two", 1, jobs=2)
    # every run made prints "  <config name>: <seconds>s" (run_inproc_once), workers included
    made = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("  ") and ln.endswith("s")]
    assert len(made) == 2, made
    sequential = run_grid("fedmef-batch1", (0,), tmp_path / "one", 1)
    assert parallel == sequential
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["fedmef-b1-s0", "fedtiny-b1-s0"]
