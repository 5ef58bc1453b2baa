"""FedAvg (McMahan et al., 2017): every device trains the whole model; the server takes the
sample-weighted mean.

It is the baseline every paper in ``docs/algorithms/`` compares against, and the simplest instance of
the strategy interface: dense weights down, dense weights up, a weighted sum as the partial.
Integer buffers (BatchNorm's ``num_batches_tracked``) stay on the server and are not averaged.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from shared import codec
from shared.algorithms.base import (
    DeviceContext,
    Fleet,
    Partial,
    ServerState,
    Strategy,
    TaskSpec,
    UpdateSpec,
    load_arrays,
    model_arrays,
)


class FedAvg(Strategy):
    name = "fedavg"
    supports_local_steps = True
    mean_form = "whole"
    aggregates_from_layout = True

    # -- server half -------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        return ServerState(model_arrays(self.ctx.model_factory()))

    def _float_names(self, state: ServerState) -> list[str]:
        return [k for k, v in state.arrays.items() if v.dtype.kind == "f"]

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        # One TaskSpec object for everyone: the server encodes it once and reuses the bytes.
        task = TaskSpec({k: codec.Dense(state.arrays[k]) for k in self._float_names(state)})
        return dict.fromkeys(devices, task)

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        if partial is None or partial.scalars.get("weight", 0.0) <= 0:
            return state
        weight = partial.scalars["weight"]
        arrays = dict(state.arrays)
        for name, total in partial.arrays.items():
            arrays[name] = (total / weight).astype(state.arrays[name].dtype)
        return ServerState(arrays, dict(state.meta))

    def evaluate(self, state: ServerState, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        from shared.algorithms.training import evaluate

        model = self.ctx.model_factory()
        load_arrays(model, state.arrays)
        return evaluate(model, x, y)

    # -- client half -------------------------------------------------------------------------------
    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        from shared.algorithms.training import local_sgd  # torch: the client half only

        model = self.scratch_model({name: codec.to_array(t) for name, t in task.tensors.items()})
        metrics = local_sgd(model, device.data.x_train, device.data.y_train, self.ctx.train, device.seed)
        trained = model_arrays(model)
        return UpdateSpec(
            {k: codec.Dense(trained[k]) for k in task.tensors},
            num_samples=len(device.data.y_train),
            metrics=metrics,
        )

    def update_before_training(self, task: TaskSpec, num_samples: int) -> UpdateSpec | None:
        # ``train`` returns dense arrays of the task's names, shapes and dtypes, and no FLOPs of its own
        return UpdateSpec(dict(task.tensors), num_samples=num_samples)

    # -- aggregation half --------------------------------------------------------------------------
    @cached_property
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes an update must carry (computed once: aggregators validate every update)."""
        return self.ctx.layout().shapes(floats_only=True)

    def validate_update(self, update: UpdateSpec) -> None:
        expected = self._expected_shapes
        if set(update.tensors) != set(expected):
            raise codec.CodecError(
                "tensor", f"update names {sorted(update.tensors)[:4]}... do not match the model"
            )
        for k, t in update.tensors.items():
            if not isinstance(t, codec.Dense) or t.array.shape != expected[k]:
                raise codec.CodecError("tensor", f"{k}: expected dense {expected[k]}")
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        n = float(update.num_samples)
        contribution = Partial(
            {k: np.asarray(codec.to_array(t), dtype=np.float64) * n for k, t in update.tensors.items()},
            {"weight": n},
        )
        return partial.add(contribution)
