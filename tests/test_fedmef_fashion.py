"""FedMef's Fashion-MNIST setting (issue #17): LeNet-5 carries both FedMef's SAP model and FedTiny's
BN model, and the two configs differ only where the paper's methods differ (spec fedmef.md §7, §8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

from shared.algorithms.dynamic_pruning import DynamicPruning
from shared.config import parse_config
from shared.experiment import Experiment
from shared.models import build_model

ROOT = Path(__file__).resolve().parents[1]


def test_lenet5_batch_norm_adds_bn_after_each_conv_and_keeps_the_initial_weights() -> None:
    """FedTiny's BN twin must start from FedMef's initial weights, or check 2 compares inits too."""
    plain = build_model("lenet5_fmnist", (1, 28, 28), 10, seed=3)
    bn = build_model("lenet5_fmnist", (1, 28, 28), 10, seed=3, batch_norm=True)
    names = [n for n, _ in bn.named_children()]
    assert names[:4] == ["conv1", "bn1", "relu1", "pool1"]
    assert names[4:8] == ["conv2", "bn2", "relu2", "pool2"]
    bn_params = dict(bn.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, bn_params[name]), name


def _experiment(config: str, seed: int = 0) -> Experiment:
    raw = yaml.safe_load((ROOT / "experiments" / config).read_text())
    raw["seed"] = seed
    return Experiment.build(parse_config(raw, config))


def test_fashion_configs_share_data_and_mask_and_differ_in_the_model_only() -> None:
    mef, tiny = _experiment("fedmef_fashion_lenet.yaml"), _experiment("fedtiny_fashion_lenet.yaml")
    sm, st = mef.strategy, tiny.strategy
    assert isinstance(sm, DynamicPruning) and isinstance(st, DynamicPruning)
    assert sm.prunable == st.prunable == ["conv2.weight", "fc1.weight", "fc2.weight", "fc3.weight"]
    a, b = sm.init_state(), st.init_state()
    for name in sm.prunable:  # the same initial mask and weights on it (spec §9.20)
        np.testing.assert_array_equal(a.arrays[name] != 0, b.arrays[name] != 0)
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])
    assert any(k.startswith("bn") for k in b.arrays) and not any(k.startswith("bn") for k in a.arrays)
    np.testing.assert_array_equal(mef.dataset.y_train, tiny.dataset.y_train)


def test_fedmef_trains_lenet5_with_nsconv_and_pruned_caches() -> None:
    """The SAP path (NSConv, packed caches, MaskReLU) runs on LeNet-5's max-pools and three FCs."""
    exp = _experiment("fedmef_fashion_lenet.yaml")
    s = exp.strategy
    assert isinstance(s, DynamicPruning)
    state = s.init_state()
    task = s.plan(state, 1, [0], {})[0]
    assert s.task_footprint(task).total > 0
    model = s.load_model(state)
    x = torch.tensor(exp.dataset.x_test[:16], dtype=torch.float32)  # a copy: the data is read-only
    y = torch.tensor(exp.dataset.y_test[:16], dtype=torch.long)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n == "conv2.weight"]
    assert grads and grads[0] is not None and torch.isfinite(grads[0]).all()
