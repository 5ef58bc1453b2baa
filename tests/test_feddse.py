"""FedDSE and the width-slice baselines (HeteroFL, FedRolex, Federated Dropout).

Spec ``docs/algorithms/feddse.md``: C1 (every method at r = 1 equals FedAvg), the selection rules,
data-aware extraction on the device, full download / sliced upload, budget-sized capacities, the
aggregation variants, split-over-aggregators invariance through the strategies, and one short
in-process run of the real services per download style.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from shared import codec
from shared.algorithms.base import DeviceContext, Partial, Strategy, TaskSpec, UpdateSpec, derive_seed
from shared.algorithms.feddse import FedDSE, select_units
from shared.algorithms.width_slicing import LASTSEL, WidthSliceStrategy
from shared.config import load_config
from shared.experiment import Experiment
from shared.models.width_slice import unit_scores
from shared.schemas import DeviceInfo
from tests.conftest import write_config

WIDTH_ALGOS = ("feddse", "heterofl", "fedrolex", "feddropout")


def _exp(tmp_path: Path, algo: str, options: dict[str, Any] | None = None, **overrides: Any) -> Experiment:
    alg: dict[str, Any] = {"name": algo}
    if options is not None:
        alg["options"] = options
    base: dict[str, Any] = {
        "num_devices": 8,
        "devices_per_round": 4,
        "dataset": {"name": "digits", "partition": "iid", "train_limit": 400},
        "model": {"name": "mlp", "options": {"hidden": [32, 16]}},
        "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
    }
    base.update(overrides)
    cfg = write_config(
        tmp_path / f"{algo}-{abs(hash(json.dumps(alg, sort_keys=True)))}.yaml", algorithm=alg, **base
    )
    return Experiment.build(load_config(cfg))


def _ctx(exp: Experiment, dev: int, round: int, tmp_path: Path) -> DeviceContext:
    seed = derive_seed(exp.cfg.seed, "train", round, dev) % (2**32)
    return DeviceContext(dev, round, exp.device_data(dev), tmp_path / f"d{dev}", seed=seed)


def _round(
    exp: Experiment, state: Any, round: int, devices: list[int], tmp_path: Path, splits: int = 1
) -> Any:
    """One round through the strategy halves: plan, train, validate, reduce over ``splits`` aggregators."""
    s = exp.strategy
    tasks = s.plan(state, round, devices, {})
    parts = [Partial() for _ in range(splits)]
    for i, dev in enumerate(devices):
        up = s.train(tasks[dev], _ctx(exp, dev, round, tmp_path))
        up = UpdateSpec(up.tensors, up.num_samples, up.metrics, device_id=dev)
        s.validate_update(up)
        s.reduce(parts[i % splits], up)
    merged = parts[0]
    for p in parts[1:]:
        merged = s.merge(merged, p)
    return s.finalize(state, merged, round)


# -- C1: at r = 1 every method is FedAvg -------------------------------------------------------------------
@pytest.mark.parametrize("algo", WIDTH_ALGOS)
def test_full_width_equals_fedavg(tmp_path: Path, algo: str) -> None:
    fed = _exp(tmp_path, "fedavg")
    wide = _exp(tmp_path, algo, {"capacity": "fixed", "fixed_rate": 1.0})
    sa, sb = fed.strategy.init_state(), wide.strategy.init_state()
    for r in (1, 2):
        sa = _round(fed, sa, r, [0, 3, 5, 6], tmp_path)
        sb = _round(wide, sb, r, [0, 3, 5, 6], tmp_path)
    worst = max(float(np.max(np.abs(sa.arrays[k] - sb.arrays[k]))) for k in sa.arrays)
    assert worst < 1e-5
    # and the sub-models were not trivially the old model
    assert (
        max(float(np.max(np.abs(sb.arrays[k] - wide.strategy.init_state().arrays[k]))) for k in sa.arrays)
        > 1e-3
    )


# -- the rules ---------------------------------------------------------------------------------------------
def test_baseline_rules(tmp_path: Path) -> None:
    opts = {"capacity": "fixed", "fixed_rate": 0.25}
    het, rol, fd = (_exp(tmp_path, a, opts).strategy for a in ("heterofl", "fedrolex", "feddropout"))
    assert isinstance(het, WidthSliceStrategy) and isinstance(rol, WidthSliceStrategy)
    assert isinstance(fd, WidthSliceStrategy)
    counts = het.counts_for(0.25)
    assert counts == {"fc1": 8, "fc2": 4}
    assert np.array_equal(het.choose(7, 1, 0, counts)["fc1"], np.arange(8))
    # FedRolex: one contiguous (wrapping) window per round, the same for all devices, moving by one
    w3 = rol.choose(3, 1, 0, counts)
    assert np.array_equal(w3["fc1"], np.arange(2, 10)) and np.array_equal(
        rol.choose(3, 5, 2, counts)["fc1"], w3["fc1"]
    )
    assert np.array_equal(rol.choose(4, 1, 0, counts)["fc1"], np.arange(3, 11))
    assert np.array_equal(rol.choose(16, 1, 0, counts)["fc2"], np.array([0, 1, 2, 15]))  # wraps around
    # Federated Dropout: random, per device and round, reproducible
    a, b = fd.choose(3, 1, 0, counts), fd.choose(3, 2, 1, counts)
    assert not np.array_equal(a["fc1"], b["fc1"]) and np.array_equal(
        a["fc1"], fd.choose(3, 1, 0, counts)["fc1"]
    )
    assert len(np.unique(a["fc1"])) == 8


def test_select_units_topk_softmax_proportional() -> None:
    s = np.array([0.0, 3.0, 1.0, 2.0, 0.0])
    rng = np.random.default_rng(0)
    assert np.array_equal(select_units(s, 2, rng), [1, 3])
    assert np.array_equal(select_units(s, 4, rng), [0, 1, 2, 3])  # dead units fill in index order
    # T > 0: the first draw follows softmax(s/T) (Gumbel-top-1 is exactly a categorical draw)
    n = 20_000
    firsts = np.array([select_units(s, 1, rng, temperature=1.0)[0] for _ in range(n)])
    p = np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(np.bincount(firsts, minlength=5) / n, p, atol=0.015)
    hot = np.array([select_units(s, 1, rng, temperature=100.0)[0] for _ in range(5000)])
    assert np.all(np.bincount(hot, minlength=5) / 5000 > 0.15)  # T → ∞: uniform
    prop = np.array([select_units(s, 1, rng, selection="proportional")[0] for _ in range(n)])
    np.testing.assert_allclose(np.bincount(prop, minlength=5) / n, s / s.sum(), atol=0.015)
    assert set(select_units(s, 4, rng, selection="proportional")) >= {1, 2, 3}  # zeros only to fill


# -- FedDSE: full model down, data-aware sub-model up ------------------------------------------------------
def test_feddse_downloads_full_and_uploads_its_top_units(tmp_path: Path) -> None:
    exp = _exp(
        tmp_path,
        "feddse",
        {"capacity": "fixed", "fixed_rate": 0.25},
        dataset={"name": "digits", "partition": "classes", "classes_per_device": 2, "train_limit": 400},
    )
    s = exp.strategy
    assert isinstance(s, FedDSE)
    state = s.init_state()
    task = s.plan(state, 1, [2], {})[2]
    assert all(isinstance(t, codec.Dense) for t in task.tensors.values())
    assert set(task.tensors) == set(s.structure.shapes)
    ctx = _ctx(exp, 2, 1, tmp_path)
    up = s.train(task, ctx)
    sel = s.structure.selection_from_payload(up.tensors)
    model = exp.model()
    scores = unit_scores(model, s.structure, ctx.data.x_train)  # type: ignore[arg-type]
    for h in s.structure.hidden:
        k = s.counts_for(0.25)[h]
        assert np.array_equal(sel[h], np.sort(np.argsort(-scores[h], kind="stable")[:k]))
    down = sum(len(codec.packb(codec.encode(t))) for t in task.tensors.values())
    upb = sum(len(codec.packb(codec.encode(t))) for t in up.tensors.values())
    assert down > 4 * s.full_params and upb < 0.3 * down  # fc1 ~r, hidden-hidden ~r²
    assert up.metrics["rate"] == 0.25 and up.metrics["paper_bytes_down"] == 4 * s.full_params
    # another device with other classes picks other units (the point of the method)
    other = s.structure.selection_from_payload(s.train(task, _ctx(exp, 5, 1, tmp_path)).tensors)
    assert any(not np.array_equal(other[h], sel[h]) for h in s.structure.hidden)
    # the FLOPs charge the extraction pass on top of training the sub-model
    base = WidthSliceStrategy.task_flops(s, task, len(ctx.data.y_train))
    assert s.task_flops(task, len(ctx.data.y_train)) == base + up.metrics["extract_flops"]


def test_split_over_aggregators_gives_the_same_model(tmp_path: Path) -> None:
    for algo in ("feddse", "feddropout"):
        exp = _exp(tmp_path, algo, {"capacity": "paper"})
        s0 = exp.strategy.init_state()
        one = _round(exp, s0, 1, [0, 1, 4, 7], tmp_path, splits=1)
        three = _round(exp, s0, 1, [0, 1, 4, 7], tmp_path, splits=3)
        for k in one.arrays:
            np.testing.assert_allclose(one.arrays[k], three.arrays[k], rtol=1e-6, atol=1e-7)
        assert np.all(one.arrays[LASTSEL + "fc1"] <= 1) and np.any(one.arrays[LASTSEL + "fc1"] == 1)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), order=st.permutations(range(4)), cut=st.integers(0, 4))
def test_reduce_is_associative_and_commutative(
    tmp_path_factory: Any, seed: int, order: list[int], cut: int
) -> None:
    """Random sub-models and values: any order and any split over two aggregators, same partial."""
    tmp = tmp_path_factory.mktemp("assoc")
    s = _EXP_CACHE.setdefault("fd", _exp(tmp, "feddropout", {"capacity": "paper"})).strategy
    assert isinstance(s, WidthSliceStrategy)
    rng = np.random.default_rng(seed)
    ups = []
    for dev in range(4):
        sel = {
            h: np.sort(rng.choice(m, size=int(rng.integers(1, m + 1)), replace=False))
            for h, m in s.structure.widths().items()
        }
        full = {k: rng.normal(size=shp).astype(np.float32) for k, shp in s.structure.shapes.items()}
        tensors: dict[str, codec.Tensor] = dict(s.structure.slice(full, sel))
        ups.append(UpdateSpec(tensors, int(rng.integers(1, 50)), device_id=dev))
    whole = Partial()
    for u in ups:
        s.reduce(whole, u)
    left, right = Partial(), Partial()
    for i in order[:cut]:
        s.reduce(left, ups[i])
    for i in order[cut:]:
        s.reduce(right, ups[i])
    merged = s.merge(right, left)
    for k in whole.arrays:
        np.testing.assert_allclose(merged.arrays[k], whole.arrays[k], rtol=1e-12, atol=1e-12)


_EXP_CACHE: dict[str, Experiment] = {}


def test_invalid_updates_are_rejected(tmp_path: Path) -> None:
    s = _exp(tmp_path, "heterofl", {"capacity": "fixed", "fixed_rate": 0.5}).strategy
    state = s.init_state()
    task = s.plan(state, 1, [0], {})[0]
    good = dict(task.tensors)
    s.validate_update(UpdateSpec(good, 10))
    bad = dict(good)
    w = state.arrays["fc2.weight"]
    bad["fc2.weight"] = codec.Sliced.from_dense(w, [np.arange(8), np.arange(1, 17)])  # columns ≠ fc1's units
    with pytest.raises(codec.CodecError):
        s.validate_update(UpdateSpec(bad, 10))
    missing = {k: v for k, v in good.items() if k != "fc1.bias"}
    with pytest.raises(codec.CodecError):
        s.validate_update(UpdateSpec(missing, 10))
    with pytest.raises(codec.CodecError):
        s.validate_update(UpdateSpec(good, 0))


# -- capacity from the memory budget -----------------------------------------------------------------------
def test_budget_capacity_is_the_largest_rate_that_fits(tmp_path: Path) -> None:
    s = _exp(
        tmp_path, "heterofl", {"capacity": "budget", "tier_rates": {"small": 0.25}, "fixed_rate": 0.5}
    ).strategy
    assert isinstance(s, WidthSliceStrategy)
    grid = sorted(s.opts.budget_grid)
    foot = {r: s.task_footprint(TaskSpec(config={"rate": r})).total for r in grid}
    assert all(a < b for a, b in zip(list(foot.values())[:-1], list(foot.values())[1:], strict=True))
    budget = (foot[6 / 16] + foot[7 / 16]) // 2
    fleet = {
        0: DeviceInfo(device_id=0, tier="big", num_samples=50, profile={"memory_bytes": 10 * foot[1.0]}),
        1: DeviceInfo(device_id=1, tier="mid", num_samples=50, profile={"memory_bytes": budget}),
        2: DeviceInfo(device_id=2, tier="small", num_samples=50, profile={}),
    }
    assert s.rate_for(0, 1, fleet) == 1.0 and s.rate_for(1, 1, fleet) == 6 / 16
    assert s.rate_for(2, 1, fleet) == 0.25 and s.rate_for(3, 1, fleet) == 0.5  # no profile: tier, fixed_rate
    tasks = s.plan(s.init_state(), 1, [0, 1, 2], fleet)
    assert s.task_footprint(tasks[1]).total <= budget < foot[7 / 16]
    # the sampled modes are capped by the budget, too
    capped = _exp(tmp_path, "feddse", {"capacity": "fixed", "fixed_rate": 1.0}).strategy
    assert isinstance(capped, WidthSliceStrategy)
    assert capped.rate_for(1, 3, {1: fleet[1]}) == 6 / 16 and capped.rate_for(0, 3, {1: fleet[1]}) == 1.0
    assert capped.accounting_key(TaskSpec(config={"rate": 6 / 16})) != capped.accounting_key(
        TaskSpec(config={"rate": 1.0})
    )


# -- aggregation variants ----------------------------------------------------------------------------------
def test_classifier_rows_by_label_and_global_vote(tmp_path: Path) -> None:
    exp = _exp(
        tmp_path,
        "heterofl",
        {"capacity": "fixed", "fixed_rate": 0.5, "agg_classifier_by_label": True},
        dataset={"name": "digits", "partition": "classes", "classes_per_device": 2, "train_limit": 400},
    )
    s = exp.strategy
    state = s.init_state()
    new = _round(exp, state, 1, [0], tmp_path)
    held = np.unique(exp.device_data(0).y_train)
    changed = np.flatnonzero(np.any(new.arrays["fc3.weight"] != state.arrays["fc3.weight"], axis=1))
    assert set(changed) <= set(held) and len(changed) > 0
    # include_global: the update is damped (one extra vote for the old value)
    damp = _exp(tmp_path, "heterofl", {"capacity": "fixed", "fixed_rate": 0.5, "agg_include_global": True})
    plain = _exp(tmp_path, "heterofl", {"capacity": "fixed", "fixed_rate": 0.5})
    d = _round(damp, damp.strategy.init_state(), 1, [0], tmp_path).arrays["fc1.weight"]
    p = _round(plain, plain.strategy.init_state(), 1, [0], tmp_path).arrays["fc1.weight"]
    w0 = plain.strategy.init_state().arrays["fc1.weight"]
    np.testing.assert_allclose(d, (w0 + p) / 2, atol=1e-6)


# -- end to end through the in-process services ------------------------------------------------------------
def _run(tmp_path: Path, algo: str, options: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
    from services.orchestrator import run_inproc

    cfg = load_config(
        write_config(
            tmp_path / f"{algo}.yaml",
            rounds=3,
            num_devices=6,
            devices_per_round=3,
            dataset={"name": "digits", "partition": "classes", "classes_per_device": 2, "train_limit": 360},
            model={"name": "mlp", "options": {"hidden": [64, 32]}},
            algorithm={"name": algo, "options": options},
            train={"local_epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
        )
    )
    run = tmp_path / f"run-{algo}"
    run.mkdir()
    exp_id = f"wslice-{algo}-{tmp_path.name}"
    assert run_inproc(cfg, run, exp_id) == 0
    rows = list(csv.DictReader((run / "rounds.csv").open()))
    # the per-round table and the Prometheus counters of the devices' bytes agree (C6 reads either)
    for direction, col in (("up", "bytes_up"), ("down", "bytes_down")):
        counted = sum(
            REGISTRY.get_sample_value(
                "fedfleet_device_bytes_total",
                {"experiment": exp_id, "algorithm": algo, "direction": direction, "tier": tier},
            )
            or 0.0
            for tier in {d["tier"] for d in csv.DictReader((run / "devices.csv").open())}
        )
        assert counted == sum(float(r[col]) for r in rows) > 0
    return rows, json.loads((run / "summary.json").read_text())


def test_end_to_end_feddse_and_heterofl(tmp_path: Path) -> None:
    opts = {"capacity": "fixed", "fixed_rate": 0.25}
    dse, dse_sum = _run(tmp_path, "feddse", opts)
    het, _ = _run(tmp_path, "heterofl", opts)
    assert len(dse) == len(het) == 3 and all(r["outcome"] == "completed" for r in dse + het)
    full_bytes = 4 * (64 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10)
    for r in dse:
        # FedDSE: every participant downloads the whole float32 model, uploads only the sub-model
        assert full_bytes * 3 <= int(r["bytes_down"]) < full_bytes * 3 * 1.05
        assert int(r["bytes_up"]) < 0.25 * int(r["bytes_down"])
        assert float(r["m_rate"]) == 0.25 and float(r["m_extract_flops"]) > 0
    for a, b in zip(dse, het, strict=True):
        # the baseline downloads only the slice; uploads are the same size up to the index vectors
        assert int(b["bytes_down"]) < 0.25 * int(a["bytes_down"])
        assert abs(int(a["bytes_up"]) - int(b["bytes_up"])) < 0.1 * int(b["bytes_up"])
        assert float(a["density"]) == pytest.approx(float(b["density"]))
    assert 0.0 <= float(dse[-1]["accuracy"]) <= 1.0 and dse_sum["rounds"] == 3


def test_fjord_trains_ordered_prefixes_per_batch(tmp_path: Path) -> None:
    """FjORD with a single admissible width is HeteroFL exactly; with several, each minibatch trains a
    narrower prefix (so the update differs) while the upload stays the device's HeteroFL slice."""
    for rate, same in ((0.0625, True), (0.5, False)):
        opts = {"capacity": "fixed", "fixed_rate": rate}
        fj, het = _exp(tmp_path, "fjord", opts), _exp(tmp_path, "heterofl", opts)
        task_f = fj.strategy.plan(fj.strategy.init_state(), 1, [1], {})[1]
        task_h = het.strategy.plan(het.strategy.init_state(), 1, [1], {})[1]
        up_f = fj.strategy.train(task_f, _ctx(fj, 1, 1, tmp_path))
        up_h = het.strategy.train(task_h, _ctx(het, 1, 1, tmp_path))
        assert set(up_f.tensors) == set(up_h.tensors)
        equal = True
        for k, t in up_f.tensors.items():
            other = up_h.tensors[k]
            assert isinstance(t, codec.Sliced) and isinstance(other, codec.Sliced)
            assert all(
                (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
                for a, b in zip(t.indices, other.indices, strict=True)
            )
            equal = equal and np.array_equal(t.values, other.values)
        assert equal == same
        assert (up_f.metrics["od_mean_width"] < rate) == (not same)


def test_registry_names() -> None:
    from shared import algorithms

    for name in (*WIDTH_ALGOS, "fjord", "fedavg"):
        assert issubclass(algorithms.get(name), Strategy)


# -- the scoring pass is admitted like training ----------------------------------------------------------
def test_scoring_pass_over_budget_is_refused_end_to_end(tmp_path: Path) -> None:
    """A device whose budget fits FedDSE's sub-model training but not its full-model scoring pass
    refuses the task (reason ``memory``, the detail naming the pass), through the real client
    service; with room for both, the same device trains. HeteroFL on the tight budget trains."""
    from services.orchestrator import run_inproc
    from shared.devices import admit
    from shared.results import read_rounds

    probe = _exp(tmp_path, "feddse", {"capacity": "fixed", "fixed_rate": 0.25})
    s = probe.strategy
    task = s.plan(s.init_state(), 1, [0], {})[0]
    n = len(probe.device_data(0).y_train)
    train_b = s.task_footprint(task).total
    extra = s.task_extra_peak(task, n)
    assert extra is not None and extra[1] > train_b
    tight = (train_b + extra[1]) // 2
    refused = admit(s.task_footprint(task), tight, extra=extra)
    assert not refused.admitted and refused.reason == "memory" and "scoring pass" in refused.detail
    assert admit(s.task_footprint(task), extra[1], extra=extra).admitted

    def run(algo: str, budget: int) -> list[dict[str, Any]]:
        tier = {
            "count": 8,
            "memory_bytes": budget,
            "uplink_bps": 1e7,
            "downlink_bps": 1e7,
            "latency_s": 0.01,
            "flops_per_s": 1e9,
        }
        exp = _exp(
            tmp_path,
            algo,
            {"capacity": "fixed", "fixed_rate": 0.25},
            rounds=2,
            fleet={"tiers": {"edge": tier}},
            quorum_fraction=0.25,
            round_timeout_s=5,
        )
        run_dir = tmp_path / f"run-{algo}-{budget}"
        run_dir.mkdir()
        assert run_inproc(exp.cfg, run_dir, f"t-{algo}-{budget}", exp=exp) == 0
        return read_rounds(run_dir)

    assert all(r["rejected"] == 4 and r["participants"] == 0 for r in run("feddse", tight))
    assert all(r["rejected"] == 0 and r["participants"] == 4 for r in run("feddse", extra[1]))
    assert all(r["participants"] == 4 for r in run("heterofl", tight))
