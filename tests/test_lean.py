"""Lean processes (issue 16): what each process holds, checked by what it imports and keeps.

An aggregator only adds arrays, so it must not import torch (hundreds of MiB per process); the checks
run in a fresh interpreter, since this test process has long imported torch itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shared.config import load_config
from shared.experiment import Experiment

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _python(code: str, cache: Path) -> str:
    """Run ``code`` in a fresh interpreter (this repository on its path, ``cache`` as the fedfleet
    cache) and return what it printed."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "FEDFLEET_CACHE_DIR": str(cache),
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_the_aggregator_imports_no_torch(tmp_path: Path) -> None:
    out = _python(
        """
        import sys
        import services.aggregator.service
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """,
        tmp_path,
    )
    assert out.strip() == "[]"


def test_a_fedavg_aggregator_builds_and_reduces_without_torch(tmp_path: Path) -> None:
    """What ``fedfleet aggregator`` builds (``services.cli._aggregation``) for FedAvg: a strategy that
    validates and reduces a model-shaped update, with torch never imported in that process."""
    out = _python(
        f"""
        import json, sys
        import numpy as np
        from services.aggregator.service import registered_samples
        from services.cli import _aggregation
        from shared import codec
        from shared.algorithms.base import Partial, UpdateSpec
        from shared.config import load_config

        exp, strategy = _aggregation(load_config({str(QUICKSTART)!r}), "quickstart")
        shapes = strategy.ctx.layout().shapes(floats_only=True)
        update = UpdateSpec({{k: codec.Dense(np.ones(s, np.float32)) for k, s in shapes.items()}}, 3)
        strategy.validate_update(update)
        partial = strategy.reduce(Partial(), update)
        print(json.dumps({{
            "torch": "torch" in sys.modules,
            "shapes": {{k: list(s) for k, s in shapes.items()}},
            "weight": partial.scalars["weight"],
            "sum": float(sum(a.sum() for a in partial.arrays.values())),
            "limits": len(registered_samples(exp)),
        }}))
        """,
        tmp_path,
    )
    got = json.loads(out)
    assert got["torch"] is False
    # the same layout as the model the other processes build with torch
    full = Experiment.build(load_config(QUICKSTART)).strategy.ctx.layout().shapes(floats_only=True)
    assert {k: tuple(s) for k, s in got["shapes"].items()} == full
    assert got["weight"] == 3.0
    assert got["sum"] == pytest.approx(3.0 * sum(int(np.prod(s)) for s in full.values()))
    assert got["limits"] == 20
    assert list((tmp_path / "state-spec").glob("*.json")), "the layout is cached for the next process"


def test_an_aggregation_only_strategy_refuses_to_build_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDFLEET_CACHE_DIR", str(tmp_path))
    strategy = Experiment.build(load_config(QUICKSTART)).aggregation_strategy
    with pytest.raises(RuntimeError, match="aggregation only"):
        strategy.ctx.model_factory()
