"""EmbracingFL: cut-safe blocks, the paper's capacities, per-layer aggregation, the multi-step forward,
budget-sized cuts and their memory accounting, and an end-to-end in-process run.

The deterministic checks are spec §8 "Deterministic unit checks" 1–4; the aggregation tests must fail
for the whole-model average (spec §9 item 2), which is kept as an option and checked to differ.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.orchestrator import run_inproc
from shared import codec
from shared.algorithms.base import DeviceContext, DeviceData, Partial, UpdateSpec
from shared.algorithms.embracingfl import EmbracingFL, multi_step_forward
from shared.config import load_config
from shared.devices import admit, embracingfl_capacity, measure_activation_bytes, training_footprint
from shared.experiment import Experiment
from shared.models import build_model
from shared.models.partial_training import LayerSplit
from shared.results import read_rounds
from shared.schemas import DeviceInfo
from tests.conftest import reduce_two_ways, write_config

#: the spec's §8 model: MLP 64-64-64-64-10 (4 weight layers = 4 blocks)
SPEC_MLP = {"name": "mlp", "options": {"hidden": [64, 64, 64]}, "init": "he_normal"}
TRAIN = {"local_epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
TIER = {"uplink_bps": 5e6, "downlink_bps": 20e6, "latency_s": 0.015, "flops_per_s": 2e9}


def _efl(tmp_path: Path, name: str = "c.yaml", **overrides: Any) -> EmbracingFL:
    opts = {"name": "embracingfl", "options": overrides.pop("options", {})}
    overrides.setdefault("model", SPEC_MLP)
    overrides.setdefault("train", TRAIN)
    cfg = write_config(tmp_path / name, algorithm=opts, **overrides)
    strategy = Experiment.build(load_config(cfg)).strategy
    assert isinstance(strategy, EmbracingFL)
    return strategy


def _device(tmp_path: Path, dev: int, n: int = 50) -> DeviceContext:
    rng = np.random.default_rng(dev)
    x = rng.random((n, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, n)
    return DeviceContext(dev, 1, DeviceData(x, y, x[:0], y[:0]), tmp_path / f"d{dev}", seed=dev + 7)


def _update(s: EmbracingFL, cut: int, seed: int, n: int = 10) -> UpdateSpec:
    rng = np.random.default_rng(seed)
    shapes = s._expected_shapes
    return UpdateSpec(
        {k: codec.Dense(rng.normal(size=shapes[k]).astype(np.float32)) for k in s.split.suffix_state(cut)}, n
    )


# -- blocks and the paper's capacities (spec §8 unit check 1) -----------------------------------------
def test_blocks_are_cut_safe_units() -> None:
    mlp = LayerSplit(build_model("mlp", (1, 8, 8), 10, hidden=[64, 64, 64]), (1, 8, 8))
    assert [b.atoms for b in mlp.blocks] == [
        ("flatten", "fc1", "relu1"),
        ("fc2", "relu2"),
        ("fc3", "relu3"),
        ("fc4",),
    ]
    assert mlp.suffix_state(3) == ["fc3.weight", "fc3.bias", "fc4.weight", "fc4.bias"]
    assert mlp.cut_of(["fc4.bias", "fc4.weight"]) == 4
    assert mlp.cut_of(["fc2.weight", "fc4.weight", "fc4.bias"]) is None  # not a suffix
    cnn = LayerSplit(build_model("cnn_digits", (1, 8, 8), 10), (1, 8, 8))
    # BN (and its running statistics) stays with its conv; GAP + flatten with the last conv
    assert cnn.blocks[0].float_state == (
        "conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
    )  # fmt: skip
    assert cnn.blocks[2].atoms[-2:] == ("pool", "flatten") and cnn.cut_numel(4) == 64
    res = LayerSplit(build_model("resnet20", (3, 32, 32), 10), (3, 32, 32))
    # stem, nine residual blocks (atomic: a cut inside one would break its skip connection), classifier
    assert res.num_blocks == 11 and res.blocks[1].atoms == ("layer1.0",) and res.blocks[-1].atoms == ("fc",)


@pytest.mark.parametrize(
    ("model", "shape", "classes", "cuts", "per_sample", "expected"),
    [
        # ResNet-20: moderate freezes the stem + 3 residual blocks, weak the stem + 6 (Table 1)
        ("resnet20", (3, 32, 32), 10, (5, 8), False, (0.42, 0.16)),
        # FEMNIST CNN: moderate freezes both convs, weak also dense-2048; counted per sample (§9 item 8)
        ("cnn", (1, 28, 28), 62, (3, 4), True, (0.99, 0.02)),
    ],
)
def test_cuts_reproduce_table1_capacities(
    model: str, shape: tuple[int, ...], classes: int, cuts: tuple[int, int], per_sample: bool, expected: Any
) -> None:
    net = build_model(model, shape, classes)
    split = LayerSplit(net, shape)
    caps = [
        embracingfl_capacity(net, shape, trainable=split.suffix_params(c), per_sample=per_sample)
        for c in cuts
    ]
    assert [round(c, 2) for c in caps] == list(expected)


def test_spec_mlp_cuts_and_capacities(tmp_path: Path) -> None:
    """Spec §8: for the MLP, moderate trains the last 3 layers (capacity 0.68), weak the last 2 (0.37)."""
    s = _efl(tmp_path, options={"client_types": "tier", "moderate_blocks": 3, "weak_blocks": 2})
    assert s.type_cuts == {"strong": 1, "moderate": 2, "weak": 3}
    assert round(s.paper_capacity(2), 2) == 0.68 and round(s.paper_capacity(3), 2) == 0.37
    # without explicit blocks, the deepest cut within the capacity: 0.40 -> last 2 layers, 0.15 -> last 1
    d = _efl(tmp_path, "d.yaml", options={"client_types": "tier"})
    assert d.type_cuts == {"strong": 1, "moderate": 3, "weak": 4}


# -- aggregation (spec §2.5, §8 unit check 2) ----------------------------------------------------------
def test_prefix_over_strong_only_suffix_over_all(tmp_path: Path) -> None:
    s = _efl(tmp_path)
    state = s.init_state()
    strong = [_update(s, 1, i) for i in range(2)]
    weak = [_update(s, 3, 10 + i) for i in range(3)]
    p = Partial()
    for u in [*strong, *weak]:
        p = s.reduce(p, u)
    new = s.finalize(state, p, 1).arrays
    for name in ("fc1.weight", "fc2.bias"):  # prefix: trained by the strong devices only
        want = np.mean([u.tensors[name].array for u in strong], axis=0)  # type: ignore[union-attr]
        np.testing.assert_allclose(new[name], want, rtol=1e-5, atol=1e-7)
    for name in ("fc3.weight", "fc4.bias"):  # suffix: all five, uniform weights despite unequal n
        want = np.mean([u.tensors[name].array for u in [*strong, *weak]], axis=0)  # type: ignore[union-attr]
        np.testing.assert_allclose(new[name], want, rtol=1e-5, atol=1e-7)
    # a round without a strong device leaves the prefix exactly as it was (no division by zero)
    only_weak = Partial()
    for u in weak:
        only_weak = s.reduce(only_weak, u)
    kept = s.finalize(state, only_weak, 2).arrays
    np.testing.assert_array_equal(kept["fc1.weight"], state.arrays["fc1.weight"])
    np.testing.assert_array_equal(kept["fc2.bias"], state.arrays["fc2.bias"])
    assert not np.array_equal(kept["fc3.weight"], state.arrays["fc3.weight"])


def test_whole_model_average_differs_in_the_prefix_whenever_weak_devices_are_active(tmp_path: Path) -> None:
    """Spec §8 (calibration variant) / §9 item 2: averaging weak devices' unchanged prefix copies shrinks
    the strong devices' prefix update by s/|A_t|; the suffix is the same under both rules."""
    per_layer = _efl(tmp_path)
    whole = _efl(tmp_path, "w.yaml", options={"aggregation": "whole_model"})
    state = per_layer.init_state()
    ups = [_update(per_layer, 1, 0), _update(per_layer, 3, 1), _update(per_layer, 3, 2)]
    a, b = Partial(), Partial()
    for u in ups:
        a, b = per_layer.reduce(a, u), whole.reduce(b, u)
    pa, pb = per_layer.finalize(state, a, 1).arrays, whole.finalize(state, b, 1).arrays
    old, strong_w = state.arrays["fc1.weight"], ups[0].tensors["fc1.weight"].array  # type: ignore[union-attr]
    np.testing.assert_allclose(pa["fc1.weight"], strong_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(pb["fc1.weight"], old + (strong_w - old) / 3, rtol=1e-5, atol=1e-7)
    assert not np.allclose(pa["fc1.weight"], pb["fc1.weight"])
    np.testing.assert_allclose(pa["fc4.weight"], pb["fc4.weight"], rtol=1e-5, atol=1e-7)
    # with strong devices only the two rules agree
    c, d = Partial(), Partial()
    for u in (_update(per_layer, 1, 5), _update(per_layer, 1, 6)):
        c, d = per_layer.reduce(c, u), whole.reduce(d, u)
    np.testing.assert_allclose(
        per_layer.finalize(state, c, 1).arrays["fc1.weight"], whole.finalize(state, d, 1).arrays["fc1.weight"]
    )


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=7), st.randoms(use_true_random=False), st.booleans())
def test_reduction_is_associative_and_commutative(cuts: list[int], rnd: Any, whole: bool) -> None:
    """Any split of a round's updates over two aggregators, in any order, gives the same next model."""
    opts = {"aggregation": "whole_model" if whole else "per_layer", "weighting": "samples"}
    s = _efl(Path("/tmp"), "fedfleet-efl-prop.yaml", options=opts)
    ups = [_update(s, c, i, n=3 + i) for i, c in enumerate(cuts)]
    one, merged = reduce_two_ways(s, ups, rnd)
    state = s.init_state()
    f1, f2 = s.finalize(state, one, 1).arrays, s.finalize(state, merged, 1).arrays
    for k in f1:
        np.testing.assert_allclose(f1[k], f2[k], rtol=1e-6, atol=1e-7)


def test_validation_accepts_suffixes_only(tmp_path: Path) -> None:
    s = _efl(tmp_path)
    s.validate_update(_update(s, 3, 0))
    bad = _update(s, 2, 0)
    del bad.tensors["fc3.bias"]
    with pytest.raises(codec.CodecError, match="suffix"):
        s.validate_update(bad)
    nan = _update(s, 4, 0)
    nan.tensors["fc4.bias"].array[0] = np.nan  # type: ignore[union-attr]
    with pytest.raises(codec.CodecError, match="non-finite"):
        s.validate_update(nan)


# -- the client half: multi-step forward, frozen prefix, uplink/downlink (§8 unit checks 3, 4) -------
def test_weak_client_prefix_gets_no_gradient_and_caches_prefix_features(tmp_path: Path) -> None:
    s = _efl(tmp_path, options={"client_types": "tier", "moderate_blocks": 3, "weak_blocks": 2})
    fleet = {0: DeviceInfo(device_id=0, tier="weak", num_samples=50)}
    state = s.init_state()
    task = s.plan(state, 0, [0], fleet)[0]
    assert task.config["cut"] == 3 and task.config["chunks"] == [[1, 1], [2, 2]]  # weak: 2 prefix chunks
    # downlink: the full model (its bytes unchanged), in 2 prefix chunks + the suffix = 3 messages
    assert set(task.tensors) == {k for k, v in state.arrays.items() if v.dtype.kind == "f"}
    built: list[torch.nn.Module] = []
    factory = s.ctx.model_factory

    def recording() -> torch.nn.Module:
        built.append(factory())
        return built[-1]

    s.ctx.model_factory = recording
    device = _device(tmp_path, 0)
    update = s.train(task, device)
    model = built[0]  # the model train() built (later ones are accounting probes)
    for name, p in model.named_parameters():
        if name.startswith(("fc1.", "fc2.")):
            assert p.grad is None and not p.requires_grad
            np.testing.assert_array_equal(p.detach().numpy(), state.arrays[name])
        else:
            assert p.grad is not None
    # uplink: only the suffix, 4 bytes per parameter (spec §8 unit check 3)
    assert set(update.tensors) == {"fc3.weight", "fc3.bias", "fc4.weight", "fc4.bias"}
    p_c = sum(model.get_parameter(k).numel() for k in update.tensors)
    assert update.metrics["paper_bytes_up"] == 4 * p_c and update.metrics["down_messages"] == 3
    assert s.task_download_messages(task) == 3  # the link emulation charges 3 latencies
    # the cached features are exactly prefix(x_t) on the device's data, chunked or not
    fresh = factory()
    for name, t in task.tensors.items():
        fresh.state_dict()[name].copy_(torch.from_numpy(np.asarray(t.array)))  # type: ignore[union-attr]
    x = torch.from_numpy(device.data.x_train)
    chunked = multi_step_forward(s.split, fresh, x, [(1, 1), (2, 2)], batch_size=7)
    with torch.no_grad():
        whole = s.split.chain(fresh, 1, 2).eval()(x)
    torch.testing.assert_close(chunked, whole)
    assert update.metrics["cache_bytes"] == 50 * 64 * 4


def test_local_steps_and_strong_devices_train_everything(tmp_path: Path) -> None:
    s = _efl(tmp_path, options={"client_types": "tier"}, train={**TRAIN, "local_steps": 4})
    task = s.plan(s.init_state(), 0, [0], {})[0]  # no fleet: tier "default" -> strong
    assert task.config["cut"] == 1 and task.config["chunks"] == []
    update = s.train(task, _device(tmp_path, 0))
    assert update.metrics["steps"] == 4 and set(update.tensors) == set(s._expected_shapes)


def test_mix_assigns_exact_shares_by_a_seeded_permutation(tmp_path: Path) -> None:
    opts = {"client_types": "mix", "strong_fraction": 0.25, "moderate_fraction": 0.25, "weak_fraction": 0.5}
    s = _efl(tmp_path, options=opts)
    fleet = {d: DeviceInfo(device_id=d, num_samples=5) for d in range(32)}
    kinds = [s.assign(d, [], fleet)[2] for d in range(32)]
    assert (kinds.count("strong"), kinds.count("moderate"), kinds.count("weak")) == (8, 8, 16)
    assert kinds == [
        _efl(tmp_path, "again.yaml", options=opts).assign(d, list(range(32)), {})[2] for d in range(32)
    ]
    assert kinds != sorted(kinds)  # permuted, not blocks


# -- budgets, cuts and the memory accounting -------------------------------------------------------------
def test_budget_picks_the_most_layers_that_fit_and_admission_agrees(tmp_path: Path) -> None:
    s = _efl(tmp_path)
    full = training_footprint(s.ctx.model_factory(), s.ctx.input_shape, 32, optimizer="sgd_momentum").total
    L = s.split.num_blocks
    for fraction in (1.0, 0.7, 0.4, 0.1):
        budget = int(fraction * full)
        fleet = {0: DeviceInfo(device_id=0, tier="x", num_samples=40, profile={"memory_bytes": budget})}
        task = s.plan(s.init_state(), 0, [0], fleet)[0]
        cut, chunks = task.config["cut"], [tuple(c) for c in task.config["chunks"]]
        fits = admit(s.task_footprint(task), budget).admitted
        if fraction == 1.0:
            assert cut == 1 and fits  # fraction 1 admits exactly the full task
        if fits and cut > 1:  # one more trainable block would not fit
            more = s.split.chunks(cut - 1, budget, 32)
            assert s.footprint(cut - 1, more).total > budget
        if fraction == 0.1:
            assert cut == L and not fits  # not even the head fits: admission refuses, it cannot take part
        assert all(s.split.forward_peak_bytes(a, b, 32) <= budget for a, b in chunks if a < b)
    assert [_cut(s, f, full) for f in (1.0, 0.7, 0.4)] == [1, 2, 3]


def _cut(s: EmbracingFL, fraction: float, full: int) -> int:
    return s._budget_cut(int(fraction * full))[0]


def test_footprint_matches_a_measurement_of_the_suffix_on_cached_activations(tmp_path: Path) -> None:
    """The training phase counts what the multi-step forward really holds: the suffix's parameters,
    gradients, momentum and the activations autograd saves when the suffix runs on cached features —
    measured here on the suffix alone — and far less than the framework's default accountant, which
    keeps every parameter resident."""
    s = _efl(tmp_path, model={"name": "cnn_digits", "options": {}}, options={"client_types": "tier"})
    model = s.ctx.model_factory()
    for cut in (2, 3):
        fp = s.footprint(cut, [(1, cut - 1)])
        suffix = s.split.chain(model, cut, s.split.num_blocks)
        cached = torch.zeros((32, s.split.cut_numel(cut)))
        shape = {2: (16, 8, 8), 3: (32, 4, 4)}[cut]
        acts = measure_activation_bytes(suffix, cached.view(32, *shape))
        params = sum(model.get_parameter(p).numel() for p in s.split.suffix_params(cut)) * 4
        assert fp.grads_bytes == fp.optimizer_bytes == params
        assert fp.params_bytes == s.split.suffix_resident_bytes(cut)
        assert fp.activations_bytes == acts
        # the forward phase's excess over training is its own term, and the peak is the larger phase
        forward = s.split.forward_peak_bytes(1, cut - 1, 32)
        assert fp.other_bytes == max(0, forward - (fp.params_bytes + 2 * params + acts))
        assert fp.total == max(fp.params_bytes + 2 * params + acts, forward)
        default = training_footprint(
            model,
            s.ctx.input_shape,
            32,
            optimizer="sgd_momentum",
            trainable_params=s.split.suffix_params(cut),
        )
        assert fp.total < default.total
    # the cached activations count only when asked (the paper keeps them on disk)
    on = _efl(
        tmp_path, "m.yaml", model={"name": "cnn_digits", "options": {}}, options={"cache_in_memory": True}
    )
    assert on.footprint(3, [(1, 2)], 100).total - s.footprint(3, [(1, 2)]).total == 100 * 512 * 4


def test_flops_count_one_prefix_forward_and_suffix_training(tmp_path: Path) -> None:
    s = _efl(tmp_path)
    fwd = [2 * 64 * 64] * 3 + [2 * 64 * 10]  # per-sample forward FLOPs of fc1..fc4
    prefix, suffix = s._flops_per_sample(3)
    assert prefix == fwd[0] + fwd[1]
    assert suffix == 2 * fwd[2] + 3 * fwd[3]  # fc3: forward + weight grad; fc4: + input grad
    assert s._round_flops(3, 100, 10) == 100 * prefix + 10 * 32 * suffix


# -- end to end through the in-process services ------------------------------------------------------------
def _run(tmp_path: Path, name: str, **algo: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tiers = {
        "strong": {"count": 3, "memory_fraction": 1.0, **TIER},
        "moderate": {"count": 3, "memory_fraction": 0.70, **TIER},
        "weak": {"count": 6, "memory_fraction": 0.40, **TIER},
    }
    cfg = load_config(
        write_config(
            tmp_path / f"{name}.yaml",
            seed=2,
            rounds=8,
            num_devices=12,
            devices_per_round=12,
            quorum_fraction=0.1,
            dataset={"name": "digits", "partition": "dirichlet", "alpha": 0.5, "train_limit": 900},
            model=SPEC_MLP,
            algorithm={"name": "embracingfl", "options": algo},
            train={**TRAIN, "lr": 0.05},
            fleet={"tiers": tiers},
        )
    )
    run = tmp_path / name
    run.mkdir()
    assert run_inproc(cfg, run, f"{name}-{uuid.uuid4().hex[:6]}") == 0
    return read_rounds(run), json.loads((run / "summary.json").read_text())


def test_end_to_end_weak_devices_train_suffixes_instead_of_being_refused(tmp_path: Path) -> None:
    rows, summary = _run(tmp_path, "efl")
    tiers = summary["tiers"]
    assert all(tiers[t]["rejected"] == 0 and tiers[t]["completed"] == 8 * tiers[t]["devices"] for t in tiers)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    # 3 strong (cut 1) + 3 moderate (cut 2) + 6 weak (cut 3) per round
    assert rows[0]["m_cut"] == pytest.approx((3 * 1 + 3 * 2 + 6 * 3) / 12, rel=0.2)  # sample-weighted mean
    per_dev_up = {t: tiers[t]["bytes_up"] / tiers[t]["completed"] for t in tiers}
    per_dev_down = {t: tiers[t]["bytes_down"] / tiers[t]["selected"] for t in tiers}
    assert per_dev_up["weak"] < per_dev_up["moderate"] < per_dev_up["strong"]
    assert per_dev_down["weak"] == pytest.approx(per_dev_down["strong"], rel=0.02)  # full model down
    # "FedAvg dropping weak clients": the same fleet with partial training off — admission refuses them
    _, dropped = _run(tmp_path, "drop", partial_training=False)
    assert dropped["tiers"]["weak"]["completed"] == 0 and dropped["tiers"]["weak"]["rejected"] == 48
    assert dropped["tiers"]["moderate"]["completed"] == 0
