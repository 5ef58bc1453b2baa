"""A model's state as numpy arrays and back: what travels in tasks and updates and sits in checkpoints.

Why numpy: payloads, partials and checkpoints are plain arrays (the codec, msgpack and ``.npz`` know
nothing of torch), so every algorithm converts at the edge of its training code with these two.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A model's state (parameters and buffers) as float32 numpy arrays, in a stable order."""
    out = {}
    for name, t in model.state_dict().items():
        arr = t.detach().cpu().numpy()
        out[name] = arr.astype(np.float32) if arr.dtype.kind == "f" else arr.copy()
    return out


def load_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    sd = model.state_dict()
    missing = set(sd) - set(arrays)
    if missing:
        raise KeyError(f"missing tensors for {sorted(missing)[:5]}")
    model.load_state_dict(
        {k: torch.from_numpy(np.array(arrays[k], dtype=sd[k].numpy().dtype, copy=True)) for k in sd}
    )


def copy_into(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """``load_arrays`` without rebuilding the state dict: every parameter and buffer is overwritten
    in place. Why: a client reuses one model object for all its devices, and ``load_state_dict``
    (key matching, hooks, a copy per tensor) cost a fifth of a small device's whole task."""
    sd = model.state_dict()
    missing = set(sd) - set(arrays)
    if missing:
        raise KeyError(f"missing tensors for {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, t in sd.items():
            src = np.asarray(arrays[name])
            if src.shape != tuple(t.shape):
                raise ValueError(f"{name}: shape {src.shape} does not fit {tuple(t.shape)}")
            if not src.flags.writeable:  # a decoded payload is a read-only view; torch wants writeable
                src = src.copy()
            t.copy_(torch.from_numpy(src))
