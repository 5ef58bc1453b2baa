"""Poisoning: 10% of the devices send sign-flipped or scaled updates; what each defence keeps.

    nice -n 10 .venv/bin/python benchmarks/poisoning.py --out runs/poisoning --docs

Every run is ``experiments/quickstart.yaml`` (FedAvg on digits, 20 devices, 10 per round, 20 rounds)
in ``fedfleet``'s in-process runner — the real server, two aggregators and two client hosts — with
only ``robust:`` / ``bounds:`` changed. The attackers are devices 0 and 10 (10% of the fleet; a round
selects 0, 1 or 2 of them). Each sends, instead of its trained weights w, ``g + factor · (w − g)``
where g is the global model it received: ``sign-flip`` uses factor −10 (a boosted step the wrong
way), ``scale`` uses factor 100 (a boosted step the right way, which overshoots).

The attack is a test-and-benchmark hook (:func:`install_attack` wraps the strategy's ``train`` in this
process), never a config option: a production config cannot turn a device into an attacker.

Writes ``results.json`` and ``table.md`` under ``--out`` and, with ``--docs``, the block between the
``poisoning-results`` markers of ``docs/security.md``. Finished runs are reused (``--force`` redoes
them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.orchestrator import run_inproc  # noqa: E402
from shared import codec  # noqa: E402
from shared.algorithms.base import DeviceContext, TaskSpec, UpdateSpec  # noqa: E402
from shared.config import ExperimentConfig, dump_config, parse_config  # noqa: E402
from shared.experiment import Experiment  # noqa: E402
from shared.results import replace_doc_block  # noqa: E402

#: how each attack moves an attacker's update: g + factor · (w − g)
ATTACKS: dict[str, float] = {"sign-flip": -10.0, "scale": 100.0}
#: defence label -> the config sections it sets
DEFENCES: dict[str, dict[str, Any]] = {
    "none (mean)": {},
    "median": {"robust": {"aggregation": "median"}},
    "trimmed mean (β = 0.1)": {"robust": {"aggregation": "trimmed_mean", "trim_fraction": 0.1}},
    "trimmed mean (β = 0.2)": {"robust": {"aggregation": "trimmed_mean", "trim_fraction": 0.2}},
    "multi-Krum (f = 2)": {"robust": {"aggregation": "multi_krum", "byzantine": 2}},
    "clip_norm 1.0": {"robust": {"clip_norm": 1.0}},
}
BASE = ROOT / "experiments" / "quickstart.yaml"


def attackers(num_devices: int, fraction: float = 0.1) -> set[int]:
    """Every ``1/fraction``-th device: 10% of the fleet, spread over the ids."""
    step = round(1 / fraction)
    return set(range(0, num_devices, step))


def install_attack(exp: Experiment, devices: Iterable[int], attack: str) -> None:
    """Make ``devices`` send poisoned updates in this process (test and benchmark hook only)."""
    factor = ATTACKS[attack]
    chosen = frozenset(devices)
    strategy = exp.strategy
    honest = strategy.train

    def train(task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        update = honest(task, device)
        if device.device_id not in chosen:
            return update
        poisoned: dict[str, codec.Tensor] = {}
        for name, t in update.tensors.items():
            w = codec.to_array(t)
            g = codec.to_array(task.tensors[name]).astype(np.float64)
            poisoned[name] = codec.Dense((g + factor * (w - g)).astype(w.dtype))
        update.tensors = poisoned
        return update

    strategy.train = train  # type: ignore[method-assign]


def config(attack: str | None, defence: str, rounds: int | None = None) -> ExperimentConfig:
    data = yaml.safe_load(BASE.read_text())
    data["name"] = "poisoning"
    if rounds is not None:
        data["rounds"] = rounds
    data.update(DEFENCES[defence])
    return parse_config(data, f"{BASE} ({attack or 'clean'}, {defence})")


def run(attack: str | None, defence: str, run_dir: Path, *, rounds: int | None = None) -> float:
    """The final central test accuracy of one run (reused if ``run_dir`` holds a finished one)."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        cfg = config(attack, defence, rounds)
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("checkpoint", "checkpoint.old", "rounds.csv"):
            path = run_dir / stale
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        exp = Experiment.build(cfg)
        if attack is not None:
            install_attack(exp, attackers(cfg.num_devices), attack)
        rc = run_inproc(cfg, run_dir, run_dir.name, exp=exp, show_progress=False)
        if rc != 0:
            raise RuntimeError(f"run {run_dir} failed (exit code {rc})")
    return float(json.loads(summary.read_text())["final_accuracy"])


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


def table(results: dict[str, dict[str, float]]) -> str:
    clean = results["clean"]["none (mean)"]
    lines = [
        "Final central test accuracy (FedAvg on digits, `experiments/quickstart.yaml`, 20 rounds); the "
        f"clean run without any defence reaches {clean:.4f}. Δ = accuracy − that clean run, in points.",
        "",
        "| defence | clean | Δ | " + " | ".join(f"{a} ({ATTACKS[a]:+g}·(w − g)) | Δ" for a in ATTACKS) + " |",
        "|---|---:|---:|" + "---:|---:|" * len(ATTACKS),
    ]
    for defence in DEFENCES:
        cells = []
        for scenario in ["clean", *ATTACKS]:
            acc = results[scenario][defence]
            cells += [f"{acc:.4f}", f"{100 * (acc - clean):+.1f}"]
        lines.append(f"| {defence} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "poisoning")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/security.md")
    ap.add_argument("--force", action="store_true", help="redo finished runs")
    args = ap.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for scenario in ["clean", *ATTACKS]:
        for defence in DEFENCES:
            run_dir = args.out / f"{scenario}-{slug(defence)}"
            if args.force and run_dir.exists():
                shutil.rmtree(run_dir)
            acc = run(None if scenario == "clean" else scenario, defence, run_dir)
            results.setdefault(scenario, {})[defence] = acc
            print(f"  {scenario:10s} {defence:24s} {acc:.4f}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    if args.docs:
        command = "nice -n 10 .venv/bin/python benchmarks/poisoning.py --out runs/poisoning --docs"
        replace_doc_block(ROOT / "docs" / "security.md", "poisoning-results", f"`{command}`:\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
