"""After the last round, a personalised algorithm evaluates *every* device's own model, not just the
last round's participants (the papers' mean over all devices)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from services.orchestrator import run_inproc
from shared.config import load_config
from tests.conftest import write_config


def _spafl(tmp_path: Path, name: str) -> Path:
    return write_config(
        tmp_path / f"{name}.yaml",
        name=name,
        rounds=3,
        num_devices=8,
        devices_per_round=3,
        dataset={"name": "digits", "partition": "iid", "train_limit": 800, "local_test_fraction": 0.25},
        model={"name": "mlp", "options": {"hidden": [64], "bias": False}},
        algorithm={"name": "spafl", "options": {"alpha": 0.001}},
        train={"local_epochs": 10, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    )


def test_every_device_is_evaluated_after_the_last_round(tmp_path: Path) -> None:
    cfg = load_config(_spafl(tmp_path, "pe"))
    run = tmp_path / "run"
    run.mkdir()
    exp_id = f"pe-{tmp_path.name}"
    assert run_inproc(cfg, run, exp_id) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evaluated_devices"] == 8  # all of them, though only 3 trained per round
    devices = list(csv.DictReader((run / "devices.csv").open()))
    accs = [float(d["eval_accuracy"]) for d in devices]
    assert len(accs) == 8 and all(0.0 <= a <= 1.0 for a in accs)
    assert summary["personal_accuracy_mean"] == pytest.approx(np.mean(accs), abs=1e-6)
    assert summary["personal_accuracy_best"] == pytest.approx(max(accs), abs=1e-6)
    # devices that never trained still hold w(0): their accuracy is near chance, trained ones are not
    never = [float(d["eval_accuracy"]) for d in devices if int(d["completed"]) == 0]
    trained = [float(d["eval_accuracy"]) for d in devices if int(d["completed"]) > 0]
    assert trained and max(trained) > 0.3
    if never:
        assert np.mean(trained) > np.mean(never)

    # evaluation traffic is its own direction: training byte counts are untouched by it
    def device_bytes(direction: str) -> float:
        tiers = {d["tier"] for d in devices}
        labels = {"experiment": exp_id, "algorithm": "spafl", "direction": direction}
        return sum(
            REGISTRY.get_sample_value("fedfleet_device_bytes_total", {**labels, "tier": t}) or 0.0
            for t in tiers
        )

    assert device_bytes("eval_down") == summary["bytes_eval_down"] > 0
    assert device_bytes("down") == summary["bytes_down"] > 0
    # what crossed the broker for the evaluation is its own kind too, and no more than what the
    # devices were charged (a payload shared by several of them travels once per host)
    wire = REGISTRY.get_sample_value(
        "fedfleet_wire_bytes_total",
        {
            "experiment": exp_id,
            "algorithm": "spafl",
            "service": "server",
            "direction": "down",
            "kind": "evaluate",
        },
    )
    assert wire is not None and 0 < wire <= summary["bytes_eval_down"]


def test_dense_algorithms_skip_the_device_evaluation(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "c.yaml", rounds=2))
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(cfg, run, f"fa-{tmp_path.name}") == 0
    summary = json.loads((run / "summary.json").read_text())
    assert "evaluated_devices" not in summary


def test_a_diverged_personal_model_is_still_evaluated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose personal model diverged (NaN loss, as SpaFL's at lr 0.05 on Fashion-MNIST) still
    reports its accuracy: the non-finite loss is left out, not the device (the wire refuses NaN, and
    before this the client's handler failed and the evaluation task was dead-lettered)."""
    from shared.algorithms.spafl import SpaFL

    original = SpaFL.evaluate_device

    def diverged(self: SpaFL, task: Any, device: Any) -> dict[str, float] | None:
        result = original(self, task, device)
        if result is not None and device.device_id == 0:
            result["eval_loss"] = float("nan")
        return result

    monkeypatch.setattr(SpaFL, "evaluate_device", diverged)
    cfg = load_config(_spafl(tmp_path, "nan"))
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(cfg, run, f"nan-{tmp_path.name}") == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evaluated_devices"] == 8
    assert summary.get("dead_lettered", 0) == 0, summary.get("dead_letter_reasons")
    devices = {int(d["device_id"]): d for d in csv.DictReader((run / "devices.csv").open())}
    assert 0.0 <= float(devices[0]["eval_accuracy"]) <= 1.0
