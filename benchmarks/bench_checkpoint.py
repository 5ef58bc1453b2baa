"""What the server's per-round bookkeeping costs as a run grows: ``rounds.csv`` and the checkpoint.

Usage: ``python benchmarks/bench_checkpoint.py [--scale F] [--out FILE]``; ``run()`` returns the
markdown for ``benchmarks/results.md``.

Why: after every round the server rewrites ``rounds.csv`` and saves a checkpoint (the global
arrays plus the run ledger: every row so far and every touched device's statistics), and the save
verifies itself by reading the new checkpoint back. When the whole ledger lived in ``state.json``
both costs grew with the run — with the rounds for the rows, with the devices ever touched for the
statistics — so a long run or a large fleet spent more and more of each round on its own history.
This replays the server's bookkeeping (``RunLedger`` and ``services.server.checkpoint``, the same
calls in the same order as ``Server._finalize``) without any training or messaging, and reports the
wall milliseconds of one round's bookkeeping at several points of the run.

The journal (``ledger.jsonl``) grows by what changed each round, and is compacted the way the
server compacts it (a new generation starting with the whole ledger once it outgrows
``checkpoint.COMPACT_MIN_BYTES`` and ``COMPACT_RATIO`` times that ledger): the table gives the bytes
written per round, the bytes left on disk at the end, and the slowest round (a compaction's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.server import checkpoint  # noqa: E402
from services.server.ledger import RunLedger  # noqa: E402
from shared.algorithms.base import ServerState  # noqa: E402

#: (name, registered devices, devices per round, parameters of the model, rounds, report points)
SCENARIOS: tuple[tuple[str, int, int, int, int, tuple[int, ...]], ...] = (
    ("50 devices, all every round, MLP (17,674 parameters)", 50, 50, 17_674, 1000, (10, 100, 500, 1000)),
    (
        "10,000 devices, 1,300 a round, LeNet-5 (44,426 parameters)",
        10_000,
        1_300,
        44_426,
        400,
        (1, 10, 100, 400),
    ),
)


def _row(r: int) -> dict[str, Any]:
    """A ``rounds.csv`` row with the columns and kinds of values ``RunLedger.record_round`` makes."""
    return {
        "round": r,
        "outcome": "completed",
        "accuracy": 0.9 - 1.0 / (r + 2),
        "loss": 1.0 / (r + 1),
        "bytes_up": 3_471_400,
        "bytes_down": 3_472_050,
        "dense_bytes_up": 3_468_800,
        "dense_bytes_down": 3_468_800,
        "broker_bytes": 7_011_200 + r,
        "cum_bytes_up": 3_471_400 * r,
        "cum_bytes_down": 3_472_050 * r,
        "participants": 50,
        "selected": 50,
        "rejected": 0,
        "dropped": 0,
        "offline": 0,
        "wall_seconds": 0.15 * r,
        "round_seconds": 0.148,
        "virtual_seconds": 1.92,
        "density": 1.0,
        "train_flops": 1.2e9,
        "train_loss": 1.0 / (r + 1.5),
    }


def one_run(
    registered: int, per_round: int, params: int, rounds: int, seed: int = 0
) -> tuple[list[float], int, int, list[int]]:
    """Milliseconds of bookkeeping for each round of a simulated run, the bytes written to its
    ledger journal, the bytes of journal left on disk at the end, and the rounds that compacted it."""
    rng = np.random.default_rng(seed)
    arrays = {"w": rng.standard_normal(params).astype(np.float32)}
    out: list[float] = []
    written = 0
    compacted: list[int] = []
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        ledger = RunLedger("bench", "fedavg")
        journal = checkpoint.Journal(run_dir, None)
        for r in range(1, rounds + 1):
            everyone = per_round >= registered
            touched = range(registered) if everyone else rng.choice(registered, per_round, replace=False)
            for dev in touched:
                st = ledger.stats(int(dev))
                st.selected += 1
                st.completed += 1
                st.bytes_up += 69_428
                st.bytes_down += 69_441
                st.virtual_seconds += 0.38
            ledger.rows.append(_row(r))
            arrays["w"] += 1e-3
            state = ServerState(arrays, {})
            start = time.perf_counter()
            ledger.write_rows(run_dir)
            whole = journal.compacting()  # as ``Server._save_checkpoint``
            if whole:
                compacted.append(r)
            before = 0 if whole else journal.path.stat().st_size if journal.path.exists() else 0
            entry = ledger.to_journal(whole=whole)
            ckpt = checkpoint.Checkpoint(r, state, ledger.to_checkpoint(), entry, snapshot=whole)
            checkpoint.save(run_dir, ckpt, journal)
            ledger.journaled()
            out.append((time.perf_counter() - start) * 1000)
            written += journal.path.stat().st_size - before
        on_disk = sum(p.stat().st_size for p in run_dir.glob("ledger*.jsonl"))
        return out, written, on_disk, compacted


def _around(ms: Sequence[float], r: int) -> float:
    """The median of the rounds around round ``r`` (one round alone is at the disk's mercy)."""
    lo, hi = max(0, r - 5), min(len(ms), r + 4)
    return statistics.median(ms[lo:hi])


def run(rounds_scale: float = 1.0) -> str:
    lines = [
        "Wall ms of one round's bookkeeping on the server (`rounds.csv` and the checkpoint, as "
        "`Server._finalize` does them), replayed without training or messaging; each cell is the "
        "median of the 9 rounds around that round. The model's arrays are float32. The journal "
        "(`ledger*.jsonl`) grows by what changed each round and is compacted as the server does "
        f"it (past {checkpoint.COMPACT_MIN_BYTES / 2**20:.0f} MiB and {checkpoint.COMPACT_RATIO}x the "
        "whole ledger): bytes written per round (compactions included), bytes on disk at the end, "
        "the rounds that compacted it (with the slowest one's ms) and the slowest of the others.",
        "",
        "| scenario | rounds | "
        + " | ".join(f"point {i}" for i in range(1, 5))
        + " | compactions | slowest other round | journal bytes written per round"
        " | journal on disk at the end |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, registered, per_round, params, rounds, points in SCENARIOS:
        n = max(points[0], int(rounds * rounds_scale))
        shown = [p for p in points if p <= n]
        ms, written, on_disk, compacted = one_run(registered, per_round, params, n)
        cells = [f"{_around(ms, p):.1f} ms (r {p})" for p in shown] + ["-"] * (4 - len(shown))
        compactions = "none"
        if compacted:
            worst = max(compacted, key=lambda r: ms[r - 1])
            which = ", ".join(str(r) for r in compacted)
            compactions = f"r {which} (slowest {ms[worst - 1]:.1f} ms)"
        others = [(t, r) for r, t in enumerate(ms, 1) if r not in compacted]
        slowest = "{:.1f} ms (r {})".format(*max(others))
        lines.append(
            f"| {name} | {n} | "
            + " | ".join(cells)
            + f" | {compactions} | {slowest} | {written / n:,.0f} | {on_disk:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each scenario's rounds to run")
    ap.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    args = ap.parse_args(argv)
    command = f"Command: `python benchmarks/bench_checkpoint.py --scale {args.scale}`\n\n"
    text = command + "## The server's bookkeeping per round\n\n" + run(args.scale)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
