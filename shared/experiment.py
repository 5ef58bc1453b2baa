"""Turn a validated config into the live pieces every service needs: data, partition, model, strategy.

Why one builder: the server, every aggregator and every client process build the *same* experiment
from the same YAML, independently. Determinism (same seed → same partition, same initial model) is
what lets a device be hosted by any client process and still train identically.

Nothing here imports torch until a model is built: an aggregator of an algorithm whose aggregation
needs only the model's layout (``aggregation_strategy``) never imports it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from shared import algorithms
from shared.algorithms.base import DeviceData, Strategy, StrategyContext, derive_seed
from shared.config import ExperimentConfig
from shared.data import (
    SAMPLED,
    Dataset,
    IndexPartition,
    Partition,
    SampledPartition,
    load_dataset,
    noise_seed,
    noisy_dataset,
    partition,
    split_local,
)
from shared.devices import Device, Optimizer, build_fleet
from shared.ids import device_id
from shared.statespec import state_spec

if TYPE_CHECKING:
    import torch


@dataclass
class Experiment:
    cfg: ExperimentConfig
    dataset: Dataset

    @classmethod
    def build(cls, cfg: ExperimentConfig) -> Experiment:
        ds = load_dataset(cfg.dataset.name, cfg.dataset.path)
        ds = noisy_dataset(ds, cfg.dataset.feature_noise_std, noise_seed(cfg.seed))
        return cls(cfg, ds)

    @property
    def train_x(self) -> np.ndarray:
        limit = self.cfg.dataset.train_limit
        return self.dataset.x_train[:limit] if limit else self.dataset.x_train

    @property
    def train_y(self) -> np.ndarray:
        limit = self.cfg.dataset.train_limit
        return self.dataset.y_train[:limit] if limit else self.dataset.y_train

    @cached_property
    def partitions(self) -> Partition:
        """Each device's training indices (``shared.data.partitioning``): packed, or drawn on demand."""
        d = self.cfg.dataset
        seed = derive_seed(self.cfg.seed, "partition") % (2**32)
        if d.partition == SAMPLED:
            pool = len(self.train_y)
            per_device = d.samples_per_device or max(d.min_samples, pool // self.cfg.num_devices)
            return SampledPartition(pool, self.cfg.num_devices, per_device, seed)
        return IndexPartition(
            partition(
                self.train_y,
                self.cfg.num_devices,
                d.partition,
                seed=seed,
                alpha=d.alpha,
                classes_per_device=d.classes_per_device,
                shards_per_device=d.shards_per_device,
                min_samples=d.min_samples,
            )
        )

    def model(self) -> torch.nn.Module:
        """A fresh model with the experiment's deterministic initial weights."""
        # the CPU generator only: torch.manual_seed also runs accelerator seeding hooks, which in
        # torch 2.13 cost ~1 ms per call — and a model is built for every task
        import torch

        from shared.models import build_model, initialise

        torch.default_generator.manual_seed(derive_seed(self.cfg.seed, "init") % (2**31))
        model = build_model(
            self.cfg.model.name, self.dataset.input_shape, self.dataset.num_classes, **self.cfg.model.options
        )
        return initialise(model, self.cfg.model.init, derive_seed(self.cfg.seed, "init", self.cfg.model.init))

    @cached_property
    def strategy(self) -> Strategy:
        return self._strategy(lean=False)

    @cached_property
    def aggregation_strategy(self) -> Strategy:
        """The strategy as an aggregator needs it: for an algorithm that ``aggregates_from_layout``,
        one with the model's layout (``shared.statespec``) and no model, so the process imports no
        torch; otherwise the same as ``strategy``."""
        return self._strategy(lean=algorithms.get(self.cfg.algorithm.name).aggregates_from_layout)

    def _no_model(self) -> NoReturn:
        raise RuntimeError(
            f"{self.cfg.algorithm.name}: this strategy was built for aggregation only and holds no "
            "model; an algorithm whose aggregation needs the model must not set aggregates_from_layout"
        )

    def _strategy(self, *, lean: bool) -> Strategy:
        cls = algorithms.get(self.cfg.algorithm.name)
        options = algorithms.parse_options(self.cfg.algorithm.name, self.cfg.algorithm.options)
        algorithms.check_train(self.cfg.algorithm.name, self.cfg.train)
        algorithms.check_robust(self.cfg.algorithm.name, self.cfg.robust)
        if self.cfg.robust.active:
            from shared.algorithms import robust

            cls = robust.wrap(cls)
        spec = None
        if lean:
            m = self.cfg.model
            spec = state_spec(m.name, m.options, self.dataset.input_shape, self.dataset.num_classes)
        ctx = StrategyContext(
            model_factory=self._no_model if lean else self.model,
            input_shape=self.dataset.input_shape,
            num_classes=self.dataset.num_classes,
            train=self.cfg.train,
            seed=self.cfg.seed,
            options=options,
            optimizer=self.optimizer,
            robust=self.cfg.robust,
            state_spec=spec,
        )
        return cls(ctx)

    @property
    def optimizer(self) -> Optimizer:
        return "sgd_momentum" if self.cfg.train.momentum > 0 else "sgd"

    @cached_property
    def full_footprint_bytes(self) -> int:
        """Training footprint of the whole model at the configured batch size (the 100% of fleets)."""
        from shared.devices import training_footprint

        return training_footprint(
            self.model(), self.dataset.input_shape, self.cfg.train.batch_size, optimizer=self.optimizer
        ).total

    @cached_property
    def fleet(self) -> Sequence[Device]:
        """The devices, built the same way in every process from the config and seed; indexed by
        device id. A fleet of tiers makes each profile from the seed when asked (``LazyFleet``)."""
        return build_fleet(
            self.cfg.fleet,
            self.cfg.num_devices,
            full_footprint_bytes=self.full_footprint_bytes,
            seed=self.cfg.seed,
            source="fleet",
            lazy=True,
        )

    @cached_property
    def _test_by_label(self) -> dict[int, np.ndarray]:
        """Global-test indices per label (for ``dataset.local_test: classes``)."""
        y = self.dataset.y_test
        return {int(c): np.flatnonzero(y == c) for c in np.unique(y)}

    def train_samples(self, device_id: int) -> int:
        """How many training samples ``device_data`` gives the device, without slicing them out of
        the dataset where the partition knows (a client reporting a deferred ``ready`` needs only the
        count; the device's data is sliced once, when it trains)."""
        if self.cfg.dataset.local_test == "classes" or self.cfg.dataset.local_test_fraction <= 0:
            return self.partitions.size(device_id)
        return len(self.device_data(device_id).y_train)  # the local split decides

    def device_data(self, device_id: int) -> DeviceData:
        idx = self.partitions[device_id]
        frac = self.cfg.dataset.local_test_fraction
        if self.cfg.dataset.local_test == "classes":
            held = np.unique(self.train_y[idx])
            empty = np.empty(0, dtype=np.int64)
            te = np.sort(np.concatenate([self._test_by_label.get(int(c), empty) for c in held]))
            x, y = self.train_x, self.train_y
            return DeviceData(x[idx], y[idx], self.dataset.x_test[te], self.dataset.y_test[te])
        if frac > 0:
            labels = self.train_y if self.cfg.dataset.local_test_split == "stratified" else None
            seed = derive_seed(self.cfg.seed, "local-split", device_id) % (2**32)
            tr, te = split_local(idx, frac, seed, labels=labels)
        else:
            tr, te = idx, idx[:0]
        x, y = self.train_x, self.train_y
        return DeviceData(x[tr], y[tr], x[te], y[te])


class HostedData(Mapping[int, DeviceData]):
    """The local data of the devices a client host serves, by device id.

    Only the ids are kept: each access slices the device's samples out of the (memory-mapped,
    read-only) dataset, so a served device that is not training holds no copy of its data, and the
    host's memory does not grow with the devices it serves (issue 16, lean processes). Slicing a few
    dozen samples costs microseconds next to a task's training.

    The ids are one flag per device id (a boolean array, grown when an id beyond it comes): 1 byte
    per device of the fleet instead of ~120 bytes per served device in a ``set`` of ints (a host
    serves 25,000 of a 100,000-device fleet, issue 16).
    """

    def __init__(self, exp: Experiment) -> None:
        self._exp = exp
        self._served = np.zeros(exp.cfg.num_devices, dtype=bool)
        self._count = 0

    def _index(self, device: object) -> int | None:
        """``device`` as an index of ``_served`` (None: not a device id, or beyond the array)."""
        d = device_id(device)
        return d if d is not None and 0 <= d < len(self._served) else None

    def add(self, device: int) -> None:
        d = operator.index(device)
        if d < 0:
            raise ValueError(f"device ids are >= 0, got {device}")
        if d >= len(self._served):
            grown = np.zeros(max(d + 1, len(self._served) + len(self._served) // 2), dtype=bool)
            grown[: len(self._served)] = self._served
            self._served = grown
        if not self._served[d]:
            self._served[d] = True
            self._count += 1

    def __delitem__(self, device: int) -> None:
        d = self._index(device)
        if d is None or not self._served[d]:
            raise KeyError(device)
        self._served[d] = False
        self._count -= 1

    def clear(self) -> None:
        self._served[:] = False
        self._count = 0

    def __contains__(self, device: object) -> bool:
        d = self._index(device)
        return d is not None and bool(self._served[d])

    def __getitem__(self, device: int) -> DeviceData:
        if device not in self:
            raise KeyError(device)
        return self._exp.device_data(device)

    def __iter__(self) -> Iterator[int]:
        """The served ids, in increasing order."""
        return iter(np.flatnonzero(self._served).tolist())

    def __len__(self) -> int:
        return self._count
