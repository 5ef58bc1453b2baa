"""``local_sgd``'s optional training settings: gradient clipping and dropping a short last batch."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shared.algorithms.training import local_sgd
from shared.config import TrainConfig


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32) * 50, rng.integers(0, 3, size=n)


def test_drop_last_skips_the_short_batch_unless_it_is_the_only_one() -> None:
    x, y = _data(21)
    keep = local_sgd(nn.Linear(4, 3), x, y, TrainConfig(batch_size=8), seed=0)
    drop = local_sgd(nn.Linear(4, 3), x, y, TrainConfig(batch_size=8, drop_last=True), seed=0)
    assert (keep["steps"], drop["steps"]) == (3.0, 2.0)
    few = local_sgd(nn.Linear(4, 3), x[:5], y[:5], TrainConfig(batch_size=8, drop_last=True), seed=0)
    assert few["steps"] == 1.0  # a device with fewer samples than a batch still trains


def test_clip_grad_norm_bounds_every_step() -> None:
    """With huge inputs one unclipped SGD step moves the weights far; clipped at c, a plain SGD
    step moves them by at most lr·c in L2 norm."""
    x, y = _data(8)
    moves = {}
    for clip in (None, 1.0):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        local_sgd(model, x, y, TrainConfig(batch_size=8, lr=0.1, clip_grad_norm=clip), seed=0)
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        moves[clip] = float((after - before).norm())
    assert moves[1.0] <= 0.1 * 1.0 + 1e-6
    assert moves[None] > 10 * moves[1.0]
