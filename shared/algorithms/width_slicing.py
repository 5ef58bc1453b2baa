"""The common base of every width-slice algorithm (HeteroFL, FedRolex, Federated Dropout, FjORD,
FedDSE).

:class:`WidthSliceStrategy` holds the four halves they share (capacity per device, slice download,
sub-model training, holder-mean aggregation); a subclass says *only* how it chooses the units
(:meth:`WidthSliceStrategy.choose`) and, for FedDSE, what it downloads. The machinery itself
(slicing, narrow models, scatter) is :mod:`shared.models.width_slice`; the options every member
takes are :class:`shared.models.width_slice.WidthOptions` (table in ``heterofl.py``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from shared import codec
from shared.algorithms.base import (
    DeviceContext,
    Fleet,
    Partial,
    ServerState,
    Strategy,
    StrategyContext,
    TaskSpec,
    UpdateSpec,
    derive_seed,
    typed_options,
)
from shared.algorithms.training import evaluate, local_sgd
from shared.models.state import load_arrays, model_arrays
from shared.models.width_slice import (
    Counts,
    Selection,
    WidthOptions,
    WidthStructure,
    sample_rate,
)

#: the optional update tensor listing the labels a device holds (``agg_classifier_by_label``)
LABELS = "labels"
#: server-state arrays: the last round in which each hidden unit was in some device's sub-model
LASTSEL = "lastsel/"


class LabelMask(nn.Module):
    """Zero the logits of classes absent from the device's data (HeteroFL code, spec §3.4 / §9.10)."""

    def __init__(self, present: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("absent", torch.from_numpy(~np.asarray(present, dtype=bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(self.absent, 0.0)  # type: ignore[arg-type]


class WidthSliceStrategy(Strategy):
    """Shared halves of the width-slice family; subclasses define :meth:`choose` (see module doc)."""

    Options = WidthOptions
    #: FedDSE and Federated Dropout must send their index sets; rule-based methods could send only r
    #: and t (spec §4.2). Only the paper-style byte count uses it: on the wire every method sends them.
    sends_indices: ClassVar[bool] = False
    #: FedDSE downloads the whole model (used by the paper-style byte count)
    downloads_full: ClassVar[bool] = False
    #: every member trains its sub-model through ``local_sgd`` (FjORD with a per-step hook)
    supports_local_steps = True
    #: holder means per coordinate: robust aggregation takes medians / trimmed means over the holders
    mean_form = "coordinate"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.opts = typed_options(ctx.options, WidthOptions)
        template = ctx.model_factory()
        if not isinstance(template, nn.Sequential):
            raise ValueError(f"{self.name} needs a sequential model (mlp, cnn_feddse, cnn_digits, ...)")
        self.template: nn.Sequential = template
        self.structure = WidthStructure(template, ctx.input_shape)
        self.full_params = self.structure.params(self.structure.widths())

    # -- capacity -------------------------------------------------------------------------------------
    def counts_for(self, rate: float) -> Counts:
        return self.structure.counts(rate, self.opts.rounding)

    def budget_rate(self, device: int, fleet: Fleet) -> float | None:
        """Largest rate of ``budget_grid`` whose training footprint fits the device's memory budget
        (None without a budget; the smallest rate if none fits, so admission refuses it visibly)."""
        info = fleet.get(device)
        budget = None if info is None else info.profile.get("memory_bytes")
        if budget is None:
            return None
        grid = sorted(self.opts.budget_grid)
        fitting = [r for r in grid if self.task_footprint(TaskSpec(config={"rate": r})).total <= int(budget)]
        return fitting[-1] if fitting else grid[0]

    def rate_for(self, device: int, round: int, fleet: Fleet) -> float:
        """The device's width ratio this round (deterministic in seed, round and device)."""
        o = self.opts
        if o.capacity == "budget":
            fit = self.budget_rate(device, fleet)
            if fit is not None:
                return fit
            info = fleet.get(device)
            return o.tier_rates.get(info.tier, o.fixed_rate) if info is not None else o.fixed_rate
        rng = np.random.default_rng(derive_seed(self.ctx.seed, "capacity", round, device) % (2**32))
        rate = sample_rate(o, rng)
        if o.cap_by_budget:
            fit = self.budget_rate(device, fleet)
            if fit is not None:
                rate = min(rate, fit)
        return rate

    # -- the rule ------------------------------------------------------------------------------------
    def choose(self, round: int, device: int, position: int, counts: Counts) -> Selection:
        """The index sets of ``device`` (the ``position``-th selected) in ``round``. HeteroFL: the
        first ``k_l`` units of every hidden layer (nested sub-models)."""
        return {h: np.arange(k, dtype=np.int64) for h, k in counts.items()}

    # -- server half ---------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        arrays = model_arrays(self.ctx.model_factory())
        for h in self.structure.hidden:
            arrays[LASTSEL + h] = np.zeros(self.structure.layers[h].units, dtype=np.int64)
        return ServerState(arrays, {})

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        # Devices with the same slice share one TaskSpec object: the server encodes it once.
        shared: dict[tuple[Any, ...], TaskSpec] = {}
        out: dict[int, TaskSpec] = {}
        for pos, dev in enumerate(devices):
            rate = self.rate_for(dev, round, fleet)
            sel = self.choose(round, dev, pos, self.counts_for(rate))
            key = (rate, *(sel[h].tobytes() for h in self.structure.hidden))
            if key not in shared:
                tensors: dict[str, codec.Tensor] = dict(self.structure.slice(state.arrays, sel))
                shared[key] = TaskSpec(tensors, {"rate": rate})
            out[dev] = shared[key]
        return out

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        """Holder mean per coordinate; coordinates no participant trained keep their value."""
        if partial is None:
            return state
        arrays = dict(state.arrays)
        for name in self.structure.shapes:
            total, count = partial.arrays.get(f"sum/{name}"), partial.arrays.get(f"count/{name}")
            if total is None or count is None:
                continue
            arrays[name] = self.structure.average(
                state.arrays[name], total, count, include_global=self.opts.agg_include_global
            )
        for h in self.structure.hidden:
            hit = partial.arrays.get(f"sel/{h}")
            if hit is not None:
                last = np.asarray(arrays[LASTSEL + h]).copy()
                last[hit > 0] = round
                arrays[LASTSEL + h] = last
        return ServerState(arrays, dict(state.meta))

    def coverage(self, state: ServerState, round: int, window: int = 20) -> float:
        """Fraction of hidden units in some device's sub-model during the last ``window`` rounds
        (spec C3: rich-get-richer lock-in shows as coverage well below 1)."""
        last = np.concatenate([np.asarray(state.arrays[LASTSEL + h]) for h in self.structure.hidden])
        return float(np.mean(last > round - window))

    def evaluate(self, state: ServerState, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        model = self.ctx.model_factory()
        load_arrays(model, state.arrays)
        return evaluate(model, x, y)

    # -- accounting ----------------------------------------------------------------------------------
    def task_rate(self, task: TaskSpec) -> float:
        return float(task.config.get("rate", 1.0))

    def task_model(self, task: TaskSpec) -> nn.Module:
        """The narrow model the device really trains (same shape whichever units were chosen)."""
        rate = self.task_rate(task)
        return self.structure.submodel(
            self.template, self.counts_for(rate), rate, fan_in_scaling=self.opts.fan_in_scaling
        )

    def accounting_key(self, task: TaskSpec) -> Hashable:
        return ("width", tuple(sorted(self.counts_for(self.task_rate(task)).items())))

    # -- client half ---------------------------------------------------------------------------------
    def task_selection(
        self, task: TaskSpec, device: DeviceContext
    ) -> tuple[Selection, dict[str, np.ndarray]]:
        """The units to train and their current weights. Baselines: both come in the slice payload."""
        sel = self.structure.selection_from_payload(task.tensors)
        compact = {
            k: codec.to_array(t) if not isinstance(t, codec.Sliced) else t.values
            for k, t in task.tensors.items()
        }
        return sel, compact

    def task_submodel(
        self, task: TaskSpec, device: DeviceContext
    ) -> tuple[float, Selection, Counts, nn.Sequential]:
        """The task's width, selection and unit counts, and the physically narrow sub-model loaded
        with the downloaded slice: what every width-slice method trains."""
        rate = self.task_rate(task)
        sel, compact = self.task_selection(task, device)
        counts = self.structure.selection_counts(sel)
        sub = self.structure.submodel(self.template, counts, rate, fan_in_scaling=self.opts.fan_in_scaling)
        self.structure.load_compact(sub, compact)
        return rate, sel, counts, sub

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        rate, sel, counts, sub = self.task_submodel(task, device)
        present = np.bincount(device.data.y_train, minlength=self.ctx.num_classes) > 0
        trained_model: nn.Module = nn.Sequential(sub, LabelMask(present)) if self.opts.label_mask else sub
        metrics = local_sgd(
            trained_model, device.data.x_train, device.data.y_train, self.ctx.train, device.seed
        )
        return self._upload(sub, sel, counts, rate, present, metrics, task, device)

    def _upload(
        self,
        sub: nn.Module,
        sel: Selection,
        counts: Counts,
        rate: float,
        present: np.ndarray,
        metrics: dict[str, float],
        task: TaskSpec,
        device: DeviceContext,
    ) -> UpdateSpec:
        """The trained sub-model as ``Sliced`` payloads, plus the per-device accounting metrics."""
        tensors: dict[str, codec.Tensor] = dict(self.structure.pack(self.structure.sub_arrays(sub), sel))
        if self.opts.agg_classifier_by_label:
            tensors[LABELS] = codec.Dense(present.astype(np.uint8))
        params = self.structure.params(counts)
        k_sum = sum(counts.values())
        metrics.update(
            rate=rate,
            density=params / self.full_params,
            density_linear=self.structure.params_linear(rate) / self.full_params,
            # the spec's §4.2 byte model (float32 values, int32 indices where the method needs them)
            paper_bytes_up=float(4 * params + (4 * k_sum if self.sends_indices else 0)),
            paper_bytes_down=float(4 * (self.full_params if self.downloads_full else params)),
            **self.extra_metrics(task, device),
        )
        return UpdateSpec(tensors, num_samples=len(device.data.y_train), metrics=metrics)

    def extra_metrics(self, task: TaskSpec, device: DeviceContext) -> dict[str, float]:
        return {}

    # -- aggregation half ----------------------------------------------------------------------------
    def validate_update(self, update: UpdateSpec) -> None:
        tensors = dict(update.tensors)
        labels = tensors.pop(LABELS, None)
        if self.opts.agg_classifier_by_label:
            if not isinstance(labels, codec.Dense) or labels.array.shape != (self.ctx.num_classes,):
                raise codec.CodecError(
                    "tensor", f"{LABELS}: expected a dense vector of {self.ctx.num_classes}"
                )
        elif labels is not None:
            raise codec.CodecError("tensor", f"unexpected {LABELS} tensor")
        self.structure.selection_from_payload(tensors)
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """Per-coordinate sums of ``p_n·w_n`` and counts of ``p_n`` over the coordinates in device n's
        sub-model, plus which hidden units it held. All plain float64 sums: associative and
        commutative, so any split over aggregators gives the same answer."""
        tensors = dict(update.tensors)
        labels = tensors.pop(LABELS, None)
        sel = self.structure.selection_from_payload(tensors)
        p = 1.0 if self.opts.weighting == "uniform" else float(update.num_samples)
        sums, counts = self.structure.scatter(tensors, p)
        if self.opts.agg_classifier_by_label and isinstance(labels, codec.Dense):
            held = np.asarray(labels.array, dtype=np.float64) > 0
            last = next(n for n, layer in self.structure.layers.items() if not layer.hidden)
            for k in sums:
                if k.rsplit(".", 1)[0] == last:
                    sums[k][~held] = 0.0
                    counts[k][~held] = 0.0
        arrays: dict[str, np.ndarray] = {}
        for k in sums:
            arrays[f"sum/{k}"] = sums[k]
            arrays[f"count/{k}"] = counts[k]
        for h in self.structure.hidden:
            ind = np.zeros(self.structure.layers[h].units, dtype=np.float64)
            ind[sel[h]] = 1.0
            arrays[f"sel/{h}"] = ind
        return partial.add(Partial(arrays, {"updates": 1.0}))
