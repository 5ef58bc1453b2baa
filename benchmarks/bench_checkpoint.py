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

It runs against either layout of the checkpoint (with the ledger journal, or the earlier whole
ledger in ``state.json``), so the same script measures a commit before the journal and one after.
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
        100,
        (1, 10, 50, 100),
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
) -> tuple[list[float], int]:
    """Milliseconds of bookkeeping for each round of a simulated run, and the bytes the run left in
    its ledger journal (0 for the code before the journal)."""
    rng = np.random.default_rng(seed)
    arrays = {"w": rng.standard_normal(params).astype(np.float32)}
    journaled = hasattr(checkpoint, "Journal")  # else the code from before the ledger journal
    out: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        ledger = RunLedger("bench", "fedavg")
        journal = checkpoint.Journal(run_dir, None) if journaled else None
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
            if journal is not None:
                ckpt = checkpoint.Checkpoint(r, state, ledger.to_checkpoint(), ledger.to_journal())
                checkpoint.save(run_dir, ckpt, journal)
                ledger.journaled()
            else:
                checkpoint.save(run_dir, checkpoint.Checkpoint(r, state, ledger.to_checkpoint()))  # type: ignore[call-arg]
            out.append((time.perf_counter() - start) * 1000)
        journal_file = run_dir / "ledger.jsonl"
        return out, journal_file.stat().st_size if journal_file.exists() else 0


def _around(ms: Sequence[float], r: int) -> float:
    """The median of the rounds around round ``r`` (one round alone is at the disk's mercy)."""
    lo, hi = max(0, r - 5), min(len(ms), r + 4)
    return statistics.median(ms[lo:hi])


def run(rounds_scale: float = 1.0) -> str:
    lines = [
        "Wall ms of one round's bookkeeping on the server (`rounds.csv` and the checkpoint, as "
        "`Server._finalize` does them), replayed without training or messaging; each cell is the "
        "median of the 9 rounds around that round. The model's arrays are float32. The journal "
        "(`ledger.jsonl`) grows by what changed each round: its size at the end / the rounds.",
        "",
        "| scenario | rounds | "
        + " | ".join(f"point {i}" for i in range(1, 5))
        + " | journal bytes per round |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, registered, per_round, params, rounds, points in SCENARIOS:
        n = max(points[0], int(rounds * rounds_scale))
        shown = [p for p in points if p <= n]
        ms, journal_bytes = one_run(registered, per_round, params, n)
        cells = [f"{_around(ms, p):.1f} ms (r {p})" for p in shown] + ["-"] * (4 - len(shown))
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + f" | {journal_bytes / n:,.0f} |")
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
