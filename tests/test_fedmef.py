"""FedMef, FedTiny and FedDST: aggregation (associative, split over aggregators), the server's mask
update, extrusion, wire payloads, memory admission and end-to-end runs through the in-process runner
(spec fedmef.md §2-3, checks 3, 8 and 9)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.orchestrator import run_inproc
from shared import codec
from shared.algorithms.base import DeviceContext, Partial, Strategy, UpdateSpec, model_arrays
from shared.algorithms.dynamic_pruning import GRAD, MASK, PRE, DynamicPruning
from shared.algorithms.feddst import FedDST
from shared.algorithms.fedmef import FedMef
from shared.algorithms.fedtiny import FedTiny
from shared.config import load_config
from shared.devices import admit
from shared.experiment import Experiment
from shared.models.dynamic_sparse import smallest_active
from tests.conftest import reduce_two_ways, write_config

BN = {"fedtiny": True, "feddst": True, "fedmef": False}


def _config(path: Path, algo: str, options: dict[str, Any] | None = None, **overrides: Any) -> Path:
    base: dict[str, Any] = {
        "model": {"name": "tinycnn", "options": {"batch_norm": BN[algo]}},
        "algorithm": {
            "name": algo,
            "options": {"delta_r": 2, "r_stop": 5, "gamma": 1.4142, **(options or {})},
        },
        "dataset": {"name": "digits", "partition": "iid", "train_limit": 400},
        "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.1},
    }
    if algo != "fedmef":
        base["algorithm"]["options"].pop("gamma")
    base.update(overrides)
    return write_config(path, **base)


def _strategy(tmp_path: Path, algo: str, options: dict[str, Any] | None = None, **kw: Any) -> Any:
    exp = Experiment.build(load_config(_config(tmp_path / f"{algo}.yaml", algo, options, **kw)))
    return exp, exp.strategy


def _ctx(exp: Experiment, dev: int, rnd: int, tmp_path: Path) -> DeviceContext:
    return DeviceContext(dev, rnd, exp.device_data(dev), tmp_path / f"d{dev}", seed=rnd * 100 + dev)


def _random_update(
    s: DynamicPruning, rng: np.random.Generator, adjust: bool, local_masks: bool
) -> UpdateSpec:
    """What a device could send: values on the mask (or, FedDST, a local mask) and top-ξ lists."""
    tensors: dict[str, codec.Tensor] = {}
    for name, shape in s._full_shapes.items():
        if name in s.shapes and local_masks:
            n = math.prod(shape)
            flat = np.zeros(n, bool)
            flat[rng.choice(n, s.nnz[name], replace=False)] = True
            vals = rng.normal(size=shape).astype(np.float32)
            tensors[name] = codec.Sparse.from_dense(vals, flat.reshape(shape))
        elif name in s.shapes:
            tensors[name] = codec.Dense(rng.normal(size=s.nnz[name]).astype(np.float32))
        else:
            tensors[name] = codec.Dense(rng.normal(size=shape).astype(np.float32))
    if adjust and not local_masks:
        for name, shape in s.shapes.items():
            n = math.prod(shape)
            idx = np.sort(rng.choice(n, int(0.3 * s.nnz[name]), replace=False))
            tensors[GRAD + name] = codec.Sparse(shape, idx, rng.normal(size=len(idx)).astype(np.float32))
    return UpdateSpec(tensors, int(rng.integers(5, 80)))


def _sparse(t: codec.Tensor) -> codec.Sparse:
    assert isinstance(t, codec.Sparse)
    return t


def _dense(t: codec.Tensor) -> np.ndarray:
    return _sparse(t).to_dense()


# -- aggregation: associative, commutative, split over aggregators -------------------------------------
@settings(max_examples=6, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 5), st.sampled_from(["fedmef", "feddst"]), st.randoms())
def test_split_over_aggregators_gives_the_same_next_state(seed: int, n: int, algo: str, rnd: Any) -> None:
    tmp = Path(f"/tmp/fedfleet-fedmef-prop-{algo}")
    tmp.mkdir(exist_ok=True)
    _, s = _strategy(tmp, algo)
    rng = np.random.default_rng(seed)
    state = s.init_state()
    round_ = 3  # r = 2: an adjustment round
    updates = [_random_update(s, rng, adjust=True, local_masks=algo == "feddst") for _ in range(n)]
    for u in updates:
        s.validate_update(u)
    one, merged = reduce_two_ways(s, updates, rnd)
    f1 = s.finalize(state, one, round_)
    f2 = s.finalize(state, merged, round_)
    assert set(f1.arrays) == set(f2.arrays)
    for k in f1.arrays:
        np.testing.assert_allclose(f1.arrays[k], f2.arrays[k], rtol=1e-6, atol=1e-7, err_msg=k)
    for name in s.prunable:  # per-layer nnz conserved, and the weights live on the mask only
        m = f1.arrays[MASK + name].astype(bool)
        assert int(m.sum()) == s.nnz[name]
        assert not np.any(f1.arrays[name][~m])


# -- the server's mask update (§2.6, check 8) ---------------------------------------------------------
def test_server_drops_smallest_aggregated_weights_grows_largest_gradients_at_zero(tmp_path: Path) -> None:
    _, s = _strategy(tmp_path, "fedtiny")
    rng = np.random.default_rng(0)
    state = s.init_state()
    ups = [_random_update(s, rng, adjust=True, local_masks=False) for _ in range(3)]
    p = Partial()
    for u in ups:
        p = s.reduce(p, u)
    new = s.finalize(state, p, 3)  # r = 2 is an adjustment round (ΔR = 2)
    xi = s.xi(2)
    w_total = sum(u.num_samples for u in ups)
    for name in s.prunable:
        old_m = state.arrays[MASK + name].astype(bool)
        new_m = new.arrays[MASK + name].astype(bool)
        agg = new.arrays[PRE + name]  # aggregated weights before the update
        grad = np.sum([u.num_samples * _dense(u.tensors[GRAD + name]) for u in ups], axis=0) / w_total
        dropped = np.flatnonzero((old_m & ~new_m).reshape(-1))
        grown = np.flatnonzero((~old_m & new_m).reshape(-1))
        assert len(dropped) == len(grown) == xi[name] > 0
        np.testing.assert_array_equal(dropped, smallest_active(agg, old_m, xi[name]))
        still = np.flatnonzero((~old_m & ~new_m).reshape(-1))
        assert np.abs(grad.reshape(-1)[grown]).min() >= np.abs(grad.reshape(-1)[still]).max()
        assert not np.any(new.arrays[name].reshape(-1)[grown])  # grown weights start at 0
    assert new.meta["adjust_log"][-1]["xi_total"] == sum(xi.values())
    # evaluate fills in the accuracy just before and after the mask update
    exp_x = np.random.default_rng(1).random((40, 1, 8, 8)).astype(np.float32)
    s.evaluate(new, exp_x, np.arange(40) % 10)
    assert {"acc_before", "acc_after"} <= set(new.meta["adjust_log"][-1])
    # a normal round changes no mask
    nxt = s.finalize(new, s.reduce(Partial(), _random_update(s, rng, False, False)), 4)
    for name in s.prunable:
        np.testing.assert_array_equal(nxt.arrays[MASK + name], new.arrays[MASK + name])
    assert not any(k.startswith(PRE) for k in nxt.arrays)


def test_feddst_union_of_local_masks_is_repruned_by_magnitude(tmp_path: Path) -> None:
    _, s = _strategy(tmp_path, "feddst")
    rng = np.random.default_rng(5)
    state = s.init_state()
    ups = [_random_update(s, rng, adjust=True, local_masks=True) for _ in range(3)]
    p = Partial()
    for u in ups:
        p = s.reduce(p, u)
    new = s.finalize(state, p, 3)
    for name in s.prunable:
        tot = np.sum([u.num_samples * _dense(u.tensors[name]) for u in ups], axis=0)
        cnt = np.sum([u.num_samples * _sparse(u.tensors[name]).mask() for u in ups], axis=0)
        mean = np.where(cnt > 0, tot / np.maximum(cnt, 1), 0.0)
        m = new.arrays[MASK + name].astype(bool)
        assert int(m.sum()) == s.nnz[name] and np.all(cnt[m] > 0)
        np.testing.assert_allclose(new.arrays[name][m], mean[m], rtol=1e-5)
        assert np.abs(mean[m]).min() >= np.abs(mean[~m & (cnt > 0)]).max()


# -- the client: extrusion, payloads, traffic (checks 3 and 9) -----------------------------------------
def _low_ratio(s: DynamicPruning, task: Any, up: UpdateSpec) -> float:
    """‖θ_low‖ after / before the round, θ_low marked on the downloaded model (spec §3.4)."""
    num = den = 0.0
    for n in s.prunable:
        w0, m = task.tensors[n].to_dense().reshape(-1), task.tensors[n].mask().reshape(-1)
        low = smallest_active(w0, m, task.config["xi"][n])
        w1 = np.zeros_like(w0)
        w1[np.flatnonzero(m)] = up.tensors[n].array  # type: ignore[union-attr]
        num += float(np.sum(w1[low].astype(np.float64) ** 2))
        den += float(np.sum(w0[low].astype(np.float64) ** 2))
    return math.sqrt(num / den)


def test_extrusion_shrinks_theta_low_with_a_boosted_rate(tmp_path: Path) -> None:
    exp, s = _strategy(tmp_path, "fedmef", {"extrusion_lambda": 5.0})
    (tmp_path / "off").mkdir()
    _, off = _strategy(tmp_path / "off", "fedmef", {"extrusion": False})
    task = s.plan(s.init_state(), 3, [0], {})[0]
    assert task.config["adjust"] and task.config["lr"] == pytest.approx(0.1 * 0.95**2)
    up = s.train(task, _ctx(exp, 0, 3, tmp_path))
    ratio_on = _low_ratio(s, task, up)
    assert up.metrics["extrusion_ratio"] == pytest.approx(ratio_on, rel=1e-4)
    assert task.config["lr"] <= up.metrics["lr_max"] <= 0.1  # μ = max(η_r, β), β ≤ η_0
    task_off = off.plan(off.init_state(), 3, [0], {})[0]
    plain = off.train(task_off, _ctx(exp, 0, 3, tmp_path))
    assert "extrusion_ratio" not in plain.metrics and plain.metrics["lr_max"] == task.config["lr"]
    ratio_off = _low_ratio(off, task_off, plain)
    assert ratio_on < 0.5 * ratio_off, (ratio_on, ratio_off)


@pytest.mark.parametrize("algo", ["fedtiny", "fedmef", "feddst"])
def test_uploads_carry_only_values_plus_top_xi_lists_in_adjustment_rounds(tmp_path: Path, algo: str) -> None:
    exp, s = _strategy(tmp_path, algo)
    state = s.init_state()
    normal, adjust = s.plan(state, 2, [0], {})[0], s.plan(state, 3, [0], {})[0]
    assert not normal.config["adjust"] and adjust.config["adjust"]
    for name in s.prunable:  # downlink: the mask travels as the sparse payload's positions
        t = normal.tensors[name]
        assert isinstance(t, codec.Sparse) and t.nnz == s.nnz[name]
    u_n = s.train(normal, _ctx(exp, 0, 2, tmp_path))
    u_a = s.train(adjust, _ctx(exp, 0, 3, tmp_path))
    s.validate_update(u_n)
    s.validate_update(u_a)
    for name in s.prunable:
        assert isinstance(u_n.tensors[name], codec.Dense) and u_n.tensors[name].array.shape == (s.nnz[name],)
    size = {k: len(codec.packb(codec.encode(t))) for k, t in u_a.tensors.items()}
    if algo == "feddst":  # the local mask goes up with the weights, no gradients
        assert all(isinstance(u_a.tensors[n], codec.Sparse) for n in s.prunable)
        assert not any(k.startswith(GRAD) for k in u_a.tensors)
        return
    xi = adjust.config["xi"]
    extra = sum(v for k, v in size.items() if k.startswith(GRAD))
    # check 9: ξ_l (b + index) bytes per layer; the codec's indices are byte-aligned (uint16 here)
    info = sum(xi[n] * (4 + codec.index_dtype_for(math.prod(s.shapes[n])).itemsize) for n in s.prunable)
    assert info <= extra <= info + len(s.prunable) * codec.HEADER_BYTES
    for name in s.prunable:
        g = u_a.tensors[GRAD + name]
        assert isinstance(g, codec.Sparse) and g.nnz == xi[name]
        assert not np.any(g.mask() & normal.tensors[name].mask())  # pruned positions only  # type: ignore[union-attr]
    # with the round the aggregator takes from the envelope, ξ_l is checked exactly: the same
    # lists are refused as the answer to a normal round, and one entry short is refused too
    s.validate_update(dataclasses.replace(u_a, round=3))
    with pytest.raises(codec.CodecError, match="no adjustment round"):
        s.validate_update(dataclasses.replace(u_a, round=2))
    name = s.prunable[0]
    g = u_a.tensors[GRAD + name]
    assert isinstance(g, codec.Sparse)
    short = codec.Sparse.from_dense(g.to_dense(), g.mask() & (np.cumsum(g.mask()) < g.nnz).reshape(g.shape))
    assert short.nnz == g.nnz - 1
    cut = dataclasses.replace(u_a, tensors={**u_a.tensors, GRAD + name: short})
    s.validate_update(cut)  # without the round only ξ_max bounds it
    with pytest.raises(codec.CodecError, match="wants ξ"):
        s.validate_update(dataclasses.replace(cut, round=3))


# -- memory: admission by the honest footprint ---------------------------------------------------------
def test_a_budget_between_the_footprints_admits_fedmef_and_refuses_fedtiny(tmp_path: Path) -> None:
    _, mef = _strategy(tmp_path, "fedmef")
    _, tiny = _strategy(tmp_path, "fedtiny")
    _, dst = _strategy(tmp_path, "feddst")
    st_m, st_t = mef.init_state(), tiny.init_state()
    peak_mef = max(mef.task_footprint(mef.plan(st_m, r, [0], {})[0]).total for r in (1, 3))
    low_tiny = min(tiny.task_footprint(tiny.plan(st_t, r, [0], {})[0]).total for r in (1, 3))
    assert peak_mef < 0.5 * low_tiny
    fp = mef.task_footprint(mef.plan(st_m, 3, [0], {})[0])
    assert fp.activations_bytes < 0.2 * tiny.task_footprint(tiny.plan(st_t, 3, [0], {})[0]).activations_bytes
    budget = (peak_mef + low_tiny) // 2
    assert admit(fp, budget).admitted
    assert not admit(tiny.task_footprint(tiny.plan(st_t, 1, [0], {})[0]), budget).admitted
    assert not admit(dst.task_footprint(dst.plan(dst.init_state(), 1, [0], {})[0]), budget).admitted


def _fleet(budget: int) -> dict[str, Any]:
    return {
        "tiers": {
            "small": {
                "count": 4,
                "memory_bytes": budget,
                "uplink_bps": 1e7,
                "downlink_bps": 1e7,
                "latency_s": 0.01,
                "flops_per_s": 1e9,
            }
        }
    }


def _run(tmp_path: Path, algo: str, name: str, **kw: Any) -> Path:
    cfg = load_config(
        _config(
            tmp_path / f"{name}.yaml",
            algo,
            rounds=6,
            num_devices=4,
            devices_per_round=4,
            round_timeout_s=20,
            processes={"aggregators": 2, "clients": 2, "prefetch": 8},
            **kw,
        )
    )
    run = tmp_path / name
    run.mkdir()
    assert run_inproc(cfg, run, f"{name}-{tmp_path.name}") == 0
    return run


def test_end_to_end_fedmef_admitted_where_fedtiny_is_refused(tmp_path: Path) -> None:
    """Two in-process runs on a fleet whose budget lies between the two footprints: FedMef trains 6
    rounds (adjusting at r = 2, 4) with constant density and the check-3 diagnostics; every FedTiny
    task is refused for memory."""
    _, mef = _strategy(tmp_path, "fedmef")
    _, tiny = _strategy(tmp_path, "fedtiny")
    peak = max(mef.task_footprint(mef.plan(mef.init_state(), r, [0], {})[0]).total for r in (1, 3))
    low = tiny.task_footprint(tiny.plan(tiny.init_state(), 1, [0], {})[0]).total
    budget = (peak + low) // 2
    run = _run(tmp_path, "fedmef", "mef", fleet=_fleet(budget))
    rows = list(csv.DictReader((run / "rounds.csv").open()))
    assert [int(r["participants"]) for r in rows] == [4] * 6
    assert all(int(r["rejected"]) == 0 for r in rows)
    assert {round(float(r["density"]), 4) for r in rows} == {round(mef.density(mef.init_state()), 4)}
    adjust = [float(r["m_adjust"]) for r in rows]
    assert adjust == [0, 0, 1, 0, 1, 0]
    up = [int(r["bytes_up"]) for r in rows]
    assert up[2] > up[1] and up[4] > up[3] and up[0] == up[1] == up[3] == up[5]
    ratios = [float(r["m_extrusion_ratio"]) for r in rows if float(r["m_adjust"]) == 1]
    # the first extrusion shrinks θ_low (initial weights); at the second, θ_low is mostly weights grown
    # at the first adjustment two rounds earlier, tiny, and the task gradient can outweigh λ‖θ_low‖²
    assert len(ratios) == 2 and 0 < ratios[0] < 1 and ratios[1] > 0
    assert float(rows[-1]["accuracy"]) > 0.3
    meta = json.loads((run / "checkpoint" / "state.json").read_text())["state_meta"]
    log = meta["adjust_log"]
    assert [e["round"] for e in log] == [3, 5]
    assert all(0 <= e["overlap"] <= 1 and "acc_before" in e and "acc_after" in e for e in log)
    # the same pair in rounds.csv: the server-side evaluation's extra numbers become e_ columns
    before = {int(r["round"]): r["e_accuracy_before_adjust"] for r in rows if r["e_accuracy_before_adjust"]}
    assert sorted(before) == [3, 5]
    assert all(abs(float(before[e["round"]]) - e["acc_before"]) < 1e-5 for e in log)

    refused = _run(tmp_path, "fedtiny", "tiny", fleet=_fleet(budget))
    rows_t = list(csv.DictReader((refused / "rounds.csv").open()))
    assert all(int(r["participants"]) == 0 and int(r["rejected"]) == 4 for r in rows_t)


def test_registry_has_the_three_algorithms() -> None:
    from shared import algorithms

    for name, cls in (("fedmef", FedMef), ("fedtiny", FedTiny), ("feddst", FedDST)):
        assert algorithms.get(name) is cls and issubclass(cls, Strategy)


@pytest.mark.parametrize("algo", ["fedtiny", "fedmef"])
def test_sparse_init_fan_in_scales_the_initial_sparse_weights_only(tmp_path: Path, algo: str) -> None:
    """``sparse_init: fan_in`` changes the initial weights (same masks, same support, each unit
    rescaled to its sparse fan-in); the default keeps the papers' θ_0 ⊙ M."""
    from shared.models.dynamic_sparse import fan_in_scaled

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, plain = _strategy(tmp_path / "a", algo)
    _, scaled = _strategy(tmp_path / "b", algo, {"sparse_init": "fan_in"})
    assert plain.opts.sparse_init == "masked"
    a, b = plain.init_state().arrays, scaled.init_state().arrays
    dense = model_arrays(plain.train_model())
    for name in plain.prunable:
        np.testing.assert_array_equal(a["mask/" + name], b["mask/" + name])
        m = a["mask/" + name].astype(bool)
        np.testing.assert_array_equal(a[name], (dense[name] * m).astype(np.float32))
        np.testing.assert_array_equal(b[name], fan_in_scaled(dense[name], m))
        assert np.abs(b[name]).sum() > np.abs(a[name]).sum()


def test_check7_statistics_see_a_dead_filter_and_a_shared_input_mean() -> None:
    """``conv_output_stats`` counts a constant output channel as dead instead of dividing by 0, and
    ``input_mean_spread`` is 0 exactly when every input coordinate has the same mean (Theorem 1's
    assumption) and positive when they differ."""
    import torch

    from shared.algorithms.fedmef import conv_output_stats, input_mean_spread

    conv = torch.nn.Conv2d(1, 2, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight[1].zero_()  # channel 1: constant output
    model = torch.nn.Sequential(conv)
    rng = np.random.default_rng(0)
    x = rng.random((64, 1, 6, 6), dtype=np.float32)
    ratio, dead = conv_output_stats(model, "0", x)
    assert dead == 1 and np.isfinite(ratio)
    same = np.broadcast_to(rng.random((64, 1, 1, 1), dtype=np.float32), (64, 1, 6, 6))
    assert input_mean_spread(model, "0", same) == pytest.approx(0.0, abs=1e-6)
    ramp = same * np.linspace(0.5, 1.5, 36, dtype=np.float32).reshape(1, 1, 6, 6)
    assert input_mean_spread(model, "0", ramp) > 0.1
