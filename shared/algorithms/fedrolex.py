"""FedRolex (Alam et al., NeurIPS '22): a rolling window of units, the same for every device in a round.

Spec: ``docs/algorithms/feddse.md`` §7. Device n of width ratio r trains the ``k_l`` consecutive
units starting at offset ``s`` (wrapping around) of every hidden layer; the offset advances by
``roll_step`` per round, so over ``m_l`` rounds every unit is trained by every capacity level — the
coverage HeteroFL lacks. The slice goes down and comes back; the server takes the holder mean.

Options: everything of :class:`shared.models.width_slice.WidthOptions` (see ``heterofl.py``) plus

* ``roll``: ``round`` (the FedRolex code: one offset per round for all devices, the default) or
  ``client`` (the FedDSE authors' re-implementation, which advances the offset per client served:
  offset = (t-1)·K + position in the round's selection);
* ``roll_step``: units the window moves per step (1 in both codes).

``np.roll(arange(m), s)[:k]`` in the original picks the window ending at ``m - s``; we start it at
``s``. It is the same family of windows traversed in the other direction.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from shared.algorithms.base import Fleet, ServerState, TaskSpec, typed_options
from shared.algorithms.width_slicing import WidthSliceStrategy
from shared.models.width_slice import Counts, Selection, WidthOptions


class FedRolexOptions(WidthOptions):
    #: ``round``: one window offset per round for all devices (the FedRolex code); ``client``: the
    #: offset advances per device served, (t-1)·K + its position (the FedDSE authors' re-implementation)
    roll: Literal["round", "client"] = "round"
    #: units the window moves per step (1 in both codes)
    roll_step: int = Field(1, ge=1)


class FedRolex(WidthSliceStrategy):
    name = "fedrolex"
    Options = FedRolexOptions

    def choose(self, round: int, device: int, position: int, counts: Counts) -> Selection:
        o = typed_options(self.opts, FedRolexOptions)
        steps = (round - 1) if o.roll == "round" else (round - 1) * self._planned + position
        out: Selection = {}
        for h, k in counts.items():
            m = self.structure.layers[h].units
            start = (steps * o.roll_step) % m
            out[h] = np.sort((start + np.arange(k, dtype=np.int64)) % m)
        return out

    #: K of the per-client roll: the number of devices planned in the current round
    _planned: int = 1

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        self._planned = max(1, len(devices))
        return super().plan(state, round, devices, fleet)
