"""FedDSE: distribution-aware sub-model extraction (spec ``docs/algorithms/feddse.md``).

A device of width ratio ``r`` downloads the **whole** global model, runs inference only on its local
data to score every hidden unit by its mean post-ReLU activation (one full-model forward pass, layer
by layer), keeps the top ``k_l = max(1, floor(r·m_l))`` units per hidden layer (hard top-k at
``T = 0``, or ``k_l`` draws without replacement from ``softmax(s/T)``), trains only that sub-model
and uploads only the sub-model (``Sliced``: its index sets + the dense block). The server averages
each coordinate over the devices whose sub-models contain it (:class:`WidthSliceStrategy`).

Why data-aware: under label skew different clients strongly activate different units; giving a
client the units its data already uses avoids re-fitting units tied to other clients' classes
(spec §1). The price: a full download and an extra forward pass per round (spec §4.1).

Options: everything of :class:`shared.models.width_slice.WidthOptions` (capacity, rounding,
aggregation variants; see ``heterofl.py``) plus

* ``temperature`` (T, default 0 = hard top-k, Table 1) and ``selection``: ``softmax`` (the paper:
  ``p ∝ exp(s/T)``) or ``proportional`` (the authors' code's ``probs`` mode: ``p ∝ |s|``, T unused);
* ``standardize_scores``: z-score the scores per layer before ``/T`` (a scale-free T, spec §9.1);
* ``inference_size``: score on a random subset of this many local samples (None = all, Table 3).

Scores are **means** over samples and positions (not the code's sums), so ``T`` has a fixed scale
(spec §9.1). Index sets are sorted ascending before slicing (spec §3.2), which is also what makes
r = 1 bit-for-bit the full model.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field
from torch import nn

from shared import codec
from shared.algorithms.base import (
    DeviceContext,
    Fleet,
    ServerState,
    TaskSpec,
    derive_seed,
    load_arrays,
    model_arrays,
    typed_options,
)
from shared.algorithms.width_slicing import WidthSliceStrategy
from shared.models.width_slice import Counts, Selection, WidthOptions, unit_scores


class FedDSEOptions(WidthOptions):
    #: T of the unit selection: 0 = the k highest-scoring units (Table 1), > 0 = k draws without
    #: replacement from softmax(scores / T)
    temperature: float = Field(0.0, ge=0)
    #: ``softmax`` (the paper: p ∝ exp(s/T)) or ``proportional`` (the authors' code: p ∝ |s|, T unused)
    selection: Literal["softmax", "proportional"] = "softmax"
    #: z-score the scores per layer before dividing by T (a scale-free T, spec §9.1)
    standardize_scores: bool = False
    #: score on a random subset of this many local samples (None = all of them, Table 3)
    inference_size: int | None = Field(None, ge=1)


def select_units(
    scores: np.ndarray,
    k: int,
    rng: np.random.Generator,
    *,
    temperature: float = 0.0,
    selection: Literal["softmax", "proportional"] = "softmax",
    standardize: bool = False,
) -> np.ndarray:
    """Sorted indices of ``k`` units chosen from ``scores`` (spec §3.2).

    * softmax, T = 0: the ``k`` largest (ties to the lower index, so dead units fill in order);
    * softmax, T > 0: ``k`` draws without replacement from ``softmax(s/T)``, done as the top-k of
      ``s/T + Gumbel`` (the Gumbel-top-k trick, exactly sequential sampling without replacement);
    * proportional: the same with ``log |s|`` as logits, i.e. ``p ∝ |s|``; zero-score units come
      last, in random order.
    """
    s = np.asarray(scores, dtype=np.float64)
    m = len(s)
    if selection == "softmax" and temperature == 0.0:
        return np.sort(np.argsort(-s, kind="stable")[:k]).astype(np.int64)
    g = rng.gumbel(size=m)
    if selection == "softmax":
        if standardize:
            s = (s - s.mean()) / (s.std() + 1e-12)
        keys = s / temperature + g
        return np.sort(np.argsort(-keys, kind="stable")[:k]).astype(np.int64)
    a = np.abs(s)
    positive = a > 0
    keys = np.where(positive, np.log(np.where(positive, a, 1.0)) + g, -np.inf)
    order = np.argsort(-keys, kind="stable")
    n_pos = int(positive.sum())
    zeros = order[n_pos:]
    order = np.concatenate([order[:n_pos], rng.permutation(zeros)])
    return np.sort(order[:k]).astype(np.int64)


class FedDSE(WidthSliceStrategy):
    name = "feddse"
    Options = FedDSEOptions
    sends_indices: ClassVar[bool] = True
    downloads_full: ClassVar[bool] = True

    @property
    def dse(self) -> FedDSEOptions:
        return typed_options(self.opts, FedDSEOptions)

    def choose(self, round: int, device: int, position: int, counts: Counts) -> Selection:
        raise NotImplementedError("FedDSE chooses its units on the device (train), not on the server")

    # -- server half: the full model down, plus r ----------------------------------------------------
    def _n_inf(self, num_samples: int) -> int:
        n = self.dse.inference_size
        return num_samples if n is None else min(n, num_samples)

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        dense: dict[str, codec.Tensor] = {k: codec.Dense(state.arrays[k]) for k in self.structure.shapes}
        shared: dict[float, TaskSpec] = {}
        out: dict[int, TaskSpec] = {}
        for dev in devices:
            # The paper assumes full-model inference fits wherever the sub-model trains (§4.1); it
            # need not: ``task_extra_peak`` makes the device's admission check the scoring pass too.
            rate = self.rate_for(dev, round, fleet)
            if rate not in shared:
                shared[rate] = TaskSpec(dense, {"rate": rate})
            out[dev] = shared[rate]
        return out

    # -- client half: score, select, slice locally ---------------------------------------------------
    def task_selection(
        self, task: TaskSpec, device: DeviceContext
    ) -> tuple[Selection, dict[str, np.ndarray]]:
        if set(task.tensors) != set(self.structure.shapes):
            raise codec.CodecError("tensor", "feddse tasks carry the full model")
        full = self.ctx.model_factory()
        assert isinstance(full, nn.Sequential), "width slicing checked the model at start"
        arrays = model_arrays(full)
        arrays.update({k: codec.to_array(t) for k, t in task.tensors.items()})
        load_arrays(full, arrays)
        x = device.data.x_train
        rng = np.random.default_rng(
            derive_seed(self.ctx.seed, "feddse-select", device.round, device.device_id) % (2**32)
        )
        n_inf = self._n_inf(len(x))
        if n_inf < len(x):
            x = x[np.sort(rng.choice(len(x), size=n_inf, replace=False))]
        scores = unit_scores(full, self.structure, x)
        counts = self.counts_for(self.task_rate(task))
        o = self.dse
        sel = {
            h: select_units(
                scores[h],
                counts[h],
                rng,
                temperature=o.temperature,
                selection=o.selection,
                standardize=o.standardize_scores,
            )
            for h in self.structure.hidden
        }
        return sel, self.structure.compact(arrays, sel)

    def extra_metrics(self, task: TaskSpec, device: DeviceContext) -> dict[str, float]:
        n_inf = self._n_inf(len(device.data.y_train))
        return {
            "extract_bytes": float(self.structure.extraction_bytes(n_inf)),
            "extract_flops": float(2 * self.structure.forward_macs(self.structure.widths()) * n_inf),
        }

    def task_extra_peak(self, task: TaskSpec, num_samples: int) -> tuple[str, int] | None:
        """The scoring pass (spec §4.2 ``Mem_extract``): the full model plus its live activations
        over the whole inference set. Admission refuses a device it does not fit (the paper assumes
        it always fits, §4.1)."""
        return "full-model scoring pass", self.structure.extraction_bytes(self._n_inf(num_samples))

    def task_flops(self, task: TaskSpec, num_samples: int) -> int:
        """Training FLOPs of the sub-model plus the extraction pass (full-model forward on the
        inference set, spec §4.2 ``ExtractMACs``)."""
        extract = 2 * self.structure.forward_macs(self.structure.widths()) * self._n_inf(num_samples)
        return super().task_flops(task, num_samples) + extract
