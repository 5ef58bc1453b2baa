"""LG-FedAvg: the representation stays on the device, only the head travels and is averaged."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.orchestrator import run_inproc
from shared import codec
from shared.algorithms import device_state
from shared.algorithms.base import DeviceContext, DeviceData, Partial, UpdateSpec
from shared.algorithms.lgfedavg import STATE_PREFIX, LGFedAvg
from shared.config import load_config
from shared.experiment import Experiment
from shared.results import read_rounds
from tests.conftest import reduce_two_ways, write_config

MODEL = {"name": "mlp", "options": {"hidden": [16, 8]}}
HEAD = ["fc3.weight", "fc3.bias"]


def _lg(tmp_path: Path, name: str = "c.yaml", **options: Any) -> LGFedAvg:
    cfg = write_config(tmp_path / name, model=MODEL, algorithm={"name": "lgfedavg", "options": options})
    s = Experiment.build(load_config(cfg)).strategy
    assert isinstance(s, LGFedAvg)
    return s


def _device(tmp_path: Path, dev: int, rnd: int) -> DeviceContext:
    rng = np.random.default_rng(dev)
    x = rng.random((40, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    return DeviceContext(dev, rnd, DeviceData(x, y, x[:10], y[:10]), tmp_path / f"device-{dev}", seed=rnd)


def _head_update(s: LGFedAvg, seed: int, n: int, dev: int | None = None) -> UpdateSpec:
    rng = np.random.default_rng(seed)
    shapes = s._shapes
    return UpdateSpec(
        {k: codec.Dense(rng.normal(size=shapes[k]).astype(np.float32)) for k in HEAD}, n, device_id=dev
    )


def test_head_is_the_last_block_and_representation_stays_local(tmp_path: Path) -> None:
    s = _lg(tmp_path)
    assert s.head == HEAD
    state = s.init_state()
    first = s.plan(state, 1, [0], {})[0]
    assert set(first.tensors) == set(s._shapes)  # a device's first task: its starting representation
    device = _device(tmp_path, 0, 1)
    update = s.train(first, device)
    assert set(update.tensors) == set(HEAD)  # only the head goes up
    stored = device_state.load_latest(device.state_dir, STATE_PREFIX)
    assert stored is not None
    assert set(stored) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert not np.allclose(stored["fc1.weight"], state.arrays["fc1.weight"])  # trained locally
    # the server learns from the envelope's device id that device 0 now holds a representation
    update.device_id = 0
    state = s.finalize(state, s.reduce(Partial(), update), 1)
    assert state.meta["personal"] == [0]
    np.testing.assert_allclose(state.arrays["fc3.weight"], update.tensors["fc3.weight"].array)  # type: ignore[union-attr]
    tasks = s.plan(state, 2, [0, 1], {})
    assert set(tasks[0].tensors) == set(HEAD) and set(tasks[1].tensors) == set(s._shapes)
    # the next task trains on the stored representation, not the server's copy
    second = s.train(tasks[0], _device(tmp_path, 0, 2))
    again = device_state.load_latest(device.state_dir, STATE_PREFIX)
    assert again is not None and not np.allclose(again["fc1.weight"], stored["fc1.weight"])
    # a replayed round-2 task (client died before its update was confirmed) starts from the
    # round-1 representation again: same update, same stored state, local work not counted twice
    replay = s.train(tasks[0], _device(tmp_path, 0, 2))
    for k in HEAD:
        np.testing.assert_array_equal(replay.tensors[k].array, second.tensors[k].array)  # type: ignore[union-attr]
    after_replay = device_state.load_latest(device.state_dir, STATE_PREFIX)
    assert after_replay is not None
    np.testing.assert_array_equal(after_replay["fc1.weight"], again["fc1.weight"])
    ev = s.evaluate_device(s.plan_evaluation(state, [0], {})[0], _device(tmp_path, 0, 3))
    assert ev is not None and 0.0 <= ev["eval_accuracy"] <= 1.0 and ev["eval_samples"] == 10
    assert s.evaluate_device(s.plan_evaluation(state, [5], {})[5], _device(tmp_path, 5, 3)) is None


def test_warmup_rounds_are_fedavg_on_the_whole_model(tmp_path: Path) -> None:
    s = _lg(tmp_path, warmup_rounds=2)
    state = s.init_state()
    assert s.plan(state, 2, [0], {})[0].config["phase"] == 1  # rounds are numbered from 1
    task = s.plan(state, 1, [0], {})[0]
    assert task.config["phase"] == 1
    update = s.train(task, _device(tmp_path, 0, 1))
    assert set(update.tensors) == set(s._shapes)
    update.device_id = 0
    state = s.finalize(state, s.reduce(Partial(), update), 1)
    assert state.meta["personal"] == []  # a phase-1 upload does not make the representation personal
    assert s.plan(state, 3, [0], {})[0].config["phase"] == 2


def test_head_mean_is_sample_weighted_and_validation_rejects_the_representation(tmp_path: Path) -> None:
    s = _lg(tmp_path)
    a, b = _head_update(s, 1, 10), _head_update(s, 2, 30)
    out = s.finalize(s.init_state(), s.reduce(s.reduce(Partial(), a), b), 1).arrays
    want = (10 * a.tensors["fc3.bias"].array + 30 * b.tensors["fc3.bias"].array) / 40  # type: ignore[union-attr]
    np.testing.assert_allclose(out["fc3.bias"], want, rtol=1e-5)
    bad = _head_update(s, 3, 5)
    bad.tensors["fc2.bias"] = codec.Dense(np.zeros(8, np.float32))
    with pytest.raises(codec.CodecError):
        s.validate_update(bad)
    s.validate_update(_head_update(s, 4, 5))


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=2, max_size=6), st.randoms(use_true_random=False))
def test_reduction_is_associative(ns: list[int], rnd: Any) -> None:
    s = _lg(Path("/tmp"), "fedfleet-lg-prop.yaml")
    ups = [_head_update(s, i, n, dev=i) for i, n in enumerate(ns)]
    one, merged = reduce_two_ways(s, ups, rnd)
    state = s.init_state()
    f1, f2 = s.finalize(state, one, 1), s.finalize(state, merged, 1)
    assert f1.meta == f2.meta
    for k in f1.arrays:
        np.testing.assert_allclose(f1.arrays[k], f2.arrays[k], rtol=1e-6, atol=1e-7)


def test_end_to_end_personalised_accuracy_and_head_only_downlink(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(
            tmp_path / "lg.yaml",
            rounds=6,
            num_devices=6,
            devices_per_round=6,
            dataset={
                "name": "digits",
                "partition": "classes",
                "classes_per_device": 2,
                "train_limit": 600,
                "local_test_fraction": 0.3,
            },
            model=MODEL,
            algorithm={"name": "lgfedavg"},
            train={"local_epochs": 2, "batch_size": 16, "lr": 0.1, "momentum": 0.5},
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(cfg, run, f"lg-{uuid.uuid4().hex[:6]}") == 0
    rows = read_rounds(run)
    summary = json.loads((run / "summary.json").read_text())
    assert rows[-1]["accuracy"] > 0.8  # two classes per device: the personal models get them right
    assert rows[1]["bytes_down"] < rows[0]["bytes_down"] / 3  # after round 1 only heads go down
    assert rows[1]["bytes_up"] == pytest.approx(rows[0]["bytes_up"], rel=0.05)  # heads up every round
    assert summary["evaluated_devices"] == 6 and summary["personal_accuracy_mean"] > 0.8
