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
