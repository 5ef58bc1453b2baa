"""A model's state described without torch: the names, shapes and dtypes of its arrays.

Why: an aggregator only adds arrays. To check an update's names and shapes it needs the model's
*layout*, not the model, and importing torch to build one costs every aggregator process hundreds
of MiB (issue 16, lean processes). The layout is computed once by a short-lived child process that
does import torch (``python -m shared.statespec``), cached on disk under the fedfleet cache directory
keyed by the model's config and the model code, and read back by every later process as JSON.

Run as a module, it prints the layout of the model described by its JSON argument.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.cache import cache_dir

_MODELS_DIR = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class StateSpec:
    """The arrays of a model's state (parameters and buffers) in their stable order."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> StateSpec:
        return cls(tuple((k, tuple(int(d) for d in v.shape), v.dtype.str) for k, v in arrays.items()))

    def shapes(self, *, floats_only: bool = False) -> dict[str, tuple[int, ...]]:
        """Name → shape (only the floating-point arrays, which are the ones that train and travel)."""
        return {k: s for k, s, dt in self.entries if not floats_only or np.dtype(dt).kind == "f"}

    def to_json(self) -> str:
        return json.dumps([[k, list(s), dt] for k, s, dt in self.entries])

    @classmethod
    def from_json(cls, text: str) -> StateSpec:
        return cls(tuple((str(k), tuple(int(d) for d in s), str(dt)) for k, s, dt in json.loads(text)))


def _model_code_digest() -> str:
    """A digest of the model code: a layout cached by an older version of it is not reused."""
    h = hashlib.sha256()
    for path in sorted(_MODELS_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def describe(
    model: str, options: Mapping[str, Any], input_shape: tuple[int, ...], num_classes: int
) -> StateSpec:
    """The layout of a model (building it, so this imports torch): what the child process runs."""
    from shared.models import build_model
    from shared.models.state import model_arrays

    built = build_model(model, tuple(input_shape), num_classes, **dict(options))
    return StateSpec.of(model_arrays(built))


def state_spec(
    model: str, options: Mapping[str, Any], input_shape: tuple[int, ...], num_classes: int
) -> StateSpec:
    """The model's layout without importing torch in this process: from the cache, else from a child
    process (written to the cache for the next process; a cache that cannot be written is skipped)."""
    request = {
        "model": model,
        "options": dict(options),
        "input_shape": [int(d) for d in input_shape],
        "num_classes": int(num_classes),
    }
    key = hashlib.sha256((json.dumps(request, sort_keys=True) + _model_code_digest()).encode()).hexdigest()
    path = cache_dir() / "state-spec" / f"{key[:32]}.json"
    try:
        return StateSpec.from_json(path.read_text())
    except (OSError, ValueError):
        pass
    out = subprocess.run(
        [sys.executable, "-m", "shared.statespec", json.dumps(request)],
        capture_output=True,
        text=True,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(_MODELS_DIR.parents[1]), os.environ.get("PYTHONPATH")])
            ),
        },
    )
    if out.returncode != 0:
        raise RuntimeError(f"could not describe model {model!r}: {out.stderr.strip()[-2000:]}")
    spec = StateSpec.from_json(out.stdout)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            tmp.write(spec.to_json())
        os.replace(tmp.name, path)  # atomic: processes starting together never read half a file
    except OSError:
        pass
    return spec


if __name__ == "__main__":
    req = json.loads(sys.argv[1])
    print(describe(req["model"], req["options"], tuple(req["input_shape"]), req["num_classes"]).to_json())
