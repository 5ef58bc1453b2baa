"""Hermes: overlap (holder-mean) aggregation, structured monotone masks, compaction, shrinking uploads,
and the Standalone baseline.

The aggregation test is the spec's §8.3 item 5 (Fig. 5 of the paper) and must *fail* for masked
FedAvg that divides by the number of participants; the byte test reads the Prometheus counters of a
real in-process run, round by round.
"""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from services.orchestrator import InprocCluster
from shared import codec
from shared.algorithms.base import (
    DeviceContext,
    DeviceData,
    Partial,
    ServerState,
    UpdateSpec,
    derive_seed,
    model_arrays,
)
from shared.algorithms.hermes import Hermes, read_device_logs
from shared.algorithms.training import local_sgd
from shared.config import load_config
from shared.devices import forward_flops
from shared.experiment import Experiment
from shared.models import build_model, num_parameters
from shared.models.hermes_layers import UnitStructure, structured_prune
from tests.conftest import reduce_two_ways, write_config


def _hermes(tmp_path: Path, name: str = "c.yaml", **overrides: Any) -> Hermes:
    opts = {"name": "hermes", "options": overrides.pop("options", {})}
    cfg = write_config(tmp_path / name, algorithm=opts, **overrides)
    strategy = Experiment.build(load_config(cfg)).strategy
    assert isinstance(strategy, Hermes)
    return strategy


def _update(
    h: Hermes, arrays: dict[str, np.ndarray], keep: dict[str, np.ndarray], dev: int, n: int = 10
) -> UpdateSpec:
    return UpdateSpec(h.structure.payload(arrays, keep), n, device_id=dev)


def _random_arrays(h: Hermes, seed: int, keep: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Random weights with exact zeros outside ``keep`` (what a masked device trains)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in h.structure.shapes.items():
        out[name] = (rng.normal(size=shape) * h.structure.tensor_mask(name, keep)).astype(np.float32)
    return out


# -- §8.3 item 5: Fig. 5 -------------------------------------------------------------------------------
def _fig5_check(h: Hermes) -> None:
    """Hidden layer of 4 units, two devices. Unit 0 kept by both (→ mean), unit 1 only by j (→ j's
    value), unit 2 only by i (→ i's value, "not changed"), unit 3 by nobody (→ old W^T)."""
    old = {k: np.full(v, 7.0, dtype=np.float32) for k, v in h.structure.shapes.items()}
    state = ServerState(dict(old))
    keep_i = {"fc1": np.array([True, False, True, False])}
    keep_j = {"fc1": np.array([True, True, False, False])}
    w_i, w_j = _random_arrays(h, 1, keep_i), _random_arrays(h, 2, keep_j)
    # two aggregators, one update each, merged by the server (the reduction must not care)
    left = h.reduce(Partial(), _update(h, w_i, keep_i, dev=0, n=10))
    right = h.reduce(Partial(), _update(h, w_j, keep_j, dev=1, n=30))
    new = h.finalize(state, h.merge(right, left), round=1).arrays
    w1, b1, w2, b2 = new["fc1.weight"], new["fc1.bias"], new["fc2.weight"], new["fc2.bias"]
    np.testing.assert_allclose(w1[0], (w_i["fc1.weight"][0] + w_j["fc1.weight"][0]) / 2, rtol=1e-6)
    np.testing.assert_allclose(b1[0], (w_i["fc1.bias"][0] + w_j["fc1.bias"][0]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(w1[1], w_j["fc1.weight"][1])
    np.testing.assert_array_equal(w1[2], w_i["fc1.weight"][2])
    np.testing.assert_array_equal(w1[3], old["fc1.weight"][3])
    np.testing.assert_array_equal(b1[3], old["fc1.bias"][3])
    # the classifier's input columns follow the same rule; its rows/bias are held by both
    np.testing.assert_allclose(w2[:, 0], (w_i["fc2.weight"][:, 0] + w_j["fc2.weight"][:, 0]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(w2[:, 1], w_j["fc2.weight"][:, 1])
    np.testing.assert_array_equal(w2[:, 2], w_i["fc2.weight"][:, 2])
    np.testing.assert_array_equal(w2[:, 3], old["fc2.weight"][:, 3])
    np.testing.assert_allclose(b2, (w_i["fc2.bias"] + w_j["fc2.bias"]) / 2, rtol=1e-6)
    # and the server now knows both masks
    np.testing.assert_array_equal(new["mask/0/fc1"], keep_i["fc1"].astype(np.uint8))
    np.testing.assert_array_equal(new["mask/1/fc1"], keep_j["fc1"].astype(np.uint8))


def test_fig5_holder_mean_aggregation(tmp_path: Path) -> None:
    _fig5_check(_hermes(tmp_path, model={"name": "mlp", "options": {"hidden": [4]}}))


def test_masked_fedavg_dividing_by_participants_fails_fig5(tmp_path: Path) -> None:
    masked = _hermes(
        tmp_path, model={"name": "mlp", "options": {"hidden": [4]}}, options={"aggregation": "masked_fedavg"}
    )
    with pytest.raises(AssertionError):
        _fig5_check(masked)
    # and precisely because it dilutes: unit 2 (held by i only) comes out as half of i's value
    keep_i = {"fc1": np.array([True, False, True, False])}
    keep_j = {"fc1": np.array([True, True, False, False])}
    w_i = _random_arrays(masked, 1, keep_i)
    p = masked.reduce(Partial(), _update(masked, w_i, keep_i, 0))
    p = masked.reduce(p, _update(masked, _random_arrays(masked, 2, keep_j), keep_j, 1))
    state = ServerState({k: np.zeros(v, np.float32) for k, v in masked.structure.shapes.items()})
    out = masked.finalize(state, p, 1).arrays["fc1.weight"]
    np.testing.assert_allclose(out[2], w_i["fc1.weight"][2] / 2, rtol=1e-6)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6), st.randoms(use_true_random=False))
def test_reduction_is_associative_and_commutative(seed: int, n: int, rnd: Any) -> None:
    h = _hermes(
        Path("/tmp"), name="fedfleet-hermes-prop.yaml", model={"name": "mlp", "options": {"hidden": [6, 5]}}
    )
    rng = np.random.default_rng(seed)
    updates = []
    for dev in range(n):
        keep = {k: rng.random(v.shape) < 0.6 for k, v in h.structure.full_keep().items()}
        for v in keep.values():
            v[rng.integers(len(v))] = True
        updates.append(_update(h, _random_arrays(h, seed + dev, keep), keep, dev, int(rng.integers(1, 50))))
    one, merged = reduce_two_ways(h, updates, rnd)
    assert set(one.arrays) == set(merged.arrays)
    state = h.init_state()
    f1, f2 = h.finalize(state, one, 1).arrays, h.finalize(state, merged, 1).arrays
    for k in f1:
        np.testing.assert_allclose(f1[k], f2[k], rtol=1e-6, atol=1e-7)


# -- masks: monotone, structured; uploads: structured and zero outside --------------------------------
def _independent_mask(h: Hermes, tensor: str, keep: dict[str, np.ndarray]) -> np.ndarray:
    """The expected mask built by hand (not by UnitStructure): out-keep ⊗ in-keep (⊗ kernel ones)."""
    shape = h.structure.shapes[tensor]
    module = tensor.rsplit(".", 1)[0]
    names = list(h.structure.layers)
    out = keep.get(module, np.ones(shape[0], bool)) if module in names else None
    if module not in names:  # BatchNorm: owned by the weight layer right before it
        owner = h.structure.owner[module]
        out = keep.get(owner, np.ones(shape[0], bool))
    assert out is not None
    if len(shape) == 1:
        return out.copy()
    i = names.index(module)
    if i == 0:
        inp = np.ones(shape[1], bool)
    else:
        prev = keep[names[i - 1]]
        inp = np.repeat(prev, shape[1] // len(prev))  # channel-major flatten: each unit feeds a block
    mask = np.outer(out, inp)
    return np.broadcast_to(mask.reshape(*mask.shape, *([1] * (len(shape) - 2))), shape).copy()


def _device(tmp_path: Path, dev: int, rnd: int, n: int = 60) -> DeviceContext:
    rng = np.random.default_rng(dev)
    x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    y = (np.arange(n) % 2 + 2 * dev) % 10
    return DeviceContext(
        dev, rnd, DeviceData(x, y, x[:20], y[:20]), tmp_path / f"device-{dev}", seed=rnd * 100 + dev
    )


@pytest.mark.parametrize(
    "model", [{"name": "mlp", "options": {"hidden": [64, 32]}}, {"name": "cnn_digits_pool", "options": {}}]
)
def test_masks_are_monotone_structured_and_uploads_zero_outside(
    tmp_path: Path, model: dict[str, Any]
) -> None:
    h = _hermes(
        tmp_path,
        model=model,
        options={"acc_threshold": -1.0},
        train={"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
    )
    state = h.init_state()
    history: list[dict[str, np.ndarray]] = [h.structure.full_keep()]
    densities = [1.0]
    for rnd in range(1, 9):
        task = h.plan(state, rnd, [0], {})[0]
        update = h.train(task, _device(tmp_path, 0, rnd))
        update.device_id = 0  # what the aggregator sets from the envelope
        h.validate_update(update)
        keep = h.structure.keep_from_payload(update.tensors)
        for name, t in update.tensors.items():
            expected = _independent_mask(h, name, keep)
            got = np.ones(expected.shape, bool) if isinstance(t, codec.Dense) else t.mask()  # type: ignore[union-attr]
            np.testing.assert_array_equal(got, expected, err_msg=name)
            dense = t.array if isinstance(t, codec.Dense) else t.to_dense()  # type: ignore[union-attr]
            assert not np.any(dense[~expected]), f"{name}: pruned coordinates must be exactly 0"
        prev = history[-1]
        for layer, v in keep.items():
            assert not np.any(v & ~prev[layer]), f"round {rnd}: {layer} regrew a pruned unit"
        history.append(keep)
        densities.append(update.metrics["density"])
        state = h.finalize(state, h.reduce(Partial(), update), rnd)
        assert all(np.array_equal(state.arrays[f"mask/0/{k}"], v.astype(np.uint8)) for k, v in keep.items())
    assert all(b <= a for a, b in itertools.pairwise(densities))
    assert densities[1] <= 0.8 < densities[0]  # first event: one r_p step
    if model["name"] == "mlp":  # fine-grained enough to land in the spec's clamp window
        assert 0.3 - 0.03 <= densities[-1] <= 0.3
        assert sum(b < a for a, b in itertools.pairwise(densities)) >= 6


def test_structured_prune_hits_the_target_with_per_layer_fractions() -> None:
    model = build_model("mlp", (1, 8, 8), 10, hidden=[64, 32], seed=0)
    s = UnitStructure(model, (1, 8, 8))
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    keep = s.full_keep()
    for target in (0.8, 0.64, 0.512, 0.3):
        new = structured_prune(s, arrays, keep, target)
        assert s.density(new) <= target
        # minimal: keeping one more unit per layer would exceed the target
        assert all(not np.any(v & ~keep[k]) for k, v in new.items())
        keep = new
    # the lowest-norm alive rows went first in every layer
    w = arrays["fc1.weight"]
    norms = np.linalg.norm(w, axis=1)
    assert norms[~keep["fc1"]].max() <= norms[keep["fc1"]].min()


# -- compaction: size = density × dense, same function, FLOPs scale --------------------------------------
@pytest.mark.parametrize(
    ("name", "options"),
    [("mlp", {"hidden": [64, 32]}), ("cnn_digits_pool", {}), ("tinycnn", {"batch_norm": True})],
)
def test_compacted_model_is_smaller_by_exactly_the_density(name: str, options: dict[str, Any]) -> None:
    model = build_model(name, (1, 8, 8), 10, seed=3, **options)
    s = UnitStructure(model, (1, 8, 8))
    # give BN non-trivial running statistics so the check covers them
    model.train()
    with torch.no_grad():
        model(torch.randn(32, 1, 8, 8))
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    keep = structured_prune(s, arrays, s.full_keep(), 0.3)
    masked = build_model(name, (1, 8, 8), 10, **options)
    masked.load_state_dict(
        {
            k: torch.from_numpy(arrays[k] * s.tensor_mask(k, keep))
            if k in s.shapes
            else torch.as_tensor(arrays[k])
            for k in arrays
        }
    )
    assert isinstance(masked, torch.nn.Sequential)
    small = s.compact(masked, keep)
    dense_params, small_params = num_parameters(model), num_parameters(small)
    assert small_params == s.kept_params(keep)
    assert small_params == pytest.approx(s.density(keep) * dense_params, abs=1e-6)
    assert s.density(keep) <= 0.3
    x = torch.randn(16, 1, 8, 8)
    masked.eval()
    small.eval()
    with torch.no_grad():
        torch.testing.assert_close(small(x), masked(x), rtol=1e-5, atol=1e-5)
    f_dense, f_small = forward_flops(model, (1, 8, 8)), forward_flops(small, (1, 8, 8))
    assert f_small == s.flops(keep)
    assert f_dense == s.flops(s.full_keep())
    weights = [f"{n}.weight" for n in s.layers]
    kept_w = sum(math.prod(s.kept_shape(w, keep)) for w in weights)
    all_w = sum(math.prod(s.shapes[w]) for w in weights)
    if name == "mlp":  # every weight meets one position: FLOPs ratio = kept-weight fraction ≈ density
        assert f_small / f_dense == pytest.approx(kept_w / all_w)
        assert f_small / f_dense == pytest.approx(s.density(keep), abs=0.02)
    else:
        assert f_small < 0.6 * f_dense


def test_unstructured_or_classifier_pruning_uploads_are_rejected(tmp_path: Path) -> None:
    h = _hermes(tmp_path, model={"name": "mlp", "options": {"hidden": [8]}})
    keep = {"fc1": np.array([True] * 6 + [False] * 2)}
    good = _update(h, _random_arrays(h, 0, keep), keep, dev=3)
    h.validate_update(good)
    # one extra coordinate removed inside a kept row: no longer an outer product
    mask = h.structure.tensor_mask("fc1.weight", keep)
    mask[0, 5] = False
    bad = dict(good.tensors)
    bad["fc1.weight"] = codec.Sparse.from_dense(np.ones(mask.shape, np.float32), mask)
    with pytest.raises(codec.CodecError):
        h.validate_update(UpdateSpec(bad, 10))
    # a classifier row (a class) pruned
    bad = dict(good.tensors)
    w2 = np.ones(h.structure.shapes["fc2.weight"], np.float32)
    bad["fc2.weight"] = codec.Sliced.from_dense(w2, [np.arange(9), np.arange(6)])
    with pytest.raises(codec.CodecError):
        h.validate_update(UpdateSpec(bad, 10))
    with pytest.raises(codec.CodecError):  # no envelope device id: the mask would have no owner
        h.validate_update(UpdateSpec(good.tensors, 10))


def test_downlink_is_full_model_first_then_the_smaller_structured_payload(tmp_path: Path) -> None:
    h = _hermes(tmp_path, model={"name": "mlp", "options": {"hidden": [64, 32]}})
    state = h.init_state()
    first = h.plan(state, 1, [5], {})[5]
    assert all(isinstance(t, codec.Dense) for t in first.tensors.values())
    keep = structured_prune(h.structure, state.arrays, h.structure.full_keep(), 0.5)
    state.arrays.update({f"mask/5/{k}": v.astype(np.uint8) for k, v in keep.items()})
    later = h.plan(state, 2, [5], {})[5]
    for name, t in later.tensors.items():
        assert not isinstance(t, codec.Dense) or h.structure.tensor_mask(name, keep).all()
        if isinstance(t, codec.Sliced | codec.Sparse):
            alt_sl = codec.Sliced.from_dense(state.arrays[name], h.structure.axis_indices(name, keep))
            alt_sp = codec.Sparse.from_dense(state.arrays[name], h.structure.tensor_mask(name, keep))
            sizes = [len(codec.packb(codec.encode(x))) for x in (alt_sl, alt_sp)]
            assert len(codec.packb(codec.encode(t))) == min(sizes)
    got = h.structure.keep_from_payload(later.tensors)
    assert all(np.array_equal(got[k], keep[k]) for k in keep)  # the payload tells the device its mask
    # masks survive the server's .npz checkpoint under their slash-separated names
    np.savez(tmp_path / "ck.npz", **state.arrays)  # type: ignore[arg-type]
    with np.load(tmp_path / "ck.npz", allow_pickle=False) as z:
        assert np.array_equal(z["mask/5/fc1"], keep["fc1"].astype(np.uint8))


# -- per-round upload bytes from the Prometheus counters of a real in-process run ---------------------
def _counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_upload_bytes_per_device_fall_with_the_mask_and_never_rise(tmp_path: Path) -> None:
    exp_id = f"hermes-bytes-{tmp_path.name}"
    cfg = write_config(
        tmp_path / "c.yaml",
        rounds=9,
        num_devices=1,
        devices_per_round=1,
        dataset={"name": "digits", "partition": "iid", "train_limit": 150, "local_test_fraction": 0.3},
        model={"name": "mlp", "options": {"hidden": [64, 32]}},
        algorithm={"name": "hermes", "options": {"acc_threshold": -1.0}},
        train={"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
    )
    exp = Experiment.build(load_config(cfg))
    run = tmp_path / "run"
    run.mkdir()
    cluster = InprocCluster(exp, run, exp_id, aggregators=1, clients=1)
    server = cluster.server
    device_up = {"experiment": exp_id, "algorithm": "hermes", "direction": "up", "tier": "default"}
    hist = {"experiment": exp_id, "algorithm": "hermes", "direction": "up", "tier": "default"}
    per_round: list[float] = []

    def after_round(_: object) -> None:
        # a round just closed (and the next one opened): the client has not yet trained for the new
        # round, so the counter delta is exactly this round's uploads
        # (the device's upload; on the broker the update also carries its telemetry)
        per_round.append(_counter("fedfleet_device_bytes_total", **device_up) - sum(per_round))

    cluster.run(on_round=after_round, max_steps=200_000)
    assert server.stopped and len(per_round) == 9
    rows = list(csv.DictReader((run / "rounds.csv").open()))
    density = [float(r["density"]) for r in rows]
    # the counters agree with the per-round table and with the per-device histogram
    assert per_round == [float(r["bytes_up"]) for r in rows]
    assert _counter("fedfleet_device_round_bytes_sum", **hist) == pytest.approx(sum(per_round))
    assert _counter("fedfleet_device_round_bytes_count", **hist) == 9
    for r in range(1, 9):
        assert per_round[r] <= per_round[r - 1], f"upload rose in round {r + 1}: {per_round}"
        assert (per_round[r] < per_round[r - 1]) == (density[r] < density[r - 1] - 1e-12), (
            per_round,
            density,
        )
    assert sum(b < a for a, b in itertools.pairwise(per_round)) >= 5  # step by step
    assert 0.27 <= density[-1] <= 0.3
    # and the bytes track the kept fraction: the last upload is about density × the first dense one
    dense_up = [float(r["dense_bytes_up"]) for r in rows]
    assert per_round[-1] / dense_up[-1] < 0.36
    down = [float(r["bytes_down"]) for r in rows]
    assert down[0] > 0.99 * dense_up[0] and all(b <= a for a, b in itertools.pairwise(down))
    logs = read_device_logs(run / "device-state")[0]
    assert [int(r["round"]) for r in logs] == list(range(1, 10))
    assert all(0 <= r["eval_accuracy_download"] <= 1 and 0 <= r["eval_accuracy_local"] <= 1 for r in logs)
    assert isinstance(exp.strategy, Hermes)
    compact = exp.strategy.export_compact(run / "device-state" / "device-0")
    assert compact is not None and num_parameters(compact) == round(density[-1] * num_parameters(exp.model()))


# -- the Standalone baseline --------------------------------------------------------------------------------
def test_standalone_trains_locally_sends_no_weights_and_replays_identically(tmp_path: Path) -> None:
    from services.orchestrator import run_inproc

    cfg = load_config(
        write_config(
            tmp_path / "s.yaml",
            rounds=4,
            num_devices=4,
            devices_per_round=4,
            dataset={
                "name": "digits",
                "partition": "classes",
                "classes_per_device": 2,
                "train_limit": 400,
                "local_test_fraction": 0.5,
            },
            algorithm={"name": "standalone", "options": {"max_epochs": 7}},
            train={"local_epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(cfg, run, f"standalone-{tmp_path.name}") == 0
    rows = list(csv.DictReader((run / "rounds.csv").open()))
    # no tensor crosses the wire either way: the messages are metadata (a few hundred bytes each)
    assert all(int(r["dense_bytes_up"]) == 0 and int(r["dense_bytes_down"]) == 0 for r in rows)
    assert all(float(r["bytes_up"]) < 4 * 1000 for r in rows)
    assert float(rows[-1]["accuracy"]) > 0.8  # 2-class devices learn their classes locally
    logs = read_device_logs(run / "device-state")
    assert [r["epochs_done"] for r in logs[0]] == [2, 4, 6, 7]  # the budget caps the total
    # a replayed task (client crash before the update was confirmed) starts from the same earlier
    # state with the same seed, so it reproduces the original update instead of training on top
    exp = Experiment.build(cfg)
    strat = exp.strategy
    seed = derive_seed(cfg.seed, "train", 4, 0) % (2**32)
    ctx = DeviceContext(0, 4, exp.device_data(0), run / "device-state" / "device-0", seed=seed)
    for _ in range(2):
        again = strat.train(strat.plan(strat.init_state(), 4, [0], {})[0], ctx).metrics
        assert again == {k: v for k, v in logs[0][-1].items() if k not in ("round", "device")}


def test_standalone_val_fraction_trains_on_exactly_hermes_training_samples(tmp_path: Path) -> None:
    """With ``val_fraction`` Standalone leaves out the validation split Hermes holds for its gate (the
    same draw), so the two train on the same samples; the model it trains is the one ``local_sgd``
    gives on Hermes' split, and differs from training on all samples."""
    from shared.algorithms.hermes import local_data

    dataset = {"name": "digits", "partition": "classes", "train_limit": 200, "local_test_fraction": 0.3}
    train = {"local_epochs": 1, "batch_size": 8, "lr": 0.05}

    def standalone(name: str, options: dict[str, Any]) -> tuple[Any, Experiment]:
        cfg = load_config(
            write_config(
                tmp_path / f"{name}.yaml",
                num_devices=4,
                devices_per_round=4,
                dataset=dataset,
                algorithm={"name": "standalone", "options": options},
                train=train,
            )
        )
        exp = Experiment.build(cfg)
        return exp.strategy, exp

    held, exp = standalone("held", {"val_fraction": 0.2})
    full, _ = standalone("full", {})
    data = exp.device_data(1)
    split = local_data(data, device_id=1, experiment_seed=exp.cfg.seed, val_fraction=0.2)
    assert len(split.y_val) > 0 and len(split.y_train) + len(split.y_val) == len(data.y_train)
    ups = []
    for name, strat in (("held", held), ("full", full)):
        ctx = DeviceContext(1, 1, data, tmp_path / name / "device-1", seed=5)
        ups.append(strat.train(strat.plan(strat.init_state(), 1, [1], {})[1], ctx))
    assert ups[0].num_samples == len(split.y_train) and ups[1].num_samples == len(data.y_train)
    with np.load(tmp_path / "held" / "device-1" / "standalone-1.npz") as z:
        trained = {k.removeprefix("w/"): z[k] for k in z.files if k.startswith("w/")}
    reference = exp.model()
    local_sgd(reference, split.x_train, split.y_train, exp.cfg.train, 5, epochs=1)
    for k, v in model_arrays(reference).items():
        np.testing.assert_array_equal(trained[k], v)
    assert ups[0].metrics["train_loss"] != ups[1].metrics["train_loss"]


def test_evaluate_device_reports_the_local_and_the_download_time_model(tmp_path: Path) -> None:
    """The all-device evaluation hook: ``W ⊙ M_k`` from ``plan_evaluation`` and the last locally
    trained subnetwork from the device's state; a device that never trained reports the former."""
    h = _hermes(
        tmp_path,
        options={"acc_threshold": -1.0},
        train={"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
    )
    state = h.init_state()
    update = h.train(h.plan(state, 1, [0], {})[0], _device(tmp_path, 0, 1))
    update.device_id = 0
    state = h.finalize(state, h.reduce(Partial(), update), 1)
    tasks = h.plan_evaluation(state, [0, 1], {})
    ev0 = h.evaluate_device(tasks[0], _device(tmp_path, 0, 2))
    assert ev0 is not None
    assert ev0["eval_accuracy"] == ev0["eval_accuracy_local"] == update.metrics["eval_accuracy_local"]
    assert ev0["density"] == update.metrics["density"] < 1.0
    # W_final ⊙ M_0 with one participant = its upload, i.e. the same model as its local one
    assert ev0["eval_accuracy_download"] == pytest.approx(ev0["eval_accuracy_local"])
    ev1 = h.evaluate_device(tasks[1], _device(tmp_path, 1, 2))
    assert ev1 is not None and "eval_accuracy_local" not in ev1
    assert ev1["eval_accuracy"] == ev1["eval_accuracy_download"] and ev1["density"] == 1.0
