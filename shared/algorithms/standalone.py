"""Standalone (local-only) training: the baseline of the personalisation papers (Hermes §5.3).

Every device trains its own copy of the model on its own data and never exchanges weights: the task
and the update carry no tensors, only the update's metrics (the device's accuracy on its personal test
split, so ``personalised = True``). It answers "what does federation add over each device on its own?"
— with pathological non-IID data (2 classes per device) local training is a strong baseline, because
a 2-class problem is easy.

Budget: the paper gives Standalone "the same total training time" as Hermes, hence more local epochs.
Here a device trains ``epochs_per_round`` epochs (default: ``train.local_epochs``) each time it is
selected, continuing from its saved model, until it has trained ``max_epochs`` in total (default: no
limit); after that it only re-evaluates. The spec's prototype used 50 epochs.

Device state (the model, the epochs done) lives in ``state_dir`` as ``standalone-<round>.npz``; a
task always starts from the newest file of an *earlier* round, so a replayed task (client crash before
the update was confirmed) recomputes the same result instead of training twice.

The noisy digits variant (spec §8.1) is the config's ``dataset.feature_noise_std``, as for every method.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

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
    typed_options,
)
from shared.algorithms.device_state import load_before
from shared.algorithms.device_state import save as save_state
from shared.algorithms.hermes import append_device_log, local_data
from shared.algorithms.training import evaluate, local_sgd

#: the device's model and epochs done: ``standalone-<round>.npz`` (see :mod:`~shared.algorithms.device_state`)
STATE_PREFIX = "standalone"


class StandaloneOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: local epochs per selection (None = ``train.local_epochs``)
    epochs_per_round: int | None = Field(None, ge=1)
    #: total local epochs a device trains over the whole run (None = no limit)
    max_epochs: int | None = Field(None, ge=1)
    #: leave out the stratified validation split Hermes holds out for its gate (same fraction, same
    #: draw), so Standalone trains on exactly Hermes' training samples, as in the Hermes spec's
    #: prototype. 0 = train on all local samples (favours Standalone by the validation share)
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)


class Standalone(Strategy):
    name = "standalone"
    Options = StandaloneOptions
    personalised = True

    # -- server half: nothing to hold, nothing to send -------------------------------------------------
    def init_state(self) -> ServerState:
        return ServerState({}, {"updates": 0.0})

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        task = TaskSpec({})
        return dict.fromkeys(devices, task)

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        if partial is None:
            return state
        meta = dict(state.meta)
        meta["updates"] = float(meta.get("updates", 0.0)) + partial.scalars.get("updates", 0.0)
        return ServerState(dict(state.arrays), meta)

    # -- client half ---------------------------------------------------------------------------------
    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        opts = typed_options(self.options, StandaloneOptions)
        model = self.ctx.model_factory()
        epochs_done = 0
        saved = load_before(device.state_dir, STATE_PREFIX, device.round)
        if saved is not None:
            load_arrays(model, {k.removeprefix("w/"): v for k, v in saved.items() if k.startswith("w/")})
            epochs_done = int(saved["epochs_done"][0])
        x_train, y_train, x_test = device.data.x_train, device.data.y_train, device.data.x_test
        if opts.val_fraction > 0:
            split = local_data(
                device.data,
                device_id=device.device_id,
                experiment_seed=self.ctx.seed,
                val_fraction=opts.val_fraction,
            )
            x_train, y_train = split.x_train, split.y_train
        epochs = opts.epochs_per_round or self.ctx.train.local_epochs
        if opts.max_epochs is not None:
            epochs = max(0, min(epochs, opts.max_epochs - epochs_done))
        metrics: dict[str, float] = {"train_loss": 0.0, "steps": 0.0}
        if epochs > 0:
            metrics = local_sgd(model, x_train, y_train, self.ctx.train, device.seed, epochs=epochs)
        ev = evaluate(model, x_test, device.data.y_test)
        arrays = {f"w/{k}": v for k, v in model_arrays(model).items()}
        arrays["epochs_done"] = np.array([epochs_done + epochs], dtype=np.int64)
        save_state(device.state_dir, STATE_PREFIX, device.round, arrays)
        metrics.update(
            {
                "eval_accuracy": ev["accuracy"],
                "eval_loss": ev["loss"],
                "eval_samples": float(len(device.data.y_test)),
                "epochs_done": float(epochs_done + epochs),
            }
        )
        append_device_log(device.state_dir, {"round": device.round, "device": device.device_id, **metrics})
        return UpdateSpec({}, num_samples=len(y_train), metrics=metrics)

    # -- aggregation half: count the updates, nothing else -------------------------------------------
    def validate_update(self, update: UpdateSpec) -> None:
        if update.tensors:
            raise codec.CodecError("tensor", "a standalone update carries no tensors")
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        return partial.add(Partial({}, {"updates": 1.0}))
