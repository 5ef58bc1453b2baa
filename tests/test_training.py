"""``local_sgd``'s optional training settings: clipping, dropping a short last batch, local steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
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


def test_local_steps_runs_exactly_tau_batches_across_reshuffled_passes() -> None:
    """τ = 7 on 21 samples in batches of 8 (3 per pass: 8, 8, 5) runs 7 steps over three passes;
    the FLOPs count sees the same batches; ``epochs`` given explicitly still means passes."""
    from shared.algorithms.training import samples_per_task

    x, y = _data(21)
    cfg = TrainConfig(batch_size=8, local_steps=7)
    seen: list[int] = []
    model = nn.Linear(4, 3)
    model.register_forward_hook(lambda _m, inp, _o: seen.append(len(inp[0])))
    out = local_sgd(model, x, y, cfg, seed=0)
    assert out["steps"] == 7.0 and seen == [8, 8, 5, 8, 8, 5, 8]
    assert samples_per_task(cfg, 21) == sum(seen) == 50
    assert samples_per_task(cfg.model_copy(update={"drop_last": True}), 21) == 7 * 8
    assert samples_per_task(TrainConfig(batch_size=8, local_epochs=3), 21) == 63  # epochs: unchanged
    assert local_sgd(nn.Linear(4, 3), x, y, cfg, seed=0, epochs=1)["steps"] == 3.0
    # a device without samples does not loop forever
    assert local_sgd(nn.Linear(4, 3), x[:0], y[:0], cfg, seed=0)["steps"] == 0.0
    assert samples_per_task(cfg, 0) == 0


def test_local_steps_is_refused_by_algorithms_that_would_ignore_it(tmp_path: Path) -> None:
    """FedAvg-style algorithms take ``train.local_steps`` (its FLOPs follow the steps); one with its
    own loop (Hermes) refuses the config with a message naming who takes it."""
    from shared.config import load_config
    from shared.experiment import Experiment
    from tests.conftest import write_config

    train = {"local_steps": 3, "batch_size": 8}
    ok = Experiment.build(load_config(write_config(tmp_path / "a.yaml", train=train)))
    strategy = ok.strategy
    assert strategy.task_flops(strategy.plan(strategy.init_state(), 1, [0], {})[0], 100) == (
        strategy.task_flops(strategy.plan(strategy.init_state(), 1, [0], {})[0], 24)
    )  # 3 steps of 8 samples, however many samples the device has
    bad = Experiment.build(
        load_config(write_config(tmp_path / "b.yaml", train=train, algorithm={"name": "hermes"}))
    )
    with pytest.raises(ValueError, match=r"local_steps applies to: .*fedavg.*heterofl"):
        _ = bad.strategy


def _bn_dropout_model() -> nn.Module:
    """A factory like ``Experiment.model``: it seeds the global generator, then draws the weights.
    BatchNorm brings an integer buffer no task names; Dropout draws from the global generator while
    training, so a reused model that left the generator elsewhere would train differently."""
    torch.default_generator.manual_seed(7)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def test_fedavg_trains_on_one_reused_model_exactly_as_on_fresh_ones(tmp_path: Path) -> None:
    """``Strategy.scratch_model`` (one model per process, overwritten in place) gives bit-for-bit the
    updates of building a model per task, for devices in any order and tasks of different rounds."""
    from shared import codec
    from shared.algorithms.base import DeviceContext, DeviceData, StrategyContext, load_arrays, model_arrays
    from shared.algorithms.fedavg import FedAvg
    from shared.algorithms.training import local_sgd as sgd

    train = TrainConfig(lr=0.1, momentum=0.9, batch_size=8)
    ctx = StrategyContext(_bn_dropout_model, (4,), 3, train, 0, FedAvg.Options())
    strategy = FedAvg(ctx)
    state = strategy.init_state()

    def fresh(
        task_arrays: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, seed: int
    ) -> dict[str, np.ndarray]:
        model = _bn_dropout_model()  # what FedAvg.train did before: a model per task
        current = model_arrays(model)
        current.update(task_arrays)
        load_arrays(model, current)
        sgd(model, x, y, train, seed)
        return {k: v for k, v in model_arrays(model).items() if k in task_arrays}

    rng = np.random.default_rng(3)
    tasks = []
    for round_ in range(3):
        task = strategy.plan(state, round_ + 1, [0], {})[0]
        arrays = {k: codec.to_array(t) for k, t in task.tensors.items()}
        for device in (0, 1, 0):
            x = rng.normal(size=(20 + device, 4)).astype(np.float32)
            y = rng.integers(0, 3, size=20 + device)
            tasks.append((task, arrays, x, y, 100 * round_ + device))
        # the next round's state moves, so a stale copy of the last one would show
        state = type(state)({k: v + 0.01 if v.dtype.kind == "f" else v for k, v in state.arrays.items()})
    assert any(k.endswith("num_batches_tracked") for k in model_arrays(_bn_dropout_model()))
    assert not any(k.endswith("num_batches_tracked") for k in tasks[0][1])  # the initial state fills it
    for task, arrays, x, y, seed in tasks:
        data = DeviceData(x, y, x[:0], y[:0])
        update = strategy.train(task, DeviceContext(seed, 1, data, tmp_path, seed))
        expected = fresh(arrays, x, y, seed)
        got = {k: codec.to_array(t) for k, t in update.tensors.items()}
        assert got.keys() == expected.keys()
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
        assert not np.array_equal(got["0.weight"], arrays["0.weight"])  # it trained
