"""Robust aggregation: each estimator on hand-checked numbers, the same result however the updates
are split over aggregators, and refusal for algorithms that cannot use it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.cli import main
from shared import algorithms, codec
from shared.algorithms import robust
from shared.algorithms.base import Partial, UpdateSpec
from shared.algorithms.fedavg import FedAvg
from shared.algorithms.robust import RobustMixin
from shared.config import RobustConfig, load_config
from shared.experiment import Experiment
from tests.conftest import reduce_two_ways, write_config


def _updates(rows: list[list[float]], weights: list[float] | None = None) -> list[robust._Update]:
    weights = weights or [1.0] * len(rows)
    return [
        robust._Update(device=i, weight=w, values={"a": np.array(r, dtype=np.float64)})
        for i, (r, w) in enumerate(zip(rows, weights, strict=True))
    ]


def _estimate(rows: list[list[float]], weights: list[float] | None = None, **cfg: Any) -> Any:
    est, used = robust.aggregate(_updates(rows, weights), RobustConfig(**cfg))
    return est["a"], used


def test_median_and_trimmed_mean_ignore_the_extremes_of_each_coordinate() -> None:
    rows = [[1.0, 10.0], [2.0, 20.0], [3.0, -1e6], [4.0, 40.0], [1e9, 90.0]]
    est, used = _estimate(rows, aggregation="median")
    np.testing.assert_array_equal(est, [3.0, 20.0])
    assert used == [0, 1, 2, 3, 4]
    # β = 0.2 of 5 updates: one cut at each end of every coordinate, separately per coordinate
    est, _ = _estimate(rows, aggregation="trimmed_mean", trim_fraction=0.2)
    np.testing.assert_allclose(est, [3.0, 70.0 / 3])
    # β = 0.1 of 5 cuts nothing: the plain (unweighted) mean, outliers and all
    est, _ = _estimate(rows, aggregation="trimmed_mean", trim_fraction=0.1)
    np.testing.assert_allclose(est, np.mean(rows, axis=0))


def test_sub_model_updates_are_summarised_over_the_devices_that_hold_each_coordinate() -> None:
    nan = np.nan
    rows = [[1.0, 5.0, nan], [2.0, nan, nan], [3.0, 7.0, nan], [100.0, 9.0, nan]]
    counts = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [2.0, 2.0, 0.0], [1.0, 1.0, 0.0]]
    updates = _updates(rows)
    for u, c in zip(updates, counts, strict=True):
        u.counts = {"a": np.array(c)}
    est, _ = robust.aggregate(updates, RobustConfig(aggregation="median"))
    np.testing.assert_array_equal(est["a"], [2.5, 7.0, nan])  # nobody holds the last coordinate
    est, _ = robust.aggregate(updates, RobustConfig(aggregation="trimmed_mean", trim_fraction=0.25))
    np.testing.assert_array_equal(est["a"], [2.5, 7.0, nan])  # 4 holders: cut 1; 3 holders: cut 0
    est, _ = robust.aggregate(updates, RobustConfig(aggregation="mean"))
    np.testing.assert_allclose(est["a"], [(1 + 2 + 6 + 100) / 5, (5 + 14 + 9) / 4, nan])
    reference = {"a": np.zeros(3)}
    assert robust.clip(updates, reference, bound=10.0) == 1  # only (100, 9): norm over what it holds
    np.testing.assert_allclose(updates[3].values["a"][:2], np.array([100.0, 9.0]) * 10 / np.hypot(100, 9))


def test_mean_is_sample_weighted() -> None:
    est, _ = _estimate([[0.0], [10.0]], [1.0, 3.0], aggregation="mean")
    np.testing.assert_allclose(est, [7.5])


def test_krum_keeps_the_update_closest_to_its_neighbours_and_multi_krum_the_closest_few() -> None:
    rows = [[0.0, 0.0], [0.1, 0.0], [0.0, 0.2], [0.05, 0.05], [50.0, -50.0], [-40.0, 60.0]]
    est, used = _estimate(rows, aggregation="krum", byzantine=2)
    # scores over k - f - 2 = 2 nearest: device 3 scores 0.005 + 0.005; devices 0 and 1 0.015
    assert used == [3]
    np.testing.assert_array_equal(est, [0.05, 0.05])
    est, used = _estimate(rows, [1.0, 1.0, 2.0, 1.0, 1.0, 1.0], aggregation="multi_krum", byzantine=2)
    assert used == [0, 1, 2, 3]  # m = k - f by default; the two outliers are left out
    np.testing.assert_allclose(est, [0.03, 0.09])  # sample-weighted over the kept ones
    _, used = _estimate(rows, aggregation="multi_krum", byzantine=2, multi_krum_keep=2)
    assert len(used) == 2 and set(used) <= {0, 1, 2, 3}


def test_clipping_bounds_the_change_from_the_global_model_not_the_weights() -> None:
    reference = {"a": np.array([10.0, 10.0])}
    updates = _updates([[13.0, 14.0], [10.5, 10.0]])
    assert robust.clip(updates, reference, bound=1.0) == 1
    np.testing.assert_allclose(updates[0].values["a"], [10.6, 10.8])  # change (3, 4) → norm 1
    np.testing.assert_allclose(updates[1].values["a"], [10.5, 10.0])  # within the bound: untouched


def _strategy(tmp_path: Path, **robust_cfg: Any) -> Any:
    cfg = load_config(write_config(tmp_path / "c.yaml", robust=robust_cfg))
    return Experiment.build(cfg).strategy


def _fake_updates(strategy: Any, n: int, seed: int) -> list[UpdateSpec]:
    rng = np.random.default_rng(seed)
    state = strategy.init_state().arrays
    out = []
    for dev in range(n):
        scale = 100.0 if dev == 0 else 0.01  # device 0 is an outlier
        tensors: dict[str, codec.Tensor] = {
            k: codec.Dense((v + scale * rng.standard_normal(v.shape)).astype(v.dtype))
            for k, v in state.items()
            if v.dtype.kind == "f"
        }
        out.append(UpdateSpec(tensors, num_samples=int(rng.integers(5, 50)), device_id=dev, round=1))
    return out


@pytest.mark.parametrize(
    "cfg",
    [
        {"aggregation": "median"},
        {"aggregation": "trimmed_mean", "trim_fraction": 0.2},
        {"aggregation": "krum", "byzantine": 1},
        {"aggregation": "multi_krum", "byzantine": 1},
        {"clip_norm": 0.5},
        {"aggregation": "median", "clip_norm": 0.5},
    ],
)
def test_the_result_does_not_depend_on_how_updates_are_split_over_aggregators(
    tmp_path: Path, cfg: dict[str, Any]
) -> None:
    strategy = _strategy(tmp_path, **cfg)
    assert type(strategy).__name__ == "RobustFedAvg" and isinstance(strategy, FedAvg)
    updates = _fake_updates(strategy, 7, seed=3)
    state = strategy.init_state()
    one, split = reduce_two_ways(strategy, updates, random.Random(5))
    a = strategy.finalize(state, one, 1)
    b = strategy.finalize(state, split, 1)
    for name in a.arrays:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])  # bit for bit
    # and the outlier (device 0, 10⁴ times the others' spread) has not dragged the model away
    plain = FedAvg(strategy.ctx)
    mean = plain.finalize(state, _plain_partial(plain, updates[1:]), 1)
    worst = max(float(np.max(np.abs(a.arrays[k] - mean.arrays[k]))) for k in mean.arrays)
    assert worst < 0.2, worst
    assert isinstance(strategy, RobustMixin)  # what Experiment builds when robust: is on
    counts = strategy.robust_counts
    assert counts["used"] + counts["excluded"] == 7
    if cfg.get("aggregation") == "krum":
        assert counts["used"] == 1
    if "clip_norm" in cfg:
        assert counts["clipped"] >= 1  # device 0 at least


def _plain_partial(strategy: Any, updates: list[UpdateSpec]) -> Partial:
    partial = Partial()
    for u in updates:
        partial = strategy.reduce(partial, u)
    return partial


def test_the_robust_mean_is_the_algorithms_own_mean(tmp_path: Path) -> None:
    """With a clip bound nobody reaches, the robust path (updates forwarded whole, mean at the
    server) gives FedAvg's own weighted mean."""
    strategy = _strategy(tmp_path, clip_norm=1e9)
    updates = _fake_updates(strategy, 5, seed=1)
    state = strategy.init_state()
    robust_model = strategy.finalize(state, _plain_partial(strategy, updates), 1)
    plain = FedAvg(strategy.ctx)
    mean = plain.finalize(state, _plain_partial(plain, updates), 1)
    for k in mean.arrays:
        np.testing.assert_allclose(robust_model.arrays[k], mean.arrays[k], rtol=0, atol=1e-6)
    assert strategy.robust_counts["clipped"] == 0
    # an empty round leaves the state as it was, as FedAvg does
    assert strategy.finalize(state, None, 2) is state


def test_robust_partials_hold_each_update_under_its_device(tmp_path: Path) -> None:
    strategy = _strategy(tmp_path, aggregation="median")
    updates = _fake_updates(strategy, 2, seed=0)
    partial = _plain_partial(strategy, updates)
    assert set(partial.scalars) == {"robust/0", "robust/1"}
    assert all(k.startswith(("robust/0/", "robust/1/")) for k in partial.arrays)
    tensors, scalars = partial.to_wire()  # what travels to the server survives the wire form
    back = Partial.from_wire(tensors, scalars)
    assert set(back.arrays) == set(partial.arrays)


def test_algorithms_that_cannot_use_robust_aggregation_are_refused_with_the_reason(tmp_path: Path) -> None:
    usable = sorted(n for n, cls in algorithms.REGISTRY.items() if cls.mean_form is not None)
    assert usable == ["fedavg", "feddropout", "feddse", "fedrolex", "fjord", "heterofl"]
    for name in sorted(set(algorithms.REGISTRY) - set(usable)):
        with pytest.raises(ValueError, match="not a weighted mean of updates over common coordinates"):
            algorithms.check_robust(name, RobustConfig(aggregation="median"))
        algorithms.check_robust(name, RobustConfig())  # the default (the algorithm's own mean) is fine
    with pytest.raises(ValueError, match="sub-models that cover different coordinates"):
        algorithms.check_robust("heterofl", RobustConfig(aggregation="krum"))
    bad = write_config(tmp_path / "bad.yaml", algorithm={"name": "spafl"}, robust={"aggregation": "median"})
    assert main(["validate", str(bad), "--syntax-only"]) == 2
    bad = write_config(tmp_path / "krum.yaml", algorithm={"name": "heterofl"}, robust={"aggregation": "krum"})
    assert main(["validate", str(bad), "--syntax-only"]) == 2
    good = write_config(tmp_path / "good.yaml", robust={"aggregation": "trimmed_mean"})
    assert main(["validate", str(good), "--syntax-only"]) == 0


def _run(tmp_path: Path, name: str, aggregators: int, **overrides: Any) -> dict[str, np.ndarray]:
    from services.orchestrator import InprocCluster

    cfg = write_config(
        tmp_path / f"{name}.yaml",
        rounds=2,
        num_devices=8,
        devices_per_round=6,
        dataset={"partition": "classes", "classes_per_device": 2},
        algorithm={"name": "heterofl", "options": {"capacity": "paper", "weighting": "uniform"}},
        **overrides,
    )
    run = tmp_path / name
    run.mkdir()
    cluster = InprocCluster(Experiment.build(load_config(cfg)), run, name, aggregators=aggregators)
    assert cluster.run(max_steps=500_000) == 0
    cluster.close()
    return dict(cluster.server.state.arrays)


def test_a_width_slice_algorithm_takes_the_median_over_holders_however_aggregators_split(
    tmp_path: Path,
) -> None:
    """HeteroFL (sub-models of different widths): the robust median runs, gives the same model with
    one aggregator or three, and the robust mean (an unreachable clip bound) is HeteroFL's own."""
    one = _run(tmp_path, "one", 1, robust={"aggregation": "median"})
    three = _run(tmp_path, "three", 3, robust={"aggregation": "median"})
    for k in one:
        np.testing.assert_array_equal(one[k], three[k])
    assert all(np.isfinite(v).all() for v in one.values() if v.dtype.kind == "f")
    own = _run(tmp_path, "own", 2)
    mean = _run(tmp_path, "mean", 2, robust={"clip_norm": 1e9})
    for k in own:
        np.testing.assert_allclose(mean[k], own[k], rtol=0, atol=1e-5)
    assert any(not np.array_equal(one[k], own[k]) for k in own)  # the median is not the mean
