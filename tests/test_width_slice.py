"""Width slicing machinery (``shared/models/width_slice.py``): slices, narrow models, scatter, accounting.

Spec ``docs/algorithms/feddse.md``: C1 (masked = sliced, Lemma 1'), C2 (holder-mean aggregation),
C6's expected upload fractions, C7 (memory scales linearly with r for activations, ~r² for
parameters; extraction below training) and the §4.2 worked sizes of the paper's CNN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shared import codec
from shared.algorithms.base import load_arrays, model_arrays
from shared.algorithms.training import local_sgd
from shared.config import TrainConfig
from shared.devices import forward_flops, training_footprint
from shared.models import build_model
from shared.models.width_slice import (
    WidthOptions,
    WidthStructure,
    expected_upload_fraction,
    keep_count,
    paper_fluctuation,
    sample_rate,
    unit_scores,
)

MLP_SHAPE = (1, 8, 8)


def _mlp(seed: int = 0) -> nn.Sequential:
    m = build_model("mlp", MLP_SHAPE, 10, seed=seed, hidden=[128, 64])
    assert isinstance(m, nn.Sequential)
    return m


def _random_selection(ws: WidthStructure, rng: np.random.Generator, rate: float) -> dict[str, np.ndarray]:
    return {
        h: np.sort(rng.choice(k, size=c, replace=False)).astype(np.int64)
        for (h, c), k in zip(ws.counts(rate).items(), ws.widths().values(), strict=True)
    }


def _forward_with_unit_mask(
    model: nn.Sequential, ws: WidthStructure, sel: dict[str, np.ndarray], x: Any
) -> Any:
    """The full model with ``h_{l,p}`` forced to 0 for every unit p outside the selection (Lemma 1')."""
    wanted = {v: k for k, v in ws.score_at.items()}
    h = x
    for name, m in model.named_children():
        h = m(h)
        if name in wanted:
            mask = torch.zeros(h.shape[1])
            mask[torch.from_numpy(sel[wanted[name]])] = 1.0
            h = h * mask.view(1, -1, *([1] * (h.dim() - 2)))
    return h


# -- structure and counts -----------------------------------------------------------------------------
def test_mlp_structure_and_counts() -> None:
    ws = WidthStructure(_mlp(), MLP_SHAPE)
    assert ws.hidden == ["fc1", "fc2"]
    assert ws.params(ws.widths()) == 17_226  # spec §8 R0
    assert ws.counts(1 / 16) == {"fc1": 8, "fc2": 4}
    assert keep_count(0.3, 10) == 3 and keep_count(0.3, 10, "ceil") == 3
    assert keep_count(0.01, 64) == 1 and keep_count(0.5, 7) == 3 and keep_count(0.5, 7, "ceil") == 4
    with pytest.raises(ValueError):
        WidthStructure(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), MLP_SHAPE)  # nothing to slice


def test_paper_cnn_sizes_match_spec_4_2() -> None:
    """Params(1) = 1,556,874 and the per-level fractions of §4.2, and the expected upload 0.243."""
    cnn = build_model("cnn_feddse", (1, 28, 28), 10, seed=0)
    assert isinstance(cnn, nn.Sequential)
    ws = WidthStructure(cnn, (1, 28, 28))
    full = ws.params(ws.widths())
    assert full == 1_556_874
    table = {15: 0.879, 9: 0.318, 8: 0.251, 7: 0.193, 5: 0.099, 4: 0.064, 3: 0.036, 2: 0.016, 1: 0.004}
    for sixteenths, frac in table.items():
        assert ws.params(ws.counts(sixteenths / 16)) / full == pytest.approx(frac, abs=6e-4)
    assert expected_upload_fraction(ws, WidthOptions()) == pytest.approx(0.243, abs=1e-3)
    mlp = WidthStructure(_mlp(), MLP_SHAPE)
    assert expected_upload_fraction(mlp, WidthOptions()) == pytest.approx(0.312, abs=1e-3)  # C6


# -- Lemma 1': the sliced model computes what the masked full model computes ------------------------------
@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("mlp", MLP_SHAPE, {"hidden": [128, 64]}),
        ("cnn_feddse", (1, 8, 8), {"channels": [8, 16, 16, 32]}),
        ("cnn_digits", (1, 8, 8), {}),
    ],
)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), rate=st.sampled_from([1 / 16, 0.25, 0.5, 15 / 16, 1.0]))
def test_submodel_forward_equals_masked_full_forward(
    name: str, shape: tuple[int, ...], options: dict[str, Any], seed: int, rate: float
) -> None:
    model = build_model(name, shape, 10, seed=seed % 7, **options)
    assert isinstance(model, nn.Sequential)
    model.eval()
    ws = WidthStructure(model, shape)
    sel = _random_selection(ws, np.random.default_rng(seed), rate)
    arrays = model_arrays(model)
    sub = ws.submodel(model, ws.selection_counts(sel), rate)
    ws.load_compact(sub, ws.compact(arrays, sel))
    sub.eval()
    x = torch.from_numpy(np.random.default_rng(seed + 1).random((6, *shape), dtype=np.float32))
    with torch.no_grad():
        torch.testing.assert_close(sub(x), _forward_with_unit_mask(model, ws, sel, x), atol=1e-5, rtol=1e-5)
    # the uploaded slice has the full shapes and exactly the sub-model's values
    packed = ws.pack(ws.sub_arrays(sub), sel)
    back = ws.selection_from_payload(packed)
    assert all(np.array_equal(back[h], sel[h]) for h in ws.hidden)
    for k, t in packed.items():
        np.testing.assert_array_equal(t.to_dense()[t.mask()], arrays[k][t.mask()])


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("mlp", MLP_SHAPE, {"hidden": [128, 64]}),
        ("cnn_feddse", (1, 16, 16), {"channels": [8, 16, 16, 32]}),  # static BN: > 1 value per channel
        ("cnn_digits", (1, 8, 8), {}),
    ],
)
@pytest.mark.parametrize("rate", [1 / 16, 0.25, 1.0])
def test_forward_macs_are_what_the_sub_model_really_computes(
    name: str, shape: tuple[int, ...], options: dict[str, Any], rate: float
) -> None:
    """The formula FedDSE charges for its scoring pass and sub-model training (``forward_macs``)
    against a hook-measured forward pass of the physically built sub-model: once counted every
    Linear's output units as "positions" and over-charged the MLP's scoring pass ~60x."""
    model = build_model(name, shape, 10, seed=0, **options)
    assert isinstance(model, nn.Sequential)
    ws = WidthStructure(model, shape)
    counts = ws.counts(rate)
    sub = ws.submodel(model, counts, rate)
    assert 2 * ws.forward_macs(counts) == forward_flops(sub, shape)


def test_masked_training_equals_sliced_training() -> None:
    """C1 (Lemma 1'): SGD with momentum and weight decay on the slice gives the same kept weights as
    SGD on the full model whose pruned rows/columns are zero and kept at zero."""
    model = _mlp(3)
    ws = WidthStructure(model, MLP_SHAPE)
    rng = np.random.default_rng(0)
    sel = _random_selection(ws, rng, 0.25)
    x = rng.random((40, *MLP_SHAPE), dtype=np.float32)
    y = rng.integers(0, 10, 40)
    train = TrainConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=5e-4)
    arrays = model_arrays(model)

    sub = ws.submodel(model, ws.selection_counts(sel), 0.25)
    ws.load_compact(sub, ws.compact(arrays, sel))
    local_sgd(sub, x, y, train, seed=11)
    sliced = ws.pack(ws.sub_arrays(sub), sel)

    masks = {
        k: torch.from_numpy(codec.Sliced.from_dense(arrays[k], ws.axis_indices(k, sel)).mask())
        for k in ws.shapes
    }
    masked = _mlp(3)
    load_arrays(masked, {k: v * masks[k].numpy() for k, v in arrays.items()})
    params = dict(masked.named_parameters())

    @torch.no_grad()
    def rezero(_: nn.Module) -> None:
        for k, m in masks.items():
            params[k].mul_(m)

    local_sgd(masked, x, y, train, seed=11, after_step=rezero)
    trained = model_arrays(masked)
    for k, t in sliced.items():
        np.testing.assert_allclose(trained[k][t.mask()], t.values.ravel(), atol=1e-5)
        assert np.all(trained[k][~t.mask()] == 0)


# -- C2: holder-mean aggregation ---------------------------------------------------------------------------
def test_holder_mean_aggregation_c2() -> None:
    """Two clients over a 4-unit hidden layer: unit 0 held by both → mean; unit 1 only by B → B's value;
    unit 3 by nobody → unchanged; classifier columns outside both selections unchanged."""
    model = build_model("mlp", (3,), 2, seed=0, hidden=[4])
    assert isinstance(model, nn.Sequential)
    ws = WidthStructure(model, (3,))
    old = {k: np.full(s, 7.0, np.float32) for k, s in ws.shapes.items()}
    sel_a, sel_b = {"fc1": np.array([0, 2])}, {"fc1": np.array([0, 1])}
    a = {k: np.full(v.shape, 1.0, np.float32) for k, v in ws.compact(old, sel_a).items()}
    b = {k: np.full(v.shape, 3.0, np.float32) for k, v in ws.compact(old, sel_b).items()}
    sa, ca = ws.scatter(ws.pack(a, sel_a))
    sb, cb = ws.scatter(ws.pack(b, sel_b))
    new = {k: ws.average(old[k], sa[k] + sb[k], ca[k] + cb[k]) for k in ws.shapes}
    w1, w2, b2 = new["fc1.weight"], new["fc2.weight"], new["fc2.bias"]
    assert np.all(w1[0] == 2.0) and np.all(w1[1] == 3.0) and np.all(w1[2] == 1.0) and np.all(w1[3] == 7.0)
    assert np.all(w2[:, 0] == 2.0) and np.all(w2[:, 1] == 3.0) and np.all(w2[:, 2] == 1.0)
    assert np.all(w2[:, 3] == 7.0)  # column of a unit nobody held
    assert np.all(b2 == 2.0)  # the classifier bias is in every sub-model
    # the authors' code variant: the old value is one extra vote
    inc = ws.average(
        old["fc1.weight"],
        sa["fc1.weight"] + sb["fc1.weight"],
        ca["fc1.weight"] + cb["fc1.weight"],
        include_global=True,
    )
    assert np.allclose(inc[0], (7 + 1 + 3) / 3) and np.allclose(inc[3], 7.0) and np.allclose(inc[2], 4.0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 5), data=st.data())
def test_scatter_sums_are_order_and_split_free(seed: int, n: int, data: Any) -> None:
    model = build_model("mlp", (5,), 3, seed=0, hidden=[8, 4])
    assert isinstance(model, nn.Sequential)
    ws = WidthStructure(model, (5,))
    rng = np.random.default_rng(seed)
    ups = []
    for _ in range(n):
        sel = _random_selection(ws, rng, float(rng.choice([0.25, 0.5, 1.0])))
        full = {k: rng.normal(size=shape).astype(np.float32) for k, shape in ws.shapes.items()}
        compact = ws.compact(full, sel)
        ups.append(ws.pack(compact, sel))
    order = data.draw(st.permutations(range(n)))
    cut = data.draw(st.integers(0, n))

    def total(idx: list[int]) -> dict[str, np.ndarray]:
        out = {k: np.zeros(s) for k, s in ws.shapes.items()}
        for i in idx:
            s, _ = ws.scatter(ups[i])
            for k in out:
                out[k] += s[k]
        return out

    whole = total(list(range(n)))
    left, right = total(list(order[:cut])), total(list(order[cut:]))
    for k in whole:
        np.testing.assert_allclose(left[k] + right[k], whole[k], rtol=1e-12, atol=1e-12)


# -- capacities --------------------------------------------------------------------------------------------
def test_paper_capacity_distribution() -> None:
    assert paper_fluctuation(1.0)[1] == (0.0, 0.01, 0.99)
    assert paper_fluctuation(1 / 16)[1] == (0.0, 1.0, 0.0)
    rng = np.random.default_rng(0)
    draws = np.array([sample_rate(WidthOptions(), rng) for _ in range(20_000)])
    assert set(np.round(draws * 16).astype(int)) <= {1, 2, 3, 4, 5, 7, 8, 9, 15, 16}
    assert np.mean(draws == 15 / 16) == pytest.approx(0.2 * 0.99, abs=0.01)
    assert np.mean(draws == 1 / 16) == pytest.approx(0.2 + 0.2 * 0.01, abs=0.01)
    assert draws.mean() == pytest.approx(0.375, abs=0.01)  # spec §4.2: E[r] = 0.375
    rho = WidthOptions(capacity="levels", levels=(0.5, 1 / 16), level_probs=(0.2, 0.8))
    two = np.array([sample_rate(rho, rng) for _ in range(5000)])
    assert set(two) == {0.5, 1 / 16} and np.mean(two == 0.5) == pytest.approx(0.2, abs=0.02)
    with pytest.raises(ValueError):
        WidthOptions(level_probs=(0.5, 0.5))


# -- C7: memory ----------------------------------------------------------------------------------------------
def test_activation_memory_is_linear_in_r_and_extraction_fits() -> None:
    shape = (1, 16, 16)
    cnn = build_model("cnn_feddse", shape, 10, seed=0, channels=[48, 96, 96, 192])
    assert isinstance(cnn, nn.Sequential)
    ws = WidthStructure(cnn, shape)
    full = training_footprint(cnn, shape, 8, optimizer="sgd_momentum")
    third = ws.submodel(cnn, ws.counts(1 / 3), 1 / 3)
    sub = training_footprint(third, shape, 8, optimizer="sgd_momentum")
    assert sub.activations_bytes / full.activations_bytes == pytest.approx(1 / 3, abs=0.01)
    assert sub.params_bytes / full.params_bytes == pytest.approx(1 / 9, abs=0.02)  # ~r² hidden-hidden
    # FedDSE's extra pass: the full model at inference, one or two live layers, batch = all local data
    assert ws.extraction_bytes(8) < full.total


def test_unit_scores_are_post_relu_means() -> None:
    model = _mlp(1)
    ws = WidthStructure(model, MLP_SHAPE)
    x = np.random.default_rng(0).random((30, *MLP_SHAPE), dtype=np.float32)
    s = unit_scores(model, ws, x)
    with torch.no_grad():
        h1 = torch.relu(model[1](torch.from_numpy(x).flatten(1)))  # fc1
        h2 = torch.relu(model[3](h1))  # fc2
    np.testing.assert_allclose(s["fc1"], h1.mean(0).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s["fc2"], h2.mean(0).numpy(), rtol=1e-6, atol=1e-7)


def test_fan_in_scaling_restores_the_full_pre_activation_scale() -> None:
    """With equal weights and no biases, the narrow model with its inputs ×(m/k) computes the full
    model's output; the scalers act only in training and add no tensors."""
    model = build_model("mlp", (4,), 2, seed=0, hidden=[8, 4])
    assert isinstance(model, nn.Sequential)
    ws = WidthStructure(model, (4,))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(0.0 if name.endswith("bias") else 0.1)
    sel = {"fc1": np.array([1, 5]), "fc2": np.array([0, 1])}
    sub = ws.submodel(model, ws.selection_counts(sel), 0.25, fan_in_scaling=True)
    ws.load_compact(sub, ws.compact(model_arrays(model), sel))
    assert [n for n, _ in sub.named_children() if n.endswith("_fanin")] == ["fc2_fanin", "fc3_fanin"]
    assert set(sub.state_dict()) == set(ws.shapes)
    x = torch.ones(1, 4)
    with torch.no_grad():
        sub.train()
        torch.testing.assert_close(sub(x), model(x))  # uniform weights: scaled narrow = full
        sub.eval()
        assert not torch.allclose(sub(x), model(x))  # evaluation: no scaling
