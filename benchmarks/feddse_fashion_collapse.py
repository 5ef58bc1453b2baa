"""Why FedAvg collapses on the FedDSE Fashion-MNIST setting: a plain PyTorch FedAvg loop, no fedfleet.

    PYTHONPATH=. .venv/bin/python benchmarks/feddse_fashion_collapse.py --seeds 0 --out runs/feddse-collapse

Why a second implementation: at the spec's hyper-parameters every fedfleet run of
``experiments/feddse_fashion.yaml`` (FedAvg included) ends at 10 % after peaking at ~35 %. If a
loop written from scratch — the same data split, initial weights, model, lr / momentum / weight decay,
E and B, but its own device sampling, local SGD and sample-weighted mean — collapses the same way,
the services are not the cause. Only ``Experiment`` is borrowed, for the identical data partition and
initial model; training and aggregation are plain ``torch``.

Per round it records what tells a collapse's kind apart: the global test accuracy, the participants'
mean training loss, whether any weight became non-finite, the fraction of dead units in each ReLU
layer (zero on every one of 2,000 test images) and how many distinct classes the model predicts
(one class = a constant prediction = 10 %). The variants switch on the authors' code's training
recipe (spec §3.4 / §9.10: absent classes' logits zeroed, ``label_mask``; gradients clipped at norm
1, ``train.clip_grad_norm``), the same for every method, so they are not per-method tuning.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.config import parse_config  # noqa: E402
from shared.experiment import Experiment  # noqa: E402

CONFIG = ROOT / "experiments" / "feddse_fashion.yaml"
#: label -> (zero absent classes' logits, clip gradient norm)
VARIANTS: dict[str, tuple[bool, float | None]] = {
    "plain": (False, None),
    "label-mask": (True, None),
    "clip-1": (False, 1.0),
    "label-mask+clip-1": (True, 1.0),
}

torch.set_num_threads(1)


def _relu_inputs(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of every ReLU of ``model`` on ``x`` (hooks would be the same; this is explicit)."""
    outs = []
    h = x
    for layer in model:
        h = layer(h)
        if isinstance(layer, nn.ReLU):
            outs.append(h)
    return outs


def diagnose(model: nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Accuracy, predicted classes and dead units of ``model`` on (x, y)."""
    assert isinstance(model, nn.Sequential)
    model.eval()
    with torch.no_grad():
        xt = torch.from_numpy(x.astype(np.float32))
        logits = model(xt)
        pred = logits.argmax(1).numpy()
        dead = []
        for act in _relu_inputs(model, xt[:2000]):
            per_unit = act.transpose(0, 1).reshape(act.shape[1], -1)  # unit (channel) x samples
            dead.append(float((per_unit.abs().max(1).values == 0).float().mean()))
    return {
        "accuracy": float((pred == y).mean()),
        "classes_predicted": len(np.unique(pred)),
        "dead": dead,
        "finite": bool(all(torch.isfinite(p).all() for p in model.parameters())),
    }


def local_train(
    model: nn.Module, x: np.ndarray, y: np.ndarray, cfg: Any, seed: int, mask: bool, clip: float | None
) -> float:
    """E epochs of minibatch SGD with a fresh optimizer (spec §3.4); returns the mean loss."""
    model.train()
    opt = torch.optim.SGD(
        model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum, weight_decay=cfg.train.weight_decay
    )
    absent = torch.from_numpy(np.bincount(y, minlength=10) == 0)
    xt, yt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(cfg.train.local_epochs):
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), cfg.train.batch_size):
            idx = order[start : start + cfg.train.batch_size]
            out = model(xt[idx])
            if mask:
                out = out.masked_fill(absent, 0.0)
            loss = nn.functional.cross_entropy(out, yt[idx])
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def run(seed: int, mask: bool, clip: float | None, rounds: int | None) -> list[dict[str, Any]]:
    raw = yaml.safe_load(CONFIG.read_text())
    raw["seed"] = seed
    cfg = parse_config(raw, "collapse")
    exp = Experiment.build(cfg)
    data = [exp.device_data(d) for d in range(cfg.num_devices)]
    xte, yte = exp.dataset.x_test, exp.dataset.y_test
    model = exp.model()
    rng = np.random.default_rng(seed)
    log = []
    for rnd in range(rounds or cfg.rounds):
        chosen = rng.choice(cfg.num_devices, cfg.devices_per_round, replace=False)
        total: dict[str, torch.Tensor] = {}
        weight, losses = 0, []
        for dev in chosen:
            local = copy.deepcopy(model)
            d = data[int(dev)]
            losses.append(
                local_train(local, d.x_train, d.y_train, cfg, seed * 1000 + rnd * 100 + int(dev), mask, clip)
            )
            n = len(d.y_train)
            for k, v in local.state_dict().items():
                total[k] = total.get(k, torch.zeros_like(v, dtype=torch.float64)) + n * v.double()
            weight += n
        model.load_state_dict({k: (v / weight).float() for k, v in total.items()})
        row = {"round": rnd + 1, "train_loss": float(np.mean(losses)), **diagnose(model, xte, yte)}
        log.append(row)
        print(
            f"r{rnd + 1:3d} acc {100 * row['accuracy']:5.1f} loss {row['train_loss']:.3f} "
            f"classes {row['classes_predicted']} dead {' '.join(f'{v:.2f}' for v in row['dead'])}",
            flush=True,
        )
    return log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "feddse-collapse")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        mask, clip = VARIANTS[variant]
        for seed in args.seeds:
            print(f"== {variant} seed {seed}", flush=True)
            log = run(seed, mask, clip, args.rounds)
            (args.out / f"{variant}-s{seed}.json").write_text(json.dumps(log, indent=1))
            acc = [r["accuracy"] for r in log]
            print(
                f"== {variant} seed {seed}: peak {100 * max(acc):.1f} % (round {int(np.argmax(acc)) + 1}), "
                f"acc5 {100 * float(np.mean(acc[-5:])):.1f} %",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
