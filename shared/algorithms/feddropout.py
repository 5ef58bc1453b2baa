"""Federated Dropout (Caldas et al., 2018): a uniformly random set of units per device and round.

Spec: ``docs/algorithms/feddse.md`` §7. For every hidden layer, ``k_l`` units are drawn without
replacement, independently per device, round and layer (the FedDSE authors' code:
``torch.randperm(m)[:k]``); the draw is keyed by (seed, round, device) so every process agrees. The
slice goes down and comes back with its index sets; the server takes the holder mean.

Options: those of :class:`shared.models.width_slice.WidthOptions` (see ``heterofl.py``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from shared.algorithms.base import derive_seed
from shared.algorithms.width_slicing import WidthSliceStrategy
from shared.models.width_slice import Counts, Selection


class FedDropout(WidthSliceStrategy):
    name = "feddropout"
    sends_indices: ClassVar[bool] = True

    def choose(self, round: int, device: int, position: int, counts: Counts) -> Selection:
        rng = np.random.default_rng(derive_seed(self.ctx.seed, "feddropout", round, device) % (2**32))
        return {
            h: np.sort(rng.choice(self.structure.layers[h].units, size=k, replace=False)).astype(np.int64)
            for h, k in counts.items()
        }
