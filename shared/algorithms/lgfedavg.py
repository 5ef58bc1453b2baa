"""LG-FedAvg (Liang et al., 2020): local representation layers, a global head — a Hermes baseline.

Spec: ``docs/algorithms/hermes.md`` §7 ("split the model into local layers (the first several, the
representation) and global layers (the last several). Phase 1: FedAvg on the whole model. Phase 2: all
layers train locally but only the global layers are uploaded and averaged").

Why it is here: it is the personalised baseline Hermes is compared with, and the mirror image of
EmbracingFL's split (EmbracingFL synchronises the output side and lets weak devices freeze the input
side; LG-FedAvg keeps the input side personal). Blocks are the cut-safe units of
:mod:`shared.models.partial_training`; the last ``global_blocks`` of them are the global head.

* **server** — the global model; ``plan`` sends the head only to devices that already hold their
  own representation (recorded in ``meta["personal"]`` from the device ids the aggregators saw), and the
  whole model to a device's first task (its starting representation) and to everyone during the
  ``warmup_rounds`` of phase 1; ``finalize`` averages each uploaded tensor over its uploaders
  (sample-weighted, as FedAvg, by default).
* **client** — ``train``: local representation (``state_dir``, one file per round via
  :mod:`shared.algorithms.device_state`, so a replayed task starts from the same representation) +
  downloaded head,
  ``train.local_epochs`` (or ``train.local_steps``) of SGD on the whole model, representation saved
  back, head uploaded; accuracy on the device's own test split before (``eval_accuracy_before``:
  stored representation + downloaded head) and after local training (``eval_accuracy``, the model
  the device holds).
* **all-device evaluation** — ``plan_evaluation`` sends the final head; ``evaluate_device`` scores the
  device's representation with it (the paper's LG-FedAvg test model).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from shared import codec
from shared.algorithms import device_state
from shared.algorithms.base import (
    DeviceContext,
    Fleet,
    Partial,
    ServerState,
    Strategy,
    StrategyContext,
    TaskSpec,
    UpdateSpec,
    load_arrays,
    model_arrays,
    typed_options,
)
from shared.algorithms.training import evaluate, local_sgd
from shared.models.partial_training import LayerSplit

#: the device's representation: ``lgfedavg-<round>.npz`` in its ``state_dir``
STATE_PREFIX = "lgfedavg"


class LGFedAvgOptions(BaseModel):
    """``algorithm.options`` of LG-FedAvg."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: output-side blocks that are global (averaged); the others stay on the device
    global_blocks: int = Field(1, ge=1)
    #: phase 1: rounds of plain FedAvg on the whole model before the representation goes local
    warmup_rounds: int = Field(0, ge=0)
    #: samples = FedAvg's n_k weights (LG-FedAvg's choice); uniform = 1 per device
    weighting: Literal["samples", "uniform"] = "samples"


class LGFedAvg(Strategy):
    name = "lgfedavg"
    supports_local_steps = True
    Options = LGFedAvgOptions
    personalised = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.opts = typed_options(ctx.options, LGFedAvgOptions)
        self.split = LayerSplit(ctx.model_factory(), ctx.input_shape)
        if self.opts.global_blocks >= self.split.num_blocks:
            raise ValueError(
                f"lgfedavg: global_blocks={self.opts.global_blocks} leaves no local layer "
                f"(the model has {self.split.num_blocks} blocks)"
            )

    @cached_property
    def head(self) -> list[str]:
        """Float state names of the global head."""
        return self.split.suffix_state(self.split.num_blocks - self.opts.global_blocks + 1)

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in model_arrays(self.ctx.model_factory()).items() if v.dtype.kind == "f"}

    # -- server half -----------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        return ServerState(model_arrays(self.ctx.model_factory()), {"personal": []})

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        warm = round <= self.opts.warmup_rounds  # the server numbers rounds from 1
        personal = set(state.meta.get("personal", []))
        full = TaskSpec({k: codec.Dense(state.arrays[k]) for k in self._shapes}, {"phase": 1 if warm else 2})
        head = TaskSpec({k: codec.Dense(state.arrays[k]) for k in self.head}, {"phase": 2})
        return {dev: head if (dev in personal and not warm) else full for dev in devices}

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        if partial is None:
            return state
        arrays = dict(state.arrays)
        for name in self._shapes:
            total, count = partial.arrays.get(f"sum/{name}"), partial.arrays.get(f"count/{name}")
            if total is None or count is None or count[0] <= 0:
                continue
            arrays[name] = (total / count[0]).astype(state.arrays[name].dtype)
        personal = set(state.meta.get("personal", []))
        personal |= {int(k.split("/", 1)[1]) for k in partial.arrays if k.startswith("local/")}
        return ServerState(arrays, {**state.meta, "personal": sorted(personal)})

    def plan_evaluation(self, state: ServerState, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        return self.plan(state, self.opts.warmup_rounds + 1, devices, fleet)

    # -- client half -----------------------------------------------------------------------------------
    def _model(self, task: TaskSpec, device: DeviceContext, *, latest: bool = False) -> tuple[Any, bool]:
        """The device's model: its stored representation (if any) + the task's tensors on top of the
        initial model. Returns (model, had_local_state).

        Training starts from the representation saved before the task's round (a replayed task must
        not start from its own first run's result); ``latest`` takes the newest one (evaluation).
        """
        model = self.ctx.model_factory()
        arrays = model_arrays(model)
        if latest:
            saved = device_state.load_latest(device.state_dir, STATE_PREFIX)
        else:
            saved = device_state.load_before(device.state_dir, STATE_PREFIX, device.round)
        stored = saved is not None
        if saved is not None:
            arrays.update(saved)
        # The server sends the representation only to devices it does not count as holding one
        # (phase 1, or a device's first phase-2 task), so whatever the task carries wins.
        for name, t in task.tensors.items():
            arrays[name] = codec.to_array(t)
        load_arrays(model, arrays)
        return model, stored

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        model, stored = self._model(task, device)
        data = device.data
        before = evaluate(model, data.x_test, data.y_test)
        metrics = local_sgd(model, data.x_train, data.y_train, self.ctx.train, device.seed)
        after = evaluate(model, data.x_test, data.y_test)
        trained = model_arrays(model)
        # the representation stays here; non-float buffers (BN counters) too
        representation = {k: v for k, v in trained.items() if k not in self.head}
        device_state.save(device.state_dir, STATE_PREFIX, device.round, representation)
        phase = int(task.config.get("phase", 2))
        names = list(self._shapes) if phase == 1 else self.head
        metrics.update(
            eval_accuracy=after["accuracy"],
            eval_loss=after["loss"],
            eval_samples=float(len(data.y_test)),
            eval_accuracy_before=before["accuracy"],
            had_local_state=float(stored),
            up_params=float(sum(trained[k].size for k in names)),
        )
        return UpdateSpec({k: codec.Dense(trained[k]) for k in names}, len(data.y_train), metrics)

    def evaluate_device(self, task: TaskSpec, device: DeviceContext) -> dict[str, float] | None:
        """The device's representation with the final global head, on its own test split."""
        model, stored = self._model(task, device, latest=True)
        if not stored:
            return None  # never participated: it has no personal model
        ev = evaluate(model, device.data.x_test, device.data.y_test)
        return {
            "eval_accuracy": ev["accuracy"],
            "eval_loss": ev["loss"],
            "eval_samples": float(len(device.data.y_test)),
        }

    # -- aggregation half ------------------------------------------------------------------------------
    def validate_update(self, update: UpdateSpec) -> None:
        names = set(update.tensors)
        if names != set(self.head) and names != set(self._shapes):
            raise codec.CodecError(
                "tensor", f"update names {sorted(names)[:4]}... are neither the head nor the model"
            )
        for k, t in update.tensors.items():
            if not isinstance(t, codec.Dense) or t.array.shape != self._shapes[k]:
                raise codec.CodecError("tensor", f"{k}: expected dense {self._shapes[k]}")
            if not np.all(np.isfinite(t.array)):
                raise codec.CodecError("tensor", f"{k}: non-finite values")
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """Weighted sums and weights per uploaded tensor, plus — for a phase-2 (head-only) upload — a
        marker for the uploading device, taken from the envelope (``update.device_id``), not from a
        tensor: from now on it holds its own representation and gets the head only."""
        w = float(update.num_samples) if self.opts.weighting == "samples" else 1.0
        arrays: dict[str, np.ndarray] = {}
        for name, t in update.tensors.items():
            assert isinstance(t, codec.Dense)
            arrays[f"sum/{name}"] = w * np.asarray(t.array, dtype=np.float64)
            arrays[f"count/{name}"] = np.array([w])
        if update.device_id is not None and set(update.tensors) == set(self.head):
            arrays[f"local/{update.device_id}"] = np.ones(1)
        return partial.add(Partial(arrays, {"updates": 1.0}))
