"""The federated dynamic pruning machinery: schedules, masks, prune/grow, packed caches, NSConv, SAP,
and the paper's memory model (spec fedmef.md §3-4, checks 1 and 8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shared.devices import measure_activation_bytes
from shared.models import build_model
from shared.models.dynamic_sparse import (
    LeanAvgPool2d,
    MaskReLU,
    NSConv2d,
    SAPLinear,
    extrusion_lr,
    fan_in_scaled,
    is_adjust_round,
    keep_count,
    layer_densities,
    memory_model,
    pack_bits,
    prune_and_grow,
    prune_cache,
    random_masks,
    rex_factor,
    set_masks,
    standardize,
    storage_bits,
    to_fedmef_model,
    topk_pruned,
    unpack_bits,
    unprune_cache,
    xi_count,
    xi_fraction,
)

SHAPES = {"conv2.weight": (32, 16, 3, 3), "fc.weight": (10, 512)}


# -- schedules (check 8) ---------------------------------------------------------------------------
def test_rex_factor_and_xi_schedule_sanity_values() -> None:
    assert rex_factor(0, 100) == 1.0
    assert rex_factor(50, 100) == pytest.approx(2 / 3)
    assert rex_factor(100, 100) == 0.0
    assert xi_fraction(0, 300) == pytest.approx(0.4)
    assert xi_fraction(150, 300) == pytest.approx(0.2)
    assert xi_fraction(100, 300) == pytest.approx(0.3)
    assert xi_fraction(250, 300) == pytest.approx(0.0268, abs=1e-4)
    assert xi_fraction(300, 300) == 0.0
    assert xi_count(12, 24, 461, 4608) == math.floor(0.2 * 461)  # ξ(R_stop/2) = 0.2 n_l
    assert xi_count(0, 24, 900, 1000) == 100  # capped by numel − n_l


def test_adjustment_predicate_default_and_literal() -> None:
    default = [r for r in range(30) if is_adjust_round(r, 4, 24)]
    literal = [r for r in range(30) if is_adjust_round(r, 4, 24, literal=True)]
    assert default == [4, 8, 12, 16, 20]
    assert literal == [0, 4, 8, 12, 16, 20, 24]
    assert not any(is_adjust_round(r, 0, 24) for r in range(30))


@given(
    st.integers(1, 500),
    st.integers(0, 500),
    st.floats(0, 100, allow_nan=False),
    st.floats(1e-4, 2),
    st.floats(0, 2),
)
def test_extrusion_beta_never_exceeds_eta0_and_mu_is_at_least_eta_r(
    budget: int, t: int, norm: float, eta0: float, eta_r: float
) -> None:
    mu = extrusion_lr(t, budget, norm, eta0, eta_r)
    assert mu >= eta_r
    assert mu <= max(eta0, eta_r) + 1e-12


# -- masks, prune and grow ---------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0.05, 0.1, 0.2])
def test_random_masks_keep_exact_counts_and_depend_only_on_seed_and_layer(density: float) -> None:
    a = random_masks(SHAPES, density, seed=3)
    b = random_masks({"fc.weight": SHAPES["fc.weight"]}, density, seed=3)  # another model, same layer
    for name, shape in SHAPES.items():
        assert a[name].shape == shape and int(a[name].sum()) == round(math.prod(shape) * density)
    np.testing.assert_array_equal(a["fc.weight"], b["fc.weight"])
    assert not np.array_equal(a["fc.weight"], random_masks(SHAPES, density, seed=4)["fc.weight"])


def test_erk_densities_reach_the_global_density() -> None:
    d = layer_densities(SHAPES, 0.1, "erk")
    kept = sum(d[k] * math.prod(s) for k, s in SHAPES.items())
    assert kept == pytest.approx(0.1 * sum(math.prod(s) for s in SHAPES.values()))
    assert d["conv2.weight"] != d["fc.weight"] and all(0 < v <= 1 for v in d.values())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(20, 300), st.floats(0.05, 0.5), st.floats(0.0, 0.4))
def test_prune_and_grow_conserves_nnz_drops_smallest_grows_largest(
    seed: int, n: int, density: float, frac: float
) -> None:
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, max(1, int(n * density)), replace=False)] = True
    w = rng.normal(size=n) * mask
    g = rng.normal(size=n)
    xi = xi_count(0, 1, int(mask.sum()), n) if frac == 0 else min(int(frac * mask.sum()), n - int(mask.sum()))
    new, dropped, grown = prune_and_grow(w, mask, g, xi, rng)
    assert new.sum() == mask.sum()
    assert len(dropped) == len(grown) == xi
    assert not np.intersect1d(dropped, grown).size
    assert mask[dropped].all() and not mask[grown].any()
    if xi:
        kept = np.flatnonzero(mask & new)
        assert np.abs(w[dropped]).max() <= np.abs(w[kept]).min() + 1e-12
        still_pruned = np.flatnonzero(~mask & ~new)
        if still_pruned.size:
            assert np.abs(g[grown]).min() >= np.abs(g[still_pruned]).max() - 1e-12


def test_topk_lists_only_pruned_positions_largest_first() -> None:
    g = torch.tensor([5.0, -9.0, 1.0, -3.0, 7.0, 0.5])
    m = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    idx, vals = topk_pruned(g, m, 2)
    assert idx.tolist() == [1, 3] and vals.tolist() == [-9.0, -3.0]  # signed, sorted by index


# -- packed caches and SAP ----------------------------------------------------------------------------
@given(st.lists(st.booleans(), min_size=1, max_size=200))
def test_pack_bits_roundtrip(flags: list[bool]) -> None:
    m = torch.tensor(flags)
    packed = pack_bits(m)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(flags) / 8)
    assert torch.equal(unpack_bits(packed, len(flags)), m)


def test_prune_cache_keeps_the_largest_magnitudes_without_rescaling() -> None:
    x = torch.randn(4, 3, 5, 5)
    packed, values = prune_cache(x, 0.1)
    k = keep_count(x.numel(), 0.1)
    assert values.numel() == k
    back = unprune_cache(packed, values, x.shape)
    kept = back != 0
    assert int(kept.sum()) == k
    assert torch.equal(back[kept], x[kept])  # no 1/(1 − s) rescaling
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_sap_conv_and_linear_use_dense_forward_and_pruned_cache_for_the_weight_gradient() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    ns = NSConv2d(conv, keep=0.2, standardize=False)
    x = torch.randn(5, 4, 6, 6, requires_grad=True)
    out = ns(x)
    torch.testing.assert_close(out, F.conv2d(x, conv.weight, conv.bias, padding=1))
    g = torch.randn_like(out)
    out.backward(g)
    xp = unprune_cache(*prune_cache(x.detach(), 0.2), x.shape)
    w = conv.weight.detach().clone().requires_grad_(True)
    xd = x.detach().clone().requires_grad_(True)
    F.conv2d(xd, w, None, padding=1).backward(g)
    w2 = conv.weight.detach().clone().requires_grad_(True)
    F.conv2d(xp, w2, None, padding=1).backward(g)
    assert x.grad is not None and conv.weight.grad is not None
    torch.testing.assert_close(x.grad, xd.grad)  # input gradient: dense, unaffected
    torch.testing.assert_close(conv.weight.grad, w2.grad)  # weight gradient from the pruned cache
    assert w.grad is not None and not torch.allclose(conv.weight.grad, w.grad)

    lin = nn.Linear(20, 7)
    sl = SAPLinear(lin, keep=0.3)
    xl = torch.randn(8, 20, requires_grad=True)
    ol = sl(xl)
    torch.testing.assert_close(ol, lin(xl))
    gl = torch.randn_like(ol)
    ol.backward(gl)
    xlp = unprune_cache(*prune_cache(xl.detach(), 0.3), xl.shape)
    assert lin.weight.grad is not None
    torch.testing.assert_close(lin.weight.grad, gl.t() @ xlp)
    torch.testing.assert_close(xl.grad, gl @ lin.weight.detach())


def test_lean_relu_and_pool_have_the_standard_gradients() -> None:
    x = torch.randn(3, 4, 7, 7, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    g = torch.randn(3, 4, 3, 3)
    LeanAvgPool2d(2)(MaskReLU()(x)).backward(g)
    F.avg_pool2d(F.relu(y), 2).backward(g)
    torch.testing.assert_close(x.grad, y.grad)


def test_standardize_is_zero_mean_on_kept_weights_and_zero_off_the_mask() -> None:
    torch.manual_seed(1)
    theta = torch.randn(8, 4, 3, 3) * 3 + 1
    mask = (torch.rand_like(theta) < 0.3).float()
    mask[:, 0, 0, 0] = 1.0
    mask[0, 0, 0, 1] = 1.0
    w = standardize(theta, mask, gamma=1.5)
    assert torch.all(w[mask == 0] == 0)
    for i in range(8):
        kept = w[i][mask[i] > 0]
        if kept.numel() > 1:
            assert abs(float(kept.mean())) < 1e-5
            assert float(kept.pow(2).sum()) == pytest.approx(1.5**2, rel=1e-3)  # fan-in corrected: Σ = γ²
    # literal Eq. 7: γ √c_in scale per entry (after re-masking)
    lit = standardize(theta, mask, gamma=1.0, literal=True)
    assert torch.all(lit[mask == 0] == 0)
    assert float(lit[0][mask[0] > 0].std(unbiased=False)) == pytest.approx(math.sqrt(4), rel=1e-3)


def test_nsconv_outputs_are_zero_centred_unlike_a_plain_conv() -> None:
    """Check 7 (Fig. 3) on random weights: |mean|/std per channel of a conv on ReLU inputs."""
    torch.manual_seed(2)
    conv = nn.Conv2d(16, 32, 3, padding=1)
    nn.init.uniform_(conv.weight, 0.0, 0.1)  # a mean shift in the weights
    mask = (torch.rand_like(conv.weight) < 0.1).float()
    with torch.no_grad():
        conv.weight.mul_(mask)
    x = F.relu(torch.randn(64, 16, 8, 8))

    def ratio(out: torch.Tensor) -> float:
        o = out.transpose(0, 1).reshape(out.shape[1], -1)
        return float((o.mean(1).abs() / o.std(1)).mean())

    ns = NSConv2d(conv, keep=1.0)
    ns.set_mask(mask)
    with torch.no_grad():
        ns.bias.zero_()  # type: ignore[union-attr]
        r_ns = ratio(ns(x))
        r_plain = ratio(F.conv2d(x, conv.weight, None, padding=1))
    assert r_ns < 0.1 < r_plain


# -- memory: the paper's model (check 1) and the measured cache ---------------------------------------
def test_storage_schemes_follow_app_c1() -> None:
    assert storage_bits(10, 10, 95) == 100 * 32  # dense
    assert storage_bits(10, 10, 50) == 100 + 50 * 32  # bitmap
    assert storage_bits(10, 10, 20) == 20 * 7 + 20 * 32  # COO: ⌈log2 100⌉ = 7
    # CSR: 102 values of a 16 × 64 cache: 102·6 + 16·7 + 102·32 (spec §8 worked example)
    assert storage_bits(16, 64, 102) == 3988


@pytest.mark.parametrize(
    ("density", "fedtiny", "fedmef", "reduction"),
    [(0.1, 1_772_530, 1_060_029, 0.402), (0.05, None, None, 0.418), (0.2, None, None, 0.375)],
)
def test_paper_memory_model_reproduces_the_spec_worked_example(
    density: float, fedtiny: int | None, fedmef: int | None, reduction: float
) -> None:
    model = build_model("tinycnn", (1, 8, 8), 10)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n in SHAPES}
    mm = memory_model(model, (1, 8, 8), random_masks(shapes, density, 0), batch_size=16)
    xi = sum(round(0.4 * mm.weights[n][2]) for n in SHAPES)
    assert mm.caches == {"conv1": 64, "conv2": 1024, "fc": 512}
    assert mm.footprint("fedavg") == 2_270_208
    tiny, mef = mm.footprint("fedtiny", xi_total=xi), mm.footprint("fedmef", keep=0.1, xi_total=xi)
    if fedtiny is not None:
        assert (mm.params(), mm.activations(), mm.activations(0.1), 96 * xi) == (
            48_393,
            819_200,
            106_699,
            37_344,
        )
        assert (tiny, mef) == (fedtiny, fedmef)
        assert mm.activations(0.1) / mm.activations() == pytest.approx(0.13, abs=0.005)
    assert 1 - mef / tiny == pytest.approx(reduction, abs=0.0006)
    assert 0.25 <= 1 - mef / tiny <= 0.45


def test_measured_cache_of_the_sap_model_is_the_packed_size() -> None:
    """The saved-tensor measurement (what admission uses) sees exactly the packed caches: going from a
    dense cache to keep = 0.1 saves 4·N − ⌈N/8⌉ − 4·k bytes per conv/linear input of N elements."""
    base = build_model("tinycnn", (1, 8, 8), 10, seed=0)
    batch = torch.zeros(16, 1, 8, 8)
    other = build_model("tinycnn", (1, 8, 8), 10, seed=0)
    assert isinstance(base, nn.Sequential) and isinstance(other, nn.Sequential)
    dense = to_fedmef_model(base, keep=1.0)
    sap = to_fedmef_model(other, keep=0.1)
    masks = {n: torch.from_numpy(m.astype(np.float32)) for n, m in random_masks(SHAPES, 0.1, 0).items()}
    set_masks(dense, masks)
    set_masks(sap, masks)
    m_dense = measure_activation_bytes(dense, batch)
    m_sap = measure_activation_bytes(sap, batch)
    caches = [16 * 64, 16 * 1024, 16 * 512]
    saved = sum(4 * n - math.ceil(n / 8) - 4 * keep_count(n, 0.1) for n in caches)
    assert m_dense - m_sap == saved
    # and against the standard model with BatchNorm (FedTiny's): under a fifth of its cache
    bn = build_model("tinycnn", (1, 8, 8), 10, batch_norm=True)
    assert m_sap < 0.2 * measure_activation_bytes(bn, batch)


# -- sparse fan-in initialisation -------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(64, 128), (32, 16, 3, 3)])
def test_fan_in_scaled_init_restores_each_units_dense_variance(shape: tuple[int, ...]) -> None:
    """Each output unit's kept weights are scaled by √(fan_in / kept): zero off the mask, a unit's
    squared norm is its masked norm × fan_in / kept, a unit with no kept input stays zero, and over
    a layer the variance of the unit pre-activations is back near the dense init's."""
    rng = np.random.default_rng(0)
    w = rng.normal(0.0, 1.0 / math.sqrt(math.prod(shape[1:])), size=shape).astype(np.float32)
    mask = rng.random(shape) < 0.1
    mask[0] = False  # a unit with no input left
    out = fan_in_scaled(w, mask)
    assert out.dtype == np.float32 and out.shape == shape
    assert not out[~mask].any() and not out[0].any()
    fan_in = math.prod(shape[1:])
    flat_w, flat_m, flat_o = (a.reshape(shape[0], -1) for a in (w, mask, out))
    for u in range(1, shape[0]):
        kept = int(flat_m[u].sum())
        if kept:
            want = float(np.sum((flat_w[u] * flat_m[u]) ** 2)) * fan_in / kept
            assert float(np.sum(flat_o[u] ** 2)) == pytest.approx(want, rel=1e-5)
    x = rng.normal(size=(4096, fan_in)).astype(np.float32)
    dense_var = float(np.var(x @ flat_w[1:].T))
    assert float(np.var(x @ (flat_w[1:] * flat_m[1:]).T)) < 0.2 * dense_var  # the problem
    assert float(np.var(x @ flat_o[1:].T)) == pytest.approx(dense_var, rel=0.25)  # the fix
