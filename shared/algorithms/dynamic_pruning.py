"""Federated dynamic pruning: the protocol FedTiny, FedDST and FedMef share (FedTiny's, as FedMef runs it).

Spec: ``docs/algorithms/fedmef.md`` §2 and §7 ("FedTiny, as run here"). Every device trains the *same*
sparse model θ ⊙ m, starting from a random mask at the target density; every ΔR rounds (until R_stop)
the server adjusts the mask: it drops the ξ_l smallest-magnitude aggregated weights of each layer and
grows the ξ_l pruned positions with the largest aggregated gradient, which the devices send as top-ξ
(index, value) lists over their pruned positions. Per-layer nnz, hence density, never changes.
FedTiny here has standard convs with BatchNorm, no extrusion and no activation pruning; its adaptive
BN selection and progressive pruning are removed, as in the paper's comparison.

:class:`DynamicPruning` is the whole protocol; FedTiny is it with no changes. ``fedmef.py`` adds BaE
and SAP, ``feddst.py`` moves the adjustment onto the devices. What each half does:

* **server** — ``init_state``: the factory's weights under a random (uniform or ERK) mask that depends
  only on the seed and the layer names, so every method of a seed starts from the same mask (or, with
  ``mask_init: magnitude``, the FL-PQSU static baseline's magnitude mask). ``mask/<weight>`` is stored
  as uint8 in the state. ``plan``: prunable weights as :class:`codec.Sparse` (the positions *are* the
  mask), the rest dense, and the round flags (r, is_adjust, ξ per layer, η_r). ``finalize``: FedAvg on
  the common support, then the mask update of §2.6 in adjustment rounds.
* **client** — masked plain SGD at η_r = η_0 · decay^r; uploads the **values only** of each prunable
  weight (a 1-D vector in the mask's flat order: the server knows the support, spec §4.3), dense
  tensors whole, and in adjustment rounds the top-ξ_l gradient list per layer (``grad/<weight>``, a
  COO :class:`codec.Sparse`).
* **aggregation** — sample-weighted sums of the value vectors, dense tensors and (densified) gradient
  lists plus the total weight: plain float64 sums, so any split over aggregators gives the same result.
* **accounting** — ``task_footprint`` counts the weights and their gradients in the App. C.1 sparse
  storage the paper assumes, the *measured* activation cache of the model really trained (saved-tensor
  hooks), and the 3·b·Σξ top-ξ buffer in adjustment rounds.

Diagnostics of the reproduction checks are kept in ``ServerState.meta["adjust_log"]`` (one record per
adjustment: ξ, overlap of the dropped set with θ_low, the global ‖θ_low‖ ratio, and — filled in by
``evaluate`` — the test accuracy just before and just after the mask update).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
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
from shared.devices import TrainingFootprint, measure_activation_bytes
from shared.models.dynamic_sparse import (
    fan_in_scaled,
    growth_gradients,
    is_adjust_round,
    layer_positions,
    prunable_weights,
    prune_and_grow,
    random_masks,
    set_masks,
    smallest_active,
    sparse_param_bytes,
    topk_pruned,
    xi_count,
)
from shared.models.state import load_arrays, model_arrays

MASK = "mask/"
GRAD = "grad/"
PRE = "pre/"
PRE_MASK = "premask/"


class DynamicPruningOptions(BaseModel):
    """Options shared by FedTiny, FedDST and FedMef; defaults are spec §8's small-scale schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: target density 1 − s_tm of the prunable weights (the paper's "s_tm ∈ {0.05, 0.1, 0.2}")
    density: float = Field(0.1, gt=0, le=1)
    #: how the density is spread over layers (spec §2.2: unstated; uniform by default)
    mask_distribution: Literal["uniform", "erk"] = "uniform"
    #: initial mask: random (the paper) or by |θ_0| per layer (FL-PQSU's static pruning)
    mask_init: Literal["random", "magnitude"] = "random"
    #: conv/linear modules left dense (spec §8: TinyCNN's 1→16 first conv)
    dense_layers: tuple[str, ...] = ("conv1",)
    #: ΔR: rounds between mask adjustments; 0 = never (a static mask, FL-PQSU)
    delta_r: int = Field(4, ge=0)
    #: R_stop: no adjustment from this round on (0-based rounds)
    r_stop: int = Field(24, ge=1)
    #: Algorithm 1's literal predicate (r mod ΔR = 0 and r ≤ R_stop, including r = 0), spec §9.7
    literal_schedule: bool = False
    #: per-round exponential decay of the learning rate, η_r = η_0 · decay^r (η_0 = train.lr)
    lr_decay: float = Field(0.95, gt=0, le=1)
    #: minibatches averaged for the regrowth gradient (None = one pass over the local data, §3.5)
    grow_batches: int | None = Field(None, ge=1)
    #: initial weights under the initial mask: ``masked`` = θ_0 ⊙ M (the papers), ``fan_in`` = each
    #: unit rescaled to its sparse fan-in (``dynamic_sparse.fan_in_scaled``) — what lets a
    #: normalisation-free model learn at 10 % density (docs/algorithms/README.md, fleet comparison)
    sparse_init: Literal["masked", "fan_in"] = "masked"


class DynamicPruning(Strategy):
    """Federated dynamic pruning with server-side prune/grow (FedTiny's protocol; see module doc)."""

    Options = DynamicPruningOptions

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.opts = typed_options(ctx.options, DynamicPruningOptions)
        model = self.train_model()
        self.prunable = prunable_weights(model, self.opts.dense_layers)
        if not self.prunable:
            raise ValueError(f"{self.name}: the model has no prunable conv/linear weight")
        params = dict(model.named_parameters())
        self.shapes = {n: tuple(params[n].shape) for n in self.prunable}
        init = random_masks(
            self.shapes,
            self.opts.density,
            derive_seed(self.ctx.seed, "dst-mask"),
            self.opts.mask_distribution,
        )
        #: nnz per prunable weight: fixed for the whole run (prune ξ, grow ξ)
        self.nnz = {n: int(m.sum()) for n, m in init.items()}
        self._init_masks = init

    # -- model variants (overridden by FedMef) ---------------------------------------------------
    def train_model(self) -> nn.Module:
        """The model a device trains (FedTiny/FedDST: the factory's, e.g. TinyCNN with BN)."""
        return self.ctx.model_factory()

    def task_model(self, task: TaskSpec) -> nn.Module:
        return self.train_model()

    @cached_property
    def _float_names(self) -> list[str]:
        return [k for k, v in model_arrays(self.train_model()).items() if v.dtype.kind == "f"]

    # -- schedule --------------------------------------------------------------------------------
    def is_adjust(self, r: int) -> bool:
        return is_adjust_round(r, self.opts.delta_r, self.opts.r_stop, literal=self.opts.literal_schedule)

    def xi(self, r: int) -> dict[str, int]:
        return {
            n: xi_count(r, self.opts.r_stop, self.nnz[n], math.prod(self.shapes[n])) for n in self.prunable
        }

    def eta(self, r: int) -> float:
        return float(self.ctx.train.lr * self.opts.lr_decay**r)

    # -- server half -----------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        arrays = model_arrays(self.train_model())
        masks = self._init_masks
        if self.opts.mask_init == "magnitude":
            masks = {}
            for n in self.prunable:
                keep = np.argsort(-np.abs(arrays[n].reshape(-1)), kind="stable")[: self.nnz[n]]
                flat = np.zeros(arrays[n].size, dtype=np.bool_)
                flat[keep] = True
                masks[n] = flat.reshape(self.shapes[n])
        for n in self.prunable:
            if self.opts.sparse_init == "fan_in":
                arrays[n] = fan_in_scaled(arrays[n], masks[n])
            else:
                arrays[n] = (arrays[n] * masks[n]).astype(np.float32)
            arrays[MASK + n] = masks[n].astype(np.uint8)
        return ServerState(arrays, {"adjust_log": []})

    def masks(self, state: ServerState, prefix: str = MASK) -> dict[str, np.ndarray]:
        return {n: np.asarray(state.arrays[prefix + n], dtype=np.bool_) for n in self.prunable}

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        r = round - 1
        adjust = self.is_adjust(r)
        masks = self.masks(state)
        tensors: dict[str, codec.Tensor] = {}
        for name in self._float_names:
            arr = np.ascontiguousarray(state.arrays[name], dtype=np.float32)
            tensors[name] = codec.Sparse.from_dense(arr, masks[name]) if name in masks else codec.Dense(arr)
        config: dict[str, Any] = {"r": r, "adjust": adjust, "lr": self.eta(r)}
        if adjust:
            config["xi"] = self.xi(r)
        # one TaskSpec for every device: the server encodes it once
        return dict.fromkeys(devices, TaskSpec(tensors, config))

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        if partial is None or partial.scalars.get("weight", 0.0) <= 0:
            return state
        weight = partial.scalars["weight"]
        r = round - 1
        masks = self.masks(state)
        arrays = {k: v for k, v in state.arrays.items() if not k.startswith((PRE, PRE_MASK))}
        for name in self._float_names:
            total = partial.arrays.get(f"sum/{name}")
            if total is None:
                continue
            avg = total / weight
            if name in masks:
                full = np.zeros(masks[name].size, dtype=np.float64)
                full[np.flatnonzero(masks[name].reshape(-1))] = avg
                avg = full.reshape(masks[name].shape)
            arrays[name] = avg.astype(np.float32)
        meta = {**state.meta, "adjust_log": list(state.meta.get("adjust_log", []))}
        self.aggregate_extra(arrays, masks, partial, weight)
        if self.is_adjust(r):
            self.adjust_masks(state, arrays, masks, partial, weight, r, meta)
        return ServerState(arrays, meta)

    def aggregate_extra(
        self, arrays: dict[str, np.ndarray], masks: dict[str, np.ndarray], partial: Partial, weight: float
    ) -> None:
        """Hook for what else a round's partial carries (FedDST's mask-aware sums)."""

    def adjust_masks(
        self,
        state: ServerState,
        arrays: dict[str, np.ndarray],
        masks: dict[str, np.ndarray],
        partial: Partial,
        weight: float,
        r: int,
        meta: dict[str, Any],
    ) -> None:
        """The server's prune/grow of §2.6 (in place on ``arrays``), with the check-3 diagnostics."""
        xi = self.xi(r)
        rng = np.random.default_rng(derive_seed(self.ctx.seed, "grow-fill", r) % (2**32))
        overlap_hits = total_xi = 0
        low_before = low_after = 0.0
        for n in self.prunable:
            arrays[PRE + n] = arrays[n].copy()
            arrays[PRE_MASK + n] = masks[n].astype(np.uint8)
            g = partial.arrays.get(f"gsum/{n}")
            grad = np.zeros(self.shapes[n]) if g is None else g / weight
            new, dropped, _grown = prune_and_grow(arrays[n], masks[n], grad, xi[n], rng)
            # θ_low: what every client marked from the received θ_t (spec §3.4), vs what is dropped
            low = smallest_active(state.arrays[n], masks[n], xi[n])
            overlap_hits += len(np.intersect1d(low, dropped))
            total_xi += xi[n]
            low_before += float(np.sum(np.asarray(state.arrays[n], np.float64).reshape(-1)[low] ** 2))
            low_after += float(np.sum(np.asarray(arrays[n], np.float64).reshape(-1)[low] ** 2))
            arrays[n] = (arrays[n] * new).astype(np.float32)
            arrays[MASK + n] = new.astype(np.uint8)
        meta["adjust_log"].append(
            {
                "round": r + 1,
                "r": r,
                "xi_total": total_xi,
                "overlap": overlap_hits / total_xi if total_xi else None,
                "global_low_norm_ratio": math.sqrt(low_after / low_before) if low_before > 0 else None,
            }
        )

    def density(self, state: ServerState) -> float:
        masks = self.masks(state)
        return float(sum(int(m.sum()) for m in masks.values()) / sum(m.size for m in masks.values()))

    def load_model(self, state: ServerState, weights: str = "", mask_prefix: str = MASK) -> nn.Module:
        """The global model (``weights=PRE``, ``mask_prefix=PRE_MASK``: the one before the mask update)."""
        model = self.train_model()
        names = model.state_dict()
        arrays = {k: state.arrays[(weights + k) if (weights + k) in state.arrays else k] for k in names}
        load_arrays(model, arrays)
        set_masks(
            model,
            {n: torch.from_numpy(m.astype(np.float32)) for n, m in self.masks(state, mask_prefix).items()},
        )
        return model

    def evaluate(self, state: ServerState, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Test accuracy of the global model; after a mask update also of the model just before it.

        Why here: only ``evaluate`` sees the test set. The before/after pair (check 3, the "post-pruning
        drop") is appended to this round's ``adjust_log`` record in ``state.meta`` (checkpointed with the
        state) and returned as ``accuracy_before_adjust`` (``rounds.csv`` column
        ``e_accuracy_before_adjust``, empty in rounds without an adjustment).
        """
        out = evaluate(self.load_model(state), x, y)
        log = state.meta.get("adjust_log") or []
        if log and PRE + self.prunable[0] in state.arrays and "acc_after" not in log[-1]:
            before = evaluate(self.load_model(state, PRE, PRE_MASK), x, y)
            log[-1]["acc_before"] = before["accuracy"]
            log[-1]["acc_after"] = out["accuracy"]
            out["accuracy_before_adjust"] = before["accuracy"]
        return out

    # -- client half -----------------------------------------------------------------------------
    def load_task(self, task: TaskSpec) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """Build the training model from a task: weights (zero off the mask) and the masks."""
        model = self.train_model()
        arrays = model_arrays(model)
        masks: dict[str, torch.Tensor] = {}
        for name, t in task.tensors.items():
            if isinstance(t, codec.Sparse):
                arrays[name] = t.to_dense()
                masks[name] = torch.from_numpy(t.mask().astype(np.float32))
            elif isinstance(t, codec.Dense):
                arrays[name] = np.asarray(t.array)
            else:
                raise codec.CodecError("kind", f"{name}: unexpected {type(t).__name__} in a task")
        load_arrays(model, arrays)
        set_masks(model, masks)
        return model, masks

    def local_training(
        self,
        model: nn.Module,
        masks: dict[str, torch.Tensor],
        device: DeviceContext,
        config: dict[str, Any],
    ) -> dict[str, float]:
        """E epochs of masked SGD at η_r (FedMef overrides this with extrusion in adjustment rounds)."""
        eta = float(config["lr"])
        data = device.data
        return local_sgd(
            model, data.x_train, data.y_train, self.ctx.train, device.seed, masks=masks, lr=lambda _t: eta
        )

    def values_payload(self, model: nn.Module, masks: dict[str, torch.Tensor]) -> dict[str, codec.Tensor]:
        """Prunable weights as their values on the mask (flat order), everything else dense."""
        state = model_arrays(model)
        out: dict[str, codec.Tensor] = {}
        for name in self._float_names:
            if name in masks:
                keep = masks[name].numpy().reshape(-1) > 0
                out[name] = codec.Dense(np.ascontiguousarray(state[name].reshape(-1)[keep], dtype=np.float32))
            else:
                out[name] = codec.Dense(state[name])
        return out

    def gradient_lists(
        self, model: nn.Module, masks: dict[str, torch.Tensor], device: DeviceContext, xi: dict[str, int]
    ) -> dict[str, codec.Tensor]:
        """Top-ξ_l (index, gradient) per layer over the pruned positions (Alg. 1 lines 17-22)."""
        grads = growth_gradients(
            model,
            self.prunable,
            device.data.x_train,
            device.data.y_train,
            batch_size=self.ctx.train.batch_size,
            max_batches=self.opts.grow_batches,
        )
        out: dict[str, codec.Tensor] = {}
        for n in self.prunable:
            idx, vals = topk_pruned(grads[n], masks[n], int(xi.get(n, 0)))
            out[GRAD + n] = codec.Sparse(self.shapes[n], idx, vals)
        return out

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        model, masks = self.load_task(task)
        config = dict(task.config)
        adjust = bool(config.get("adjust", False))
        metrics = self.local_training(model, masks, device, config)
        tensors = self.values_payload(model, masks)
        if adjust:
            tensors.update(self.gradient_lists(model, masks, device, dict(config.get("xi", {}))))
        metrics["adjust"] = float(adjust)
        return UpdateSpec(tensors, num_samples=len(device.data.y_train), metrics=metrics)

    # -- aggregation half ------------------------------------------------------------------------
    @cached_property
    def _full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in model_arrays(self.train_model()).items() if v.dtype.kind == "f"}

    def validate_update(self, update: UpdateSpec) -> None:
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")
        names = {k for k in update.tensors if not k.startswith(GRAD)}
        if names != set(self._full_shapes):
            raise codec.CodecError("tensor", f"update names {sorted(names)[:4]}... do not match the model")
        for name, t in update.tensors.items():
            if name.startswith(GRAD):
                w = name[len(GRAD) :]
                if w not in self.shapes or not isinstance(t, codec.Sparse) or t.shape != self.shapes[w]:
                    raise codec.CodecError(
                        "tensor", f"{name}: expected a sparse gradient list of a prunable weight"
                    )
                if not np.all(np.isfinite(t.values)):
                    raise codec.CodecError("tensor", f"{name}: non-finite gradient values")
                self._check_xi(name, w, t.nnz, update.round)
            elif name in self.shapes:
                self.validate_weight(name, t)
            elif not isinstance(t, codec.Dense) or t.array.shape != self._full_shapes[name]:
                raise codec.CodecError("tensor", f"{name}: expected dense {self._full_shapes[name]}")

    def _check_xi(self, name: str, weight: str, entries: int, round: int | None) -> None:
        """A top-ξ list has exactly ξ_l(r) entries (fewer only if the layer has fewer pruned
        positions) and exists only in adjustment rounds; without the round, at most ξ_max."""
        if round is None:
            if entries > math.ceil(0.4 * self.nnz[weight]):
                raise codec.CodecError("tensor", f"{name}: more than ξ_max entries")
            return
        r = round - 1
        if not self.is_adjust(r):
            raise codec.CodecError("tensor", f"{name}: a gradient list in round {round}, no adjustment round")
        expected = min(self.xi(r)[weight], math.prod(self.shapes[weight]) - self.nnz[weight])
        if entries != expected:
            raise codec.CodecError("tensor", f"{name}: {entries} entries, round {round} wants ξ={expected}")

    def validate_weight(self, name: str, t: codec.Tensor) -> None:
        """A prunable weight travels as its nnz values (the support is the server's mask)."""
        if not isinstance(t, codec.Dense) or t.array.shape != (self.nnz[name],):
            raise codec.CodecError("tensor", f"{name}: expected the {self.nnz[name]} values on the mask")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        n = float(update.num_samples)
        arrays: dict[str, np.ndarray] = {}
        for name, t in update.tensors.items():
            if name.startswith(GRAD):
                assert isinstance(t, codec.Sparse)
                arrays[f"gsum/{name[len(GRAD) :]}"] = t.to_dense().astype(np.float64) * n
            elif isinstance(t, codec.Sparse):  # FedDST: a weight with its own (local) mask
                arrays[f"dsum/{name}"] = t.to_dense().astype(np.float64) * n
                arrays[f"dcnt/{name}"] = t.mask().astype(np.float64) * n
            else:
                assert isinstance(t, codec.Dense)
                arrays[f"sum/{name}"] = np.asarray(t.array, dtype=np.float64) * n
        return partial.add(Partial(arrays, {"weight": n}))

    # -- accounting ------------------------------------------------------------------------------
    def accounting_key(self, task: TaskSpec) -> Hashable:
        xi = task.config.get("xi", {}) if task.config.get("adjust") else {}
        return ("dst", bool(task.config.get("adjust")), int(sum(xi.values())))

    @cached_property
    def _activation_bytes(self) -> int:
        """Measured bytes autograd saves for one training batch (saved-tensor hooks, shared/devices)."""
        model = self.train_model()
        masks = {n: torch.from_numpy(m.astype(np.float32)) for n, m in self._init_masks.items()}
        set_masks(model, masks)
        batch = torch.zeros((self.ctx.train.batch_size, *self.ctx.input_shape))
        return measure_activation_bytes(model, batch)

    def _resident_bytes(self) -> tuple[int, int]:
        """(weights + buffers, gradients) in the App. C.1 sparse storage; buffers and dense tensors whole."""
        model = self.train_model()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        params = sparse_param_bytes(shapes, self.nnz)
        buffers = sum(
            b.numel() * b.element_size() for n, b in model.named_buffers() if not n.endswith("mask")
        )
        return params + buffers, params

    @cached_property
    def _momentum_bytes(self) -> int:
        """One float32 per trainable value: nnz per prunable weight, every element of the rest."""
        params = dict(self.train_model().named_parameters())
        return sum(4 * (self.nnz[n] if n in self.nnz else p.numel()) for n, p in params.items())

    def task_footprint(self, task: TaskSpec) -> TrainingFootprint:
        """Sparse weights + sparse gradients + the measured activation cache (+ 3·b·Σξ when adjusting).

        Why not the base accountant: it counts dense parameter and gradient tensors, while the paper's
        (and an on-device sparse runtime's) weights live in the App. C.1 storage; and for FedMef the
        activation term must be the *pruned, packed* cache, which only a measurement of the SAP model
        sees. Plain SGD has no optimizer state (the paper's setting); with ``train.momentum`` > 0 the
        momentum buffer holds one value per trainable value (the sparse weights' values only, since
        a pruned position's gradient is masked to 0 and its buffer stays 0).
        """
        key = self.accounting_key(task)
        cache: dict[Hashable, TrainingFootprint] = self.__dict__.setdefault("_fp_cache", {})
        if key not in cache:
            params, grads = self._resident_bytes()
            xi_total = int(key[2]) if isinstance(key, tuple) else 0
            cache[key] = TrainingFootprint(
                params_bytes=params,
                grads_bytes=grads + 3 * 4 * xi_total,
                optimizer_bytes=self._momentum_bytes if self.ctx.train.momentum > 0 else 0,
                activations_bytes=self._activation_bytes,
            )
        return cache[key]

    @cached_property
    def _positions(self) -> dict[str, int]:
        return layer_positions(self.train_model(), self.ctx.input_shape)

    def task_flops(self, task: TaskSpec, num_samples: int) -> int:
        """Forward 2·nnz·positions per layer, backward about twice that (spec §4.3); in adjustment
        rounds one more pass with the dense weight gradient (2·numel·positions) for the top-ξ lists."""
        dense = {n: p.numel() for n, p in self.train_model().named_parameters() if n in self._positions}
        fwd = sum(2 * self.nnz.get(n, k) * self._positions[n] for n, k in dense.items())
        total = 3 * fwd * num_samples * self.ctx.train.local_epochs
        if task.config.get("adjust"):
            total += (fwd + sum(2 * k * self._positions[n] for n, k in dense.items())) * num_samples
        return int(total)
