"""Why SpaFL fails on Fashion-MNIST with LeNet-5 at the spec's lr: thresholds outrun the weights.

    PYTHONPATH=. .venv/bin/python benchmarks/spafl_fashion_diagnosis.py \
        [--runs runs/reproduce/spafl/spafl-results-fashion]

Why a separate script: ``make reproduce ALG=spafl`` shows SpaFL and Local far below FedAvg on
``experiments/spafl_fashion.yaml``; this isolates the cause without any federation. Five devices of
that config's seed-0 partition each train three local rounds (SpaFL's client procedure, *Local*
mode: no exchange, so aggregation and eq. 13 play no part) at the spec's lr 0.05 and at two smaller
ones, next to the plain LeNet-5 (no thresholds) at 0.05. It prints each device's accuracy on its own
test split, the layer-averaged density, and the largest |τ| any step reached: with the same lr for
weights and thresholds (spec §3.3), a conv filter's threshold gradient sums over every position of
the filter, so one step can move τ past the filter's mean |w| (~0.1) and prune the layer. A row
with the spec's τ ∈ [0, 1] clamp shows that bounding τ does not stop the jump. With ``--runs`` (the
directory ``make reproduce ALG=spafl`` ran the Fashion block in) it also prints the largest |τ| per
layer of each federated SpaFL run's final global thresholds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shared.algorithms.spafl as spafl  # noqa: E402
from shared.algorithms.base import DeviceContext, TaskSpec  # noqa: E402
from shared.algorithms.training import evaluate, local_sgd  # noqa: E402
from shared.config import parse_config  # noqa: E402
from shared.experiment import Experiment  # noqa: E402

DEVICES = (14, 0, 2, 3, 4)
ROUNDS = 3


def _experiment(lr: float, clamp: bool = False) -> Experiment:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "experiments/spafl_fashion.yaml").read_text())
    raw["algorithm"]["options"]["mode"] = "local_only"
    raw["algorithm"]["options"]["clamp"] = clamp
    raw["train"]["lr"] = lr
    return Experiment.build(parse_config(raw, "spafl-fashion-diagnosis"))


def spafl_local(lr: float, clamp: bool = False) -> tuple[list[str], float]:
    """Per device "accuracy / layer density" after ``ROUNDS`` local rounds, and the largest |τ|."""
    exp = _experiment(lr, clamp)
    strategy = exp.strategy
    biggest = 0.0
    inner = spafl.local_sgd

    def recording(model: torch.nn.Module, *args: Any, after_step: Any = None, **kw: Any) -> Any:
        layers = spafl.masked_layers(model)

        def step(m: torch.nn.Module) -> None:
            nonlocal biggest
            after_step(m)
            biggest = max(biggest, *(float(layer.tau.detach().abs().max()) for layer in layers.values()))

        return inner(model, *args, after_step=step, **kw)

    spafl.local_sgd = recording
    cells = []
    try:
        with tempfile.TemporaryDirectory() as td:
            for dev in DEVICES:
                metrics: dict[str, float] = {}
                for r in range(1, ROUNDS + 1):
                    ctx = DeviceContext(dev, r, exp.device_data(dev), Path(td) / f"d{dev}", 1000 * r + dev)
                    metrics = strategy.train(TaskSpec(), ctx).metrics
                cells.append(f"{metrics['eval_accuracy']:.2f} / {metrics['density_layer_avg']:.2f}")
    finally:
        spafl.local_sgd = inner
    return cells, biggest


def plain(lr: float) -> list[str]:
    """The same devices and epochs with the unmasked LeNet-5 (what FedAvg trains)."""
    exp = _experiment(lr)
    out = []
    for dev in DEVICES:
        model = exp.model()
        data = exp.device_data(dev)
        for r in range(1, ROUNDS + 1):
            local_sgd(model, data.x_train, data.y_train, exp.cfg.train, 1000 * r + dev)
        out.append(f"{evaluate(model, data.x_test, data.y_test)['accuracy']:.2f}")
    return out


def global_thresholds(runs: Path) -> None:
    """The largest |τ| per layer of each federated SpaFL run's final global state (its checkpoint)."""
    for state in sorted(runs.glob("a*-SpaFL*-s*/checkpoint/state.npz")):
        with np.load(state, allow_pickle=False) as z:
            biggest = {
                k.removeprefix("tau/"): float(np.abs(z[k]).max()) for k in z.files if k.startswith("tau/")
            }
        print(state.parents[1].name, " ".join(f"{k} {v:.3g}" for k, v in biggest.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, help="the Fashion block's run directory (global τ of its runs)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    head = " | ".join(f"device {d}" for d in DEVICES)
    print(f"| run (3 local rounds of 5 epochs) | {head} | max abs(tau) |")
    print("|---|" + "---|" * (len(DEVICES) + 1))
    print(f"| plain LeNet-5, lr 0.05 (accuracy) | {' | '.join(plain(0.05))} | – |")
    for lr in (0.05, 0.01, 0.005):
        cells, biggest = spafl_local(lr)
        print(f"| SpaFL Local, lr {lr} (accuracy / density) | {' | '.join(cells)} | {biggest:.3g} |")
    cells, biggest = spafl_local(0.05, clamp=True)
    print(f"| SpaFL Local, lr 0.05, τ clamped to [0, 1] | {' | '.join(cells)} | {biggest:.3g} |")
    if args.runs is not None:
        print()
        global_thresholds(args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
