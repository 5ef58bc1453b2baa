"""The strategy interface: one algorithm = one module holding all of its halves.

Why this shape (after Flower's ``Strategy`` and FLSim's channel hooks): the services are generic
plumbing and must know nothing about any algorithm, while a reader of ``fedavg.py`` or ``spafl.py``
should find the whole story of that algorithm in one file:

* **server half** — ``init_state`` / ``plan`` / ``finalize`` / ``evaluate``: what each device gets
  each round, and how the merged partial becomes the next global state;
* **client half** — ``train``: what a device does with its task, its local data and local state;
* **aggregation half** — ``reduce`` / ``merge``: an associative, commutative reduction into a
  ``Partial`` (sums and counts per coordinate), so any number of aggregators and any arrival order
  give the same result, in memory O(model) rather than O(updates);
* **accounting** — ``task_footprint`` / ``task_flops``: what a task costs a device, so admission,
  emulated compute time and reports agree.

Payload tensors are ``shared.codec`` tensors (dense, sparse, sliced, thresholds), so the bytes on the
wire are whatever the algorithm really needs to send.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from shared import codec
from shared.config import RobustConfig, TrainConfig
from shared.devices import Optimizer, TrainingFootprint
from shared.schemas import DeviceInfo
from shared.seeding import derive_seed as derive_seed
from shared.statespec import StateSpec

if TYPE_CHECKING:  # torch is imported where a model is built or trained, never by importing this
    import torch


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``shared.models.state.model_arrays`` (imported when first used: it needs torch)."""
    from shared.models.state import model_arrays as of_model

    return of_model(model)


def load_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """``shared.models.state.load_arrays`` (imported when first used: it needs torch)."""
    from shared.models.state import load_arrays as into_model

    into_model(model, arrays)


#: The registered devices the server plans for: device id → what the device registered (tier, sample
#: count, profile with ``memory_bytes`` etc.). Passed to ``plan`` on every call rather than held by the
#: strategy: a strategy that kept a reference into server state saw an empty fleet after the server
#: replaced its registry on resume, and budget-aware algorithms silently planned differently.
Fleet = Mapping[int, DeviceInfo]


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def typed_options(options: BaseModel, cls: type[OptionsT]) -> OptionsT:
    """A strategy's options as its own model. ``parse_options`` validated them with the class's
    ``Options``, so anything else is a wiring bug, said as one."""
    if not isinstance(options, cls):
        raise TypeError(f"expected {cls.__name__} options, got {type(options).__name__}")
    return options


class NoOptions(BaseModel):
    """Options model for algorithms without options: any key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class ServerState:
    """The server-side global state: named arrays (checkpointed as .npz) plus JSON-able metadata."""

    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class TaskSpec:
    """What one device receives in one round."""

    tensors: dict[str, codec.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class UpdateSpec:
    """What one device sends back."""

    tensors: dict[str, codec.Tensor]
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    #: set by the aggregator from the envelope (the client half leaves it None)
    device_id: int | None = None
    #: the round the update answers, set by the aggregator from the envelope, so that
    #: ``validate_update`` can check round-dependent payload shapes (None where unknown)
    round: int | None = None


@dataclass
class Partial:
    """An associative reduction of some updates: float64 sums/counts per name plus scalar sums."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)

    def add(self, other: Partial) -> Partial:
        """Elementwise sum, in place; names present in only one side are kept.

        An array this partial owns (made by an earlier ``add``: a copy) is added into where it lies,
        the same sum as ``mine + arr`` without a new float64 array per update (an aggregator adds
        every update of a round into the same partial: at 10,000 devices the temporaries were a
        tenth of its time). An array it does not own (``from_wire``: a view of a message) is
        never written; it is replaced by the sum, as before.
        """
        for name, arr in other.arrays.items():
            mine = self.arrays.get(name)
            if mine is None:
                self.arrays[name] = arr.astype(np.float64, copy=True)
            elif (
                mine.flags.owndata
                and mine.flags.writeable
                and mine.shape == arr.shape
                and np.result_type(mine, arr) == mine.dtype
            ):
                np.add(mine, arr, out=mine)
            else:
                self.arrays[name] = mine + arr
        for name, val in other.scalars.items():
            self.scalars[name] = self.scalars.get(name, 0.0) + val
        return self

    def to_wire(self) -> tuple[dict[str, codec.Tensor], dict[str, float]]:
        return {
            k: codec.Dense(np.ascontiguousarray(v, dtype=np.float64)) for k, v in self.arrays.items()
        }, dict(self.scalars)

    @staticmethod
    def from_wire(tensors: Mapping[str, codec.Tensor], scalars: Mapping[str, float]) -> Partial:
        arrays = {}
        for k, t in tensors.items():
            if not isinstance(t, codec.Dense):
                raise codec.CodecError(
                    "tensor", f"partial tensor {k!r} must be dense, got {type(t).__name__}"
                )
            arrays[k] = np.asarray(t.array, dtype=np.float64)
        return Partial(arrays, dict(scalars))


@dataclass
class DeviceData:
    """A device's local data (train split, optional personal test split)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class DeviceContext:
    """Everything the client half may use for one task on one device."""

    device_id: int
    round: int
    data: DeviceData
    #: a directory private to this device for state that must survive a client restart
    state_dir: Path
    #: seed for this (experiment seed, round, device): training is deterministic wherever it runs
    seed: int
    tier: str = "default"


@dataclass
class StrategyContext:
    """What a strategy is built from (the same on server, aggregators and clients)."""

    model_factory: Callable[[], torch.nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int
    train: TrainConfig
    seed: int
    options: BaseModel
    #: optimizer whose state the memory accountant counts ("sgd", "sgd_momentum", "adam")
    optimizer: Optimizer = "sgd"
    #: robust aggregation (``shared.algorithms.robust``); None or inactive: the algorithm's own mean
    robust: RobustConfig | None = None
    #: the model's layout when it is known without building the model (an aggregator's strategy,
    #: whose ``model_factory`` refuses: it holds no torch); None: taken from ``model_factory``
    state_spec: StateSpec | None = None

    def layout(self) -> StateSpec:
        """Names, shapes and dtypes of the model's state: from ``state_spec`` if given, else by
        building the model once."""
        if self.state_spec is None:
            self.state_spec = StateSpec.of(model_arrays(self.model_factory()))
        return self.state_spec


class Strategy(ABC):
    """Base class of every algorithm; see the module docstring for the four halves."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions
    #: True when devices keep personal models and accuracy is measured on their own test split
    personalised: ClassVar[bool] = False
    #: True when the client half trains through ``training.local_sgd`` with the task's length left to
    #: the config and counts FLOPs with ``samples_per_task``, so ``train.local_steps`` means what it
    #: says. Algorithms with their own loop or their own notion of local work keep False, and a config
    #: with ``local_steps`` for them is refused (``algorithms.check_train``) rather than ignored.
    supports_local_steps: ClassVar[bool] = False
    #: How robust aggregation (``shared.algorithms.robust``) can read this algorithm's partials:
    #: ``whole`` — ``reduce`` folds one update into ``{name: n·x}`` plus the scalar ``weight`` n and
    #: ``finalize`` divides (FedAvg); ``coordinate`` — per-coordinate ``sum/<name>`` = p·x and
    #: ``count/<name>`` = p over the coordinates a device's sub-model holds, other keys summed (the
    #: width-slice family); None — anything else (masks, thresholds, personal layers), which a
    #: median, a trimmed mean or Krum cannot replace.
    mean_form: ClassVar[Literal["whole", "coordinate"] | None] = None
    #: True when the aggregation half (``validate_update``, ``reduce``, ``merge``) needs nothing of
    #: the model but its layout (``ctx.layout()``) and the module imports no torch: an aggregator then
    #: runs it without torch and without a model (issue 16, lean processes). False: the aggregator
    #: builds the strategy as every other process does.
    aggregates_from_layout: ClassVar[bool] = False

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.options = ctx.options

    # -- server half -------------------------------------------------------------------------------
    @abstractmethod
    def init_state(self) -> ServerState: ...

    @abstractmethod
    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        """Each selected device's task for ``round``. ``fleet`` holds every registered device (not
        only ``devices``): budget-aware algorithms size a task by the device's memory budget, and
        fixed type mixes (EmbracingFL) are drawn over the whole registered fleet."""

    @abstractmethod
    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        """Turn the merged partial of a round (None if nothing arrived) into the next state."""

    def evaluate(self, state: ServerState, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Central evaluation of the global model; personalised algorithms report device metrics."""
        return {}

    def density(self, state: ServerState) -> float:
        return 1.0

    def plan_evaluation(self, state: ServerState, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        """What each device receives for the all-device evaluation after the last round.

        Default: nothing — a personalised model lives on the device. Algorithms whose personal model
        depends on the global state (e.g. W ⊙ M_k) send it here.
        """
        empty = TaskSpec()
        return dict.fromkeys(devices, empty)

    # -- client half -------------------------------------------------------------------------------
    @abstractmethod
    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec: ...

    def update_before_training(self, task: TaskSpec, num_samples: int) -> UpdateSpec | None:
        """An update of the size ``train`` will return for ``task`` — the same tensor names, kinds,
        shapes and dtypes, any values — when that is known before training and ``train`` reports no
        ``train_flops`` of its own (its cost is ``task_flops``); None (the default) when training
        decides them (a sparsity reached, indices chosen on the device, a stateful device).

        Why: in first-finishers rounds a device's finish time is download + compute + upload, and
        when all three follow from the task, a client can report ``ready`` before training and
        train only the devices the server keeps (``go``). The surplus devices' updates were thrown
        away anyway; training them cost the host ~a quarter of a 1.3x over-selected round's training
        (issue 16). The emulated times, bytes and the global model are the same either way, as long
        as the wall-clock ``round_timeout_s`` does not cut the round (the kept devices now train after
        the ``go``, so a timeout interrupts them rather than the ready phase).
        """
        return None

    def evaluate_device(self, task: TaskSpec, device: DeviceContext) -> dict[str, float] | None:
        """Evaluate the device's personalised model on its own test split, without training.

        Why: the papers report the mean over *every* device, and a round's participants are only a
        sample of them. Return ``eval_accuracy``, ``eval_loss``, ``eval_samples`` (and e.g.
        ``density``); None when the algorithm keeps no personalised model.
        """
        return None

    # -- aggregation half --------------------------------------------------------------------------
    @abstractmethod
    def validate_update(self, update: UpdateSpec) -> None:
        """Raise ``codec.CodecError('tensor', ...)`` if the update does not fit the model."""

    @abstractmethod
    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """Fold one update into ``partial`` (may mutate and return it)."""

    def merge(self, a: Partial, b: Partial) -> Partial:
        return a.add(b)

    # -- accounting --------------------------------------------------------------------------------
    def task_param_names(self, task: TaskSpec) -> set[str] | None:
        """Parameters the task trains (None = all); used by the memory accountant and FLOPs."""
        return None

    def scratch_model(self, arrays: Mapping[str, np.ndarray]) -> torch.nn.Module:
        """This process's one training model, holding ``arrays`` over the initial state, with torch's
        global generator where a fresh ``ctx.model_factory()`` leaves it.

        Why: building a model per task (layers, initialisation) and loading it through
        ``load_state_dict`` cost a small device more CPU than its training (issue 16: 0.43 + 0.21 ms
        of a 2.3 ms task). Restoring every tensor and the generator gives the same training, bit for
        bit, as a fresh model: the initial state stands in for what ``arrays`` does not name (integer
        buffers such as BatchNorm's ``num_batches_tracked``), and the generator state the factory
        leaves (it seeds, then draws the initialisation) is the same after every build. The model is
        only valid until the next call; callers copy what they keep (``model_arrays`` does).
        """
        import torch

        from shared.models.state import copy_into

        scratch = self.__dict__.get("_scratch")
        if scratch is None:
            model = self.ctx.model_factory()
            scratch = (model, model_arrays(model), torch.default_generator.get_state())
            self.__dict__["_scratch"] = scratch
        model, initial, generator = scratch
        copy_into(model, {**initial, **arrays})
        torch.default_generator.set_state(generator)
        return model

    def task_model(self, task: TaskSpec) -> torch.nn.Module:
        """The model the task really trains (a sub-model for width-sliced algorithms)."""
        return self.ctx.model_factory()

    def accounting_key(self, task: TaskSpec) -> Hashable:
        """Tasks with equal keys cost the same; the accountant's results are cached by it.

        Algorithms whose tasks differ in shape (sub-model widths, masks) return what distinguishes them.
        """
        names = self.task_param_names(task)
        return None if names is None else frozenset(names)

    def _accounting(self, task: TaskSpec) -> tuple[TrainingFootprint, int]:
        key = self.accounting_key(task)
        cache: dict[Hashable, tuple[TrainingFootprint, int]] = self.__dict__.setdefault("_acct_cache", {})
        if key not in cache:
            from shared.devices import training_flops, training_footprint

            model = self.task_model(task)
            trainable = self.task_param_names(task)
            footprint = training_footprint(
                model,
                self.ctx.input_shape,
                self.ctx.train.batch_size,
                optimizer=self.ctx.optimizer,
                trainable_params=trainable,
            )
            per_sample = training_flops(model, self.ctx.input_shape, 1, 1, trainable_params=trainable)
            cache[key] = (footprint, per_sample)
        return cache[key]

    def task_footprint(self, task: TaskSpec) -> TrainingFootprint:
        """Training memory of the task: what admission compares with the device's budget."""
        return self._accounting(task)[0]

    def task_download_messages(self, task: TaskSpec) -> int:
        """How many messages the task reaches the device in, each paying the link's latency.

        Why: one broker message carries a task, but an algorithm may specify a download in pieces
        (EmbracingFL streams the frozen prefix chunk by chunk so it never holds it whole); the link
        emulation charges what the device would really wait for.
        """
        return 1

    def task_extra_peak(self, task: TaskSpec, num_samples: int) -> tuple[str, int] | None:
        """Peak bytes of work the task needs besides training, with what it is (None: nothing).

        Why: admission must cover everything a device does with the task. FedDSE, for one, runs the
        *full* model forward over its inference set before it trains a sub-model; a device that can
        train the sub-model but not hold that pass must refuse the task, not run it over budget.
        """
        return None

    def task_flops(self, task: TaskSpec, num_samples: int) -> int:
        """Training FLOPs of the task on ``num_samples`` local samples (forward + backward, all epochs).

        FLOPs are linear in the batch size, so per-sample FLOPs × the samples the task processes
        (``samples_per_task``: samples × epochs, or the τ steps' batches) is exact even when the last
        batch is short. Masked algorithms override this to count only kept weights.
        """
        from shared.algorithms.training import samples_per_task

        return self._accounting(task)[1] * samples_per_task(self.ctx.train, num_samples)
