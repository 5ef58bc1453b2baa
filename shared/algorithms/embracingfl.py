"""EmbracingFL (Lee et al., 2024): weak clients train only an output-side suffix of layers.

Spec: ``docs/algorithms/embracingfl.md`` (paper: "Embracing Federated Learning: Enabling Weak Client
Participation via Partial Model Training").
Every device keeps the **full architecture**. A device with cut index ``c`` (strong: ``c = 1``)

1. receives the input-side prefix (blocks ``1..c-1``) in consecutive chunks and runs its *whole local
   dataset* forward through each chunk without autograd, keeping only the activations at the cut (the
   **multi-step forward pass**, Alg. 1) — so its peak memory is one chunk, never the whole prefix;
2. receives the suffix (blocks ``c..L``) and trains it for ``τ`` local SGD steps (momentum 0.9, weight
   decay, buffer reset every round) on minibatches of the *cached* cut activations (Alg. 2);
3. uploads only the suffix — full-width dense tensors, BN running statistics of the suffix included.

The server averages each layer over the devices that trained it (``S_t(ℓ) = {i : c_i ≤ ℓ}``): the
input side over the strong devices only (1/s), the output side over everyone (1/m), with **uniform**
weights (spec §2.5, §9 item 3); a layer nobody trained this round keeps its value (§9 item 13). The
"whole-model average" reading of App. 6.1 (weak devices' untouched prefix copies averaged in, §9 item 2)
is the ``aggregation: whole_model`` option, computed without uploading those copies: an untouched copy
*is* the old global value, so the server adds ``(n − count_ℓ)·w_ℓ^t`` itself.

How a device gets its cut (``client_types``):

* ``budget`` (default): the most output-side blocks whose training footprint fits the device's
  ``profile["memory_bytes"]`` — the footprint this module reports for the multi-step forward (below),
  the same number the client's admission then checks; devices without a budget fall back to ``tier``;
* ``tier``: the fleet tier name (``strong`` / ``moderate`` / ``weak``, mapping in ``tier_types``);
* ``mix``: fractions of strong/moderate/weak laid over the registered device ids by a seeded permutation
  (spec §2.1's interpretation).

In ``tier``/``mix`` mode the moderate and weak cuts are ``moderate_blocks`` / ``weak_blocks``
trainable output-side blocks, or — when not given — the deepest cut whose capacity by the paper's
counting rule (§3.2, ``shared.devices.embracingfl_capacity``) is within ``moderate_capacity`` /
``weak_capacity``. Blocks are cut-safe units (:mod:`shared.models.partial_training`).

**Memory accounting** (``task_footprint``). The framework's accountant counts every parameter as
resident; under the multi-step forward only the suffix is resident while training, and one prefix chunk
while forwarding. So the footprint is the larger of the two phases:

* training: suffix parameters and buffers + gradients + optimizer state of the suffix + the activations
  autograd saves for the suffix (measured by the framework with the prefix frozen, which saves nothing);
* forwarding: for each chunk, its parameters and buffers + the largest input+output activation pair of one
  of its blocks, for a forward batch;
* plus, with ``cache_in_memory``, the cached cut activations ``|D_i| × cut width × 4 B`` (the paper keeps
  them "in either memory space or disk space" and does not count them; default: disk, not counted).

Chunking (``plan``): with a budget, consecutive prefix blocks are packed greedily while the chunk's
forward peak fits (spec §2.3's suggested rule); without one, moderate devices get one chunk and weak ones
two (the paper's Table 8 setting). The framework sends a task as one message, so chunks are *counted*
(``down_messages``) rather than sent separately; the downlink bytes equal the full model either way (§2.3).
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
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
from shared.devices import TrainingFootprint, embracingfl_capacity, layer_flops, training_footprint
from shared.models.partial_training import LayerSplit
from shared.models.state import load_arrays, model_arrays

ClientType = Literal["strong", "moderate", "weak"]
Chunks = list[tuple[int, int]]
DEFAULT_TIER_TYPES: dict[str, ClientType] = {"strong": "strong", "moderate": "moderate", "weak": "weak"}


class EmbracingFLOptions(BaseModel):
    """``algorithm.options`` of EmbracingFL; defaults are the paper's (App. 6.1) and the spec's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: how a device's cut is chosen: its memory budget, its tier name, or a seeded mix (module docstring)
    client_types: Literal["budget", "tier", "mix"] = "budget"
    #: False = every device is asked to train the whole model (FedAvg with the same local procedure);
    #: devices whose budget cannot hold it are refused by admission — "FedAvg dropping weak clients"
    partial_training: bool = True
    #: tier name -> client type (``tier`` mode, and ``budget`` mode for devices without a budget);
    #: tiers not listed are strong
    tier_types: dict[str, ClientType] = Field(default_factory=lambda: dict(DEFAULT_TIER_TYPES))
    #: ``mix`` mode: share of strong devices (the three shares must sum to 1)
    strong_fraction: float = Field(0.25, ge=0, le=1)
    #: ``mix`` mode: share of moderate devices
    moderate_fraction: float = Field(0.25, ge=0, le=1)
    #: ``mix`` mode: share of weak devices
    weak_fraction: float = Field(0.5, ge=0, le=1)
    #: trainable output-side blocks of a moderate device (None: from ``moderate_capacity``)
    moderate_blocks: int | None = Field(None, ge=1)
    #: trainable output-side blocks of a weak device (None: from ``weak_capacity``)
    weak_blocks: int | None = Field(None, ge=1)
    #: paper-rule capacity (§3.2) a moderate device may use when its blocks are not given
    moderate_capacity: float = Field(0.40, gt=0, le=1)
    #: paper-rule capacity (§3.2) a weak device may use when its blocks are not given
    weak_capacity: float = Field(0.15, gt=0, le=1)
    #: per_layer = the paper's equations (1/s for the prefix, 1/m for the suffix); whole_model = App.
    #: 6.1's "whole models are averaged" (weak devices' unchanged prefix copies count; spec §9 item 2)
    aggregation: Literal["per_layer", "whole_model"] = "per_layer"
    #: uniform = the paper's 1/count; samples = n_i-weighted (a variant, not the paper)
    weighting: Literal["uniform", "samples"] = "uniform"
    #: count the cached cut activations of the whole local dataset in the footprint (paper: on disk)
    cache_in_memory: bool = False
    #: samples per forward batch of the multi-step forward (None = ``train.batch_size``)
    forward_batch: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _fractions(self) -> EmbracingFLOptions:
        total = self.strong_fraction + self.moderate_fraction + self.weak_fraction
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"strong/moderate/weak fractions must sum to 1, got {total}")
        return self


def multi_step_forward(
    split: LayerSplit, model: nn.Module, x: torch.Tensor, chunks: Chunks, batch_size: int
) -> torch.Tensor:
    """Alg. 1: push all of ``x`` through each prefix chunk in turn, without autograd; returns the cut
    activations (``x`` itself when there is no prefix).

    Frozen layers run in inference mode (spec §9 item 10): global-BN layers normalise with the global
    running statistics and leave them unchanged; static-BN layers (``track_running_stats=False``) use the
    forward batch's statistics; dropout is off.
    """
    h = x
    for first, last in chunks:
        part = split.chain(model, first, last).eval()
        with torch.no_grad():
            h = torch.cat([part(h[i : i + batch_size]) for i in range(0, len(h), batch_size)])
    return h


class EmbracingFL(Strategy):
    name = "embracingfl"
    Options = EmbracingFLOptions
    #: τ, the paper's local steps per round, is ``train.local_steps`` (steps on the cached data)
    supports_local_steps = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.opts = typed_options(ctx.options, EmbracingFLOptions)
        self.split = LayerSplit(ctx.model_factory(), ctx.input_shape)
        L = self.split.num_blocks
        for name in ("moderate_blocks", "weak_blocks"):
            value = getattr(self.opts, name)
            if value is not None and value > L:
                raise ValueError(f"embracingfl: {name}={value} but the model has only {L} blocks")
        self._budget_cache: dict[int, tuple[int, Chunks]] = {}
        self._fp_cache: dict[Hashable, TrainingFootprint] = {}
        self._flops_cache: dict[int, tuple[int, int]] = {}
        self._mix_cache: dict[tuple[int, ...], dict[int, ClientType]] = {}

    # -- client types and cuts -------------------------------------------------------------------------
    @property
    def forward_batch(self) -> int:
        return self.opts.forward_batch or self.ctx.train.batch_size

    @cached_property
    def type_cuts(self) -> dict[ClientType, int]:
        """The cut index of each client type in ``tier``/``mix`` mode."""
        L = self.split.num_blocks
        out: dict[ClientType, int] = {"strong": 1}
        for kind, blocks, cap in (
            ("moderate", self.opts.moderate_blocks, self.opts.moderate_capacity),
            ("weak", self.opts.weak_blocks, self.opts.weak_capacity),
        ):
            if blocks is not None:
                out[kind] = L - blocks + 1  # type: ignore[index]
            else:
                out[kind] = next(  # type: ignore[index]
                    (c for c in range(1, L + 1) if self.paper_capacity(c) <= cap + 1e-12), L
                )
        return out

    def paper_capacity(self, cut: int) -> float:
        """C(c) of spec §3.2 (parameters + conv/linear outputs of the trained blocks, batch B)."""
        return embracingfl_capacity(
            self.ctx.model_factory(),
            self.ctx.input_shape,
            trainable=self.split.suffix_params(cut),
            batch_size=self.ctx.train.batch_size,
        )

    def _mix_types(self, devices: list[int], fleet: Fleet) -> dict[int, ClientType]:
        """Fixed types for the registered devices: exact shares (largest remainder), seeded permutation."""
        ids = sorted(fleet) if fleet else list(range(max(devices, default=-1) + 1))
        cached = self._mix_cache.get(tuple(ids))
        if cached is not None:
            return cached
        n = len(ids)
        shares = [self.opts.strong_fraction, self.opts.moderate_fraction, self.opts.weak_fraction]
        counts = [int(np.floor(s * n)) for s in shares]
        order = np.argsort([-(s * n - c) for s, c in zip(shares, counts, strict=True)], kind="stable")
        for i in order[: n - sum(counts)]:
            counts[int(i)] += 1
        kinds: tuple[ClientType, ...] = ("strong", "moderate", "weak")
        labels = [kind for kind, count in zip(kinds, counts, strict=True) for _ in range(count)]
        perm = np.random.default_rng(derive_seed(self.ctx.seed, "embracingfl-types") % (2**32)).permutation(n)
        types = {dev: labels[int(p)] for dev, p in zip(ids, perm, strict=True)}
        self._mix_cache[tuple(ids)] = types
        return types

    def _budget_cut(self, memory_bytes: int) -> tuple[int, Chunks]:
        """The smallest cut (most trained blocks) whose footprint fits; L if none does (admission then
        refuses the task, and the device does not participate, as the spec says)."""
        hit = self._budget_cache.get(memory_bytes)
        if hit is None:
            L = self.split.num_blocks
            hit = (L, self.split.chunks(L, memory_bytes, self.forward_batch))
            for cut in range(1, L + 1):
                chunks = self.split.chunks(cut, memory_bytes, self.forward_batch)
                if self.footprint(cut, chunks).total <= memory_bytes:
                    hit = (cut, chunks)
                    break
            self._budget_cache[memory_bytes] = hit
        return hit

    def assign(self, device: int, devices: list[int], fleet: Fleet) -> tuple[int, Chunks, str]:
        """(cut, prefix chunks, type label) of ``device`` this round (server half)."""
        info = fleet.get(device)
        L = self.split.num_blocks
        if not self.opts.partial_training:
            return 1, [], "strong"
        mode = self.opts.client_types
        budget = info.profile.get("memory_bytes") if info is not None else None
        if mode == "budget" and budget is not None:
            cut, chunks = self._budget_cut(int(budget))
            return cut, chunks, "strong" if cut == 1 else ("partial" if cut < L else "head-only")
        kind: ClientType
        if mode == "mix":
            kind = self._mix_types(devices, fleet)[device]
        else:
            tier = info.tier if info is not None else "default"
            kind = self.opts.tier_types.get(tier, "strong")
        cut = self.type_cuts[kind]
        parts = {"strong": 0, "moderate": 1, "weak": 2}[kind]
        return cut, self.split.chunks(cut, None, self.forward_batch, parts=parts), kind

    # -- server half -----------------------------------------------------------------------------------
    def _float_names(self, state: ServerState) -> list[str]:
        return [k for k, v in state.arrays.items() if v.dtype.kind == "f"]

    def init_state(self) -> ServerState:
        return ServerState(model_arrays(self.ctx.model_factory()))

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        # Downlink = the full model for everyone (spec §2.3: the prefix arrives in chunks, total bytes
        # unchanged). Devices with the same cut share one TaskSpec, which the server encodes once.
        tensors: dict[str, codec.Tensor] = {k: codec.Dense(state.arrays[k]) for k in self._float_names(state)}
        shared: dict[Hashable, TaskSpec] = {}
        out: dict[int, TaskSpec] = {}
        for dev in devices:
            cut, chunks, kind = self.assign(dev, devices, fleet)
            config: dict[str, Any] = {
                "cut": cut,
                "chunks": [list(c) for c in chunks],
                "type": kind,
                # the prefix chunks + the suffix: the link emulation charges one latency each
                # (``task_download_messages``)
                "download_messages": len(chunks) + 1,
            }
            if self.opts.cache_in_memory:
                info = fleet.get(dev)
                config["num_samples"] = int(info.num_samples) if info is not None else 0
            key = (cut, tuple(chunks), kind, config.get("num_samples"))
            if key not in shared:
                shared[key] = TaskSpec(tensors, config)
            out[dev] = shared[key]
        return out

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        """Per-layer mean over the devices that trained the layer; untrained layers keep their value.

        ``whole_model``: divide by all devices of the round instead, counting the untrained copies as
        the old value (what averaging weak devices' unchanged prefixes would give).
        """
        if partial is None or partial.scalars.get("weight", 0.0) <= 0:
            return state
        arrays = dict(state.arrays)
        total_weight = partial.scalars["weight"]
        for name in self._float_names(state):
            total = partial.arrays.get(f"sum/{name}")
            count_arr = partial.arrays.get(f"count/{name}")
            count = float(count_arr[0]) if count_arr is not None else 0.0
            old = np.asarray(state.arrays[name], dtype=np.float64)
            if self.opts.aggregation == "whole_model":
                summed = total if total is not None else 0.0
                new = (summed + (total_weight - count) * old) / total_weight
            elif total is None or count <= 0:
                continue
            else:
                new = total / count
            arrays[name] = np.asarray(new).astype(state.arrays[name].dtype)
        meta = dict(state.meta)
        meta["updates"] = float(meta.get("updates", 0.0)) + partial.scalars.get("updates", 0.0)
        return ServerState(arrays, meta)

    def evaluate(self, state: ServerState, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        model = self.ctx.model_factory()
        load_arrays(model, state.arrays)
        return evaluate(model, x, y)

    # -- client half -----------------------------------------------------------------------------------
    @staticmethod
    def _task_layout(task: TaskSpec) -> tuple[int, Chunks]:
        cut = int(task.config.get("cut", 1))
        chunks = [(int(a), int(b)) for a, b in task.config.get("chunks", [])]
        return cut, chunks

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        cut, chunks = self._task_layout(task)
        split, train_cfg = self.split, self.ctx.train
        L = split.num_blocks
        if chunks and (chunks[0][0] != 1 or chunks[-1][1] != cut - 1):
            raise ValueError(f"chunks {chunks} do not cover the prefix 1..{cut - 1}")
        model = self.ctx.model_factory()
        arrays = model_arrays(model)
        for name, t in task.tensors.items():
            arrays[name] = codec.to_array(t)
        load_arrays(model, arrays)
        trainable = split.suffix_params(cut)
        for name, p in model.named_parameters():
            p.requires_grad_(name in trainable)

        # Alg. 1: the multi-step forward over the whole local dataset, once per round
        x = torch.from_numpy(np.ascontiguousarray(device.data.x_train, dtype=np.float32))
        y = torch.from_numpy(np.ascontiguousarray(device.data.y_train, dtype=np.int64))
        cached = multi_step_forward(split, model, x, chunks, self.forward_batch) if cut > 1 else x

        # Alg. 2: τ SGD steps on the suffix, minibatches drawn from the cached activations
        suffix = split.chain(model, cut, L).train()
        params = [p for name, p in model.named_parameters() if name in trainable]
        n, b = len(y), train_cfg.batch_size
        steps = train_cfg.local_steps or train_cfg.local_epochs * -(-n // b)
        # sampling without replacement within a pass, reshuffled at each pass boundary
        stats = local_sgd(suffix, cached, y, train_cfg, device.seed, params=params, steps=steps)

        trained = model_arrays(model)
        names = split.suffix_state(cut)
        up_params = int(sum(trained[k].size for k in names))
        metrics = {
            "train_loss": stats["train_loss"],
            "steps": stats["steps"],
            "cut": float(cut),
            "blocks_trained": float(L - cut + 1),
            "strong": float(cut == 1),
            "up_params": float(up_params),
            "paper_bytes_up": float(4 * up_params),
            "down_messages": float(len(chunks) + 1),
            "cache_bytes": float(n * split.cut_numel(cut) * 4) if cut > 1 else 0.0,
            "train_flops": float(self._round_flops(cut, n, steps)),
        }
        return UpdateSpec({k: codec.Dense(trained[k]) for k in names}, num_samples=n, metrics=metrics)

    # -- aggregation half ------------------------------------------------------------------------------
    @cached_property
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in model_arrays(self.ctx.model_factory()).items() if v.dtype.kind == "f"}

    def validate_update(self, update: UpdateSpec) -> None:
        """The update must be exactly the float state of one output-side suffix, dense and finite."""
        cut = self.split.cut_of(update.tensors)
        if cut is None:
            raise codec.CodecError(
                "tensor", f"update names {sorted(update.tensors)[:4]}... are not an output-side suffix"
            )
        expected = self._expected_shapes
        for k, t in update.tensors.items():
            if not isinstance(t, codec.Dense) or t.array.shape != expected[k]:
                raise codec.CodecError("tensor", f"{k}: expected dense {expected[k]}")
            if not np.all(np.isfinite(t.array)):
                raise codec.CodecError("tensor", f"{k}: non-finite values")
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """Per-tensor ``Σ w_i·θ_i`` and ``Σ w_i`` over the devices that uploaded the tensor, plus the
        round's total weight (for ``whole_model``); plain sums, so associative and commutative."""
        w = 1.0 if self.opts.weighting == "uniform" else float(update.num_samples)
        arrays: dict[str, np.ndarray] = {}
        for name, t in update.tensors.items():
            assert isinstance(t, codec.Dense)
            arrays[f"sum/{name}"] = w * np.asarray(t.array, dtype=np.float64)
            arrays[f"count/{name}"] = np.array([w])
        scalars = {
            "weight": w,
            "updates": 1.0,
            "strong": float(len(update.tensors) == len(self._expected_shapes)),
        }
        return partial.add(Partial(arrays, scalars))

    # -- accounting ------------------------------------------------------------------------------------
    def task_param_names(self, task: TaskSpec) -> set[str] | None:
        cut, _ = self._task_layout(task)
        return None if cut == 1 else self.split.suffix_params(cut)

    def accounting_key(self, task: TaskSpec) -> Hashable:
        cut, chunks = self._task_layout(task)
        return (cut, tuple(chunks), task.config.get("num_samples") if self.opts.cache_in_memory else None)

    def footprint(self, cut: int, chunks: Chunks, num_samples: int = 0) -> TrainingFootprint:
        """Peak bytes of a round with cut ``cut`` under the multi-step forward (module docstring)."""
        key = (cut, tuple(chunks), num_samples)
        hit = self._fp_cache.get(key)
        if hit is not None:
            return hit
        split, model = self.split, self.ctx.model_factory()
        B = self.ctx.train.batch_size
        train = training_footprint(
            model,
            self.ctx.input_shape,
            B,
            optimizer=self.ctx.optimizer,
            trainable_params=None if cut == 1 else split.suffix_params(cut),
            param_bytes_override=None if cut == 1 else split.suffix_resident_bytes(cut),
        )
        cache = num_samples * split.cut_numel(cut) * 4 if (self.opts.cache_in_memory and cut > 1) else 0
        forward = max((split.forward_peak_bytes(a, b, self.forward_batch) for a, b in chunks), default=0)
        # The two phases do not overlap: the peak is the larger of the two, plus the cache. The
        # training phase keeps its breakdown; the forward phase's excess and the cache are their own
        # named term, so a refusal says which of them broke the budget.
        excess = max(0, forward - train.total)
        label = " + ".join(
            what for what, n in (("forward-phase excess", excess), ("cached prefix outputs", cache)) if n
        )
        fp = TrainingFootprint(
            params_bytes=train.params_bytes,
            grads_bytes=train.grads_bytes,
            optimizer_bytes=train.optimizer_bytes,
            activations_bytes=train.activations_bytes,
            other_bytes=excess + cache,
            other_label=label or "other",
        )
        self._fp_cache[key] = fp
        return fp

    def task_download_messages(self, task: TaskSpec) -> int:
        """The prefix chunks plus the suffix, each its own download (spec §2.3)."""
        return int(task.config.get("download_messages", 1))

    def task_footprint(self, task: TaskSpec) -> TrainingFootprint:
        cut, chunks = self._task_layout(task)
        return self.footprint(cut, chunks, int(task.config.get("num_samples", 0)))

    def _flops_per_sample(self, cut: int) -> tuple[int, int]:
        """(prefix forward FLOPs, suffix forward+backward FLOPs) per sample."""
        hit = self._flops_cache.get(cut)
        if hit is None:
            rows = layer_flops(
                self.ctx.model_factory(),
                self.ctx.input_shape,
                trainable_params=self.split.suffix_params(cut),
            )
            prefix = sum(r.forward for r in rows if self.split.block_of(r.name) < cut)
            suffix = sum(r.total for r in rows if self.split.block_of(r.name) >= cut)
            hit = self._flops_cache[cut] = (prefix, suffix)
        return hit

    def _round_flops(self, cut: int, num_samples: int, steps: int) -> int:
        """One prefix forward over the local data + ``steps`` training steps of the suffix (spec §4.2:
        the forward is not reduced, only the backward)."""
        prefix, suffix = self._flops_per_sample(cut)
        return prefix * num_samples + suffix * steps * self.ctx.train.batch_size

    def task_flops(self, task: TaskSpec, num_samples: int) -> int:
        cut, _ = self._task_layout(task)
        b = self.ctx.train.batch_size
        steps = self.ctx.train.local_steps or self.ctx.train.local_epochs * -(-num_samples // b)
        return self._round_flops(cut, num_samples, steps)
