"""Every memory-aware algorithm on one memory-limited fleet: who gets to train, what it costs.

    .venv/bin/python benchmarks/fleet_algorithms.py --seeds 0 1 2 --out runs/fleet-algorithms --docs

The question fedfleet exists to answer — "how would this algorithm behave on weak devices?" — asked
of every global-model algorithm that adapts to device memory, on the same fleet: the
``embracingfl-mix`` preset (strong / moderate / weak devices with 100 % / 40 % / 15 % of the full
model's training footprint, 5 / 5 / 10 of 20 devices), label-skewed digits (Dirichlet α = 0.5),
10 devices per round, 30 rounds. Each algorithm sizes its tasks from the devices' budgets where it
can (``capacity: budget`` for the width-slice methods, ``client_types: budget`` for EmbracingFL);
FedTiny and FedMef train one sparse model (10 % density) on every device alike, from the papers'
masked initial weights and from weights rescaled to the sparse fan-in (``sparse_init: fan_in``). The client's
admission refuses whatever does not fit, so nothing trains over budget.

Every run is ``fedfleet run … --transport inproc`` (the real services, messages and wire bytes, in
one process). Accuracy is the global model's central test accuracy, mean of the last 5 rounds.
Writes ``results.json`` and ``table.md`` under ``--out``, a comparison plot of seed 0
(``accuracy_vs_bytes.png``) and, with ``--docs``, the table into ``docs/algorithms/README.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.orchestrator import run_inproc_once  # noqa: E402
from shared.config import parse_config  # noqa: E402
from shared.results import plot_compare, read_rounds, read_summary, replace_doc_block  # noqa: E402

#: label -> (algorithm, options); every algorithm that adapts its tasks to a device's memory
ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg (full model)": ("fedavg", {}),
    "HeteroFL": ("heterofl", {"capacity": "budget"}),
    "FedRolex": ("fedrolex", {"capacity": "budget"}),
    "Federated Dropout": ("feddropout", {"capacity": "budget"}),
    "FedDSE": ("feddse", {"capacity": "budget"}),
    "EmbracingFL": ("embracingfl", {"client_types": "budget"}),
    # dynamic sparse training at a fixed density (10 % of the prunable weights): smaller tasks for
    # every device alike rather than per-device sizes
    "FedTiny": ("fedtiny", {}),
    "FedMef": ("fedmef", {}),
    # the same with each unit's initial weights rescaled to its sparse fan-in (not in the papers)
    "FedTiny (fan-in init)": ("fedtiny", {"sparse_init": "fan_in"}),
    "FedMef (fan-in init)": ("fedmef", {"sparse_init": "fan_in"}),
}
TIERS = ("strong", "moderate", "weak")


def _config(algo: str, options: dict[str, Any], seed: int, rounds: int, lr: float = 0.1) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "experiments" / "fleet_memory.yaml").read_text())
    cfg.update(
        {
            "name": f"fleet-algorithms-{algo}-s{seed}",
            "seed": seed,
            "rounds": rounds,
            "dataset": {"name": "digits", "partition": "dirichlet", "alpha": 0.5},
            "algorithm": {"name": algo, "options": options},
            "train": {"local_epochs": 2, "batch_size": 16, "lr": lr, "momentum": 0.5},
        }
    )
    return cfg


def _run_dir(out: Path, label: str, seed: int) -> Path:
    """``runs/fleet-algorithms/<label slug>-s<seed>`` (one algorithm may appear with other options)."""
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    return out / f"{slug}-s{seed}"


def _run(label: str, seed: int, out: Path, rounds: int, force: bool, lr: float = 0.1) -> Path:
    algo, options = ALGORITHMS[label]
    run_dir = _run_dir(out, label, seed)
    cfg = parse_config(_config(algo, options, seed, rounds, lr), label)
    run_inproc_once(cfg, run_dir, f"fa-{algo}-s{seed}", force=force)
    return run_dir


def _measure(run_dir: Path) -> dict[str, Any]:
    rows = read_rounds(run_dir)
    summary = read_summary(run_dir)
    accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    tiers = summary.get("tiers", {})
    out: dict[str, Any] = {
        "final_accuracy": statistics.mean(accs[-5:]),
        "best_accuracy": max(accs),
        "mb_up": summary["bytes_up"] / 1e6,
        "mb_down": summary["bytes_down"] / 1e6,
    }
    for tier in TIERS:
        t = tiers.get(tier, {})
        out[f"{tier}_completed"] = int(t.get("completed", 0))
        out[f"{tier}_rejected"] = int(t.get("rejected", 0))
    return out


def _fmt(xs: list[float], digits: int = 1, scale: float = 1.0) -> str:
    vals = [x * scale for x in xs]
    per = " / ".join(f"{v:.{digits}f}" for v in vals)
    return f"{statistics.mean(vals):.{digits}f} ({per})"


def table(results: dict[str, list[dict[str, Any]]], seeds: list[int], rounds: int, lr: float = 0.1) -> str:
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; {rounds} rounds; learning rate {lr:g} for every method; each "
        "cell: mean (per seed). Accuracy in %",
        "(central test set, mean of the last 5 rounds). Tasks: completed / refused by admission, summed",
        "over the seeds.",
        "",
        "| algorithm | accuracy | best | strong tasks | moderate tasks | weak tasks | MB up | MB down |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in results.items():
        tiers = [
            f"{sum(r[f'{t}_completed'] for r in runs)} / {sum(r[f'{t}_rejected'] for r in runs)}"
            for t in TIERS
        ]
        lines.append(
            f"| {label} | {_fmt([r['final_accuracy'] for r in runs], scale=100)} "
            f"| {_fmt([r['best_accuracy'] for r in runs], scale=100)} | {' | '.join(tiers)} "
            f"| {_fmt([r['mb_up'] for r in runs], 2)} | {_fmt([r['mb_down'] for r in runs], 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--lr", type=float, default=0.1, help="train.lr of every method (the doc has 0.1 and 0.3 tables)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "fleet-algorithms")
    ap.add_argument("--only", nargs="*", default=None, help="algorithm labels to (re)run; default all")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/algorithms/README.md")
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for label in ALGORITHMS:
        results[label] = []
        for seed in args.seeds:
            if args.only is None or label in args.only:
                run_dir = _run(label, seed, args.out, args.rounds, args.force, args.lr)
            else:
                run_dir = _run_dir(args.out, label, seed)
            results[label].append(_measure(run_dir))
    seed0 = args.seeds[0]
    plot = plot_compare(
        {label: read_rounds(_run_dir(args.out, label, seed0)) for label in ALGORITHMS},
        args.out / "accuracy_vs_bytes.png",
    )
    md = table(results, args.seeds, args.rounds, args.lr)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "table.md").write_text(md + "\n")
    print(md)
    print(f"plot: {plot}")
    if args.docs:
        marker = "fleet-algorithms" if args.lr == 0.1 else f"fleet-algorithms-lr{args.lr:g}"
        replace_doc_block(ROOT / "docs" / "algorithms" / "README.md", marker, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
