"""SpaFL (Kim, Saad, Debbah, Hong, NeurIPS 2024): federated learning that communicates only thresholds.

Every output neuron (linear) or filter (conv) has a trainable threshold tau_i; the row of weights is
structurally pruned while its mean |w| is not above tau_i. Devices train their weights and
thresholds together; **only the threshold vectors travel** (tau_num floats, about 1% of d for the
digits MLP), and the weights never leave the device, so every device ends with its own personalised
sparse model. The spec is ``docs/algorithms/spafl.md``: the § numbers below are its *Spec sections*,
and it lists every interpretation taken where the paper is vague.

The four halves:

* **server** — holds only the global thresholds tau(t) (``tau/<layer>``) and the last change
  Δtau(t-1) = tau(t) - tau(t-1) (``dtau/<layer>``). A task carries tau(t) and, from round 2, Δtau(t-1)
  as :class:`~shared.codec.Threshold` payloads (§2.4: the Δtau vector is the spec's recommended way to
  let a device that missed the previous round apply eq. 13; its bytes are the same again, and the
  tensor names keep them apart from the paper-comparable tau bytes). ``finalize`` is eq. 7, the plain
  unweighted mean of the received tau_k — no weighting by data size (§2.6, §9.16).
* **client** — loads its personal weights (and its own last tau_k) from ``DeviceContext.state_dir``
  (the first time: the experiment's deterministic w(0), tau = 0, identical on every device), applies
  eq. 13 with Δtau (sign rule of §3.4/§9.1), sets tau_k = tau(t), trains weights and thresholds with
  momentum SGD on CE + alpha*sum(exp(-tau)) through the identity straight-through estimator
  (optionally clamping), applies the per-layer collapse guard, evaluates its personalised model on its
  own test split (§2.7), saves its state and uploads tau_k only.
* **aggregation** — sums of tau_k per layer and a count: associative and commutative, so any number
  of aggregators in any order give the same mean.
* **accounting** — the device reports its density (parameter-weighted in ``density``, the paper's
  layer average in ``density_layer_avg``) and its training FLOPs twice: ``train_flops`` in the
  framework's convention (``task_flops``: every layer's dense cost times its density; this also sets
  the emulated compute time), ``train_flops_paper`` by spec §4.3 (MACs x density x 3, plus 1.5·d when
  eq. 13 ran).

Variants (options): ``mode: local_only`` is the paper's *Local* baseline — the same pruning, no
threshold exchange: tasks and updates carry no tensors at all (the framework still needs a task
to start the device and an update to close the round, so only message headers move), and each device
keeps its own tau_k between its rounds. ``importance_update: false`` is *SpaFL w.o. (13)*; the server
then sends no Δtau either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

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
)
from shared.algorithms.training import evaluate, local_sgd
from shared.devices.flops import layer_flops
from shared.models.spafl_layers import MaskedConv2d, MaskedLayer, convert, masked_layers
from shared.schemas import MetricKey

TAU = "tau/"
DTAU = "dtau/"
#: device state files ``spafl-<round>.npz`` (``shared.algorithms.device_state``)
STATE_PREFIX = "spafl"


class SpaFLOptions(BaseModel):
    """``algorithm.options`` of SpaFL; every default is the spec's recommended reading except ``clamp``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: sparsity coefficient α of the regulariser α·Σ exp(−τ) (paper: 0 ≤ α ≤ 1)
    alpha: float = Field(0.001, ge=0.0, le=1.0)
    #: ``spafl``, or ``local_only``: the same pruning with no communication (the paper's *Local*)
    mode: Literal["spafl", "local_only"] = "spafl"
    #: apply eq. 13 (importance from Δτ) before local training; False = *SpaFL w.o. (13)*
    importance_update: bool = True
    #: where Δτ comes from: sent by the server (τ(t) − τ(t−1), default, §2.4) or formed on the device
    #: as τ(t) − (the last global τ this device received; τ(0) = 0 counts as received)
    delta_source: Literal["server", "since_last_seen"] = "server"
    #: eq. 13's divisor: the paper's n_in (= c_in·k·h for conv) or the reference code's kernel area k·h
    importance_divisor: Literal["n_in", "kernel_area"] = "n_in"
    #: let the gradient also reach W through μ = mean|W| in the mask (the code's autograd, §9.5)
    mask_path_gradient: bool = True
    #: clamp masked weights to [−1, 1] and thresholds to [0, 1] after every step (paper §3.3). Off by
    #: default, unlike the spec's §9.7 suggestion: its premise "rarely binding" does not hold — the
    #: lower bound τ ≥ 0 binds for every important unit (the identity STE drives their τ below 0), and
    #: on digits it makes the layers collapse (docs/algorithms/spafl.md). The authors' code clips out
    #: of place, i.e. never.
    clamp: bool = False
    #: layer-collapse guard: a layer whose mask density is ≤ this after a step gets τ^l ← 0
    #: (paper A.1: 1%); None switches the guard off (only for showing what it prevents)
    reset_density: float | None = Field(0.01, ge=0.0, lt=1.0)
    #: qualified names of linear/conv layers to leave unmasked (e.g. ResNet-18's final ``fc``)
    unmasked_layers: tuple[str, ...] = ()
    #: False: the paper's Table 1 ablation (spec §8 check 5, *thresholds-only learning*) — the weights
    #: stay at w(0) on every device and only τ_k trains (and travels, as always); eq. 13 is skipped
    #: because it is a step on the weights. The FLOP counts still include the weight gradients: the
    #: ablation is about what τ alone can learn, not about its cost
    train_weights: bool = True


@dataclass(frozen=True)
class LayerInfo:
    """Static facts about one masked layer (same on every service, derived from the model)."""

    name: str
    n_out: int
    n_in: int
    #: eq. 13's divisor for this layer (n_in, or k·h for conv under ``importance_divisor: kernel_area``)
    n_div: int
    #: number of (maskable) weights, n_out · n_in
    numel: int
    #: dense forward multiply-accumulates per sample (§4.3: FLOPs are counted as MACs)
    fwd_macs: int


def layer_infos(model: nn.Module, input_shape: tuple[int, ...], divisor: str = "n_in") -> list[LayerInfo]:
    """Sizes and per-sample forward MACs of ``model``'s masked layers (one probe forward pass)."""
    layers = masked_layers(model)
    out_sizes: dict[str, int] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, name=name: out_sizes.__setitem__(name, out[0].numel()))
        for name, m in layers.items()
    ]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros((1, *input_shape)))
    model.train(was_training)
    for h in hooks:
        h.remove()
    infos = []
    for name, m in layers.items():
        # one output element costs n_in MACs: linear out = n_out, conv out = n_out·H·W
        macs = out_sizes[name] * m.n_in
        n_div = m.kernel_area if divisor == "kernel_area" and isinstance(m, MaskedConv2d) else m.n_in
        infos.append(LayerInfo(name, m.n_out, m.n_in, n_div, m.n_out * m.n_in, macs))
    return infos


def apply_importance_update(layer: MaskedLayer, dtau: torch.Tensor, n_div: int) -> None:
    """Eq. 13 with the sign rule of spec §3.4/§9.1: W_ij ← W_ij − (Δτ_i / n_div) · sign(Σ_j W_ij).

    The step has magnitude |Δτ_i|/n_div; it decreases the row when sign(Δτ_i) equals the sign of the
    row sum and increases it when they differ (the paper's "XOR"). A zero row sum gives no update.
    Pruned rows are updated too.
    """
    with torch.no_grad():
        w = layer.weight
        s = torch.sign(w.flatten(1).sum(1))
        step = (dtau.to(w.dtype) / float(n_div)) * s
        w.sub_(step.view((-1,) + (1,) * (w.dim() - 1)))


def densities(model: nn.Module) -> tuple[float, float, dict[str, float]]:
    """(parameter-weighted density, layer-averaged density, per-layer density) of the current masks.

    Masks are row-structured, so a layer's weight density equals its fraction of active rows.
    """
    per_layer: dict[str, float] = {}
    active = total = 0.0
    for name, layer in masked_layers(model).items():
        rho = float(layer.current_mask().mean())
        per_layer[name] = rho
        active += rho * layer.weight.numel()
        total += layer.weight.numel()
    layer_avg = float(np.mean(list(per_layer.values()))) if per_layer else 1.0
    return (active / total if total else 1.0), layer_avg, per_layer


class SpaFL(Strategy):
    name = "spafl"
    Options = SpaFLOptions
    personalised = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        assert isinstance(ctx.options, SpaFLOptions)
        self.opts: SpaFLOptions = ctx.options
        self.layers = layer_infos(self.build_model(), ctx.input_shape, self.opts.importance_divisor)
        if not self.layers:
            raise ValueError("SpaFL needs at least one linear or conv layer to mask")
        # the framework's per-sample training FLOPs of each layer at full density (2·MACs forward,
        # autograd's backward terms); a pruned layer costs its density times that
        names = {li.name for li in self.layers}
        self._dense_layer_flops: dict[str, int] = {}
        self._unmasked_flops = 0
        for row in layer_flops(self.ctx.model_factory(), ctx.input_shape):
            if row.name in names:
                self._dense_layer_flops[row.name] = self._dense_layer_flops.get(row.name, 0) + row.total
            else:
                self._unmasked_flops += row.total
        #: per-sample FLOPs of the task just trained, by ``id(task)``, for :meth:`task_flops`
        self._trained_flops: dict[int, float] = {}

    # -- model -------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The experiment's model at w(0) (deterministic: the same on every device), masked, τ = 0."""
        return convert(
            self.ctx.model_factory(),
            exclude=self.opts.unmasked_layers,
            mask_path_gradient=self.opts.mask_path_gradient,
        )

    @property
    def tau_num(self) -> int:
        """Number of thresholds, Σ_l n_out^l: the length of every payload in both directions."""
        return sum(li.n_out for li in self.layers)

    @property
    def d(self) -> int:
        """Number of maskable weights, Σ_l n_out^l · n_in^l."""
        return sum(li.numel for li in self.layers)

    @property
    def _sends_dtau(self) -> bool:
        o = self.opts
        return o.mode == "spafl" and o.importance_update and o.delta_source == "server"

    def dense_train_flops(self, num_samples: int, epochs: int) -> float:
        """Training FLOPs of one round for the unpruned model (ρ = 1): FedAvg's cost by §4.3."""
        return float(3 * sum(li.fwd_macs for li in self.layers) * num_samples * epochs)

    def paper_train_flops(
        self, per_layer_density: dict[str, float], num_samples: int, importance: bool
    ) -> float:
        """§4.3 (paper A.5, eq. 50 with ρ_l): Σ_l 3·ρ_l·MACs_l·n_k·E, plus 1.5·d if eq. 13 ran."""
        epochs = self.ctx.train.local_epochs
        macs = sum(per_layer_density[li.name] * li.fwd_macs for li in self.layers)
        return 3.0 * macs * num_samples * epochs + (1.5 * self.d if importance else 0.0)

    def sparse_sample_flops(self, per_layer_density: dict[str, float]) -> float:
        """The framework's per-sample training FLOPs (``shared.devices.flops``) of the pruned model."""
        return self._unmasked_flops + sum(
            per_layer_density[name] * f for name, f in self._dense_layer_flops.items()
        )

    # -- accounting (framework hooks) ----------------------------------------------------------------
    def task_flops(self, task: TaskSpec, num_samples: int) -> int:
        """Training FLOPs of the task with the device's own masks (emulated compute time, ``train_flops``).

        The cost depends on the density the device reached, which only its training knows, so ``train``
        leaves it here for the client to ask right after. Asked about a task not trained (yet), the
        answer is the dense cost: an upper bound.
        """
        per_sample = self._trained_flops.pop(id(task), None)
        if per_sample is None:
            return super().task_flops(task, num_samples)
        return round(per_sample * num_samples * self.ctx.train.local_epochs)

    # -- server half -------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        """τ(0) = 0 (paper A.1). The server never holds weights: w(0) is the shared deterministic init."""
        arrays: dict[str, np.ndarray] = {}
        for li in self.layers:
            arrays[TAU + li.name] = np.zeros(li.n_out, dtype=np.float32)
            arrays[DTAU + li.name] = np.zeros(li.n_out, dtype=np.float32)
        return ServerState(arrays, {"dtau_valid": False})

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        tensors: dict[str, codec.Tensor] = {}
        if self.opts.mode == "spafl":
            tensors = {TAU + li.name: codec.Threshold(state.arrays[TAU + li.name]) for li in self.layers}
            if self._sends_dtau and state.meta.get("dtau_valid"):
                for li in self.layers:
                    tensors[DTAU + li.name] = codec.Threshold(state.arrays[DTAU + li.name])
        task = TaskSpec(tensors)  # one object: the server encodes it once for all devices
        return dict.fromkeys(devices, task)

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        """Eq. 7: τ(t+1) = (1/K) Σ_k τ_k(t) over the updates received; Δτ(t) = τ(t+1) − τ(t)."""
        if self.opts.mode == "local_only":
            return state
        arrays = dict(state.arrays)
        meta = dict(state.meta)
        count = partial.scalars.get("count", 0.0) if partial is not None else 0.0
        for li in self.layers:
            old = state.arrays[TAU + li.name]
            if partial is None or count <= 0:
                new = old  # nothing arrived: τ unchanged, so Δτ(t) is zero
            else:
                new = (partial.arrays[TAU + li.name] / count).astype(np.float32)
            arrays[TAU + li.name] = new
            arrays[DTAU + li.name] = (new - old).astype(np.float32)
        if partial is not None and count > 0:
            meta["dtau_valid"] = True
        return ServerState(arrays, meta)

    # -- client half -------------------------------------------------------------------------------
    def _received(self, task: TaskSpec, prefix: str) -> dict[str, np.ndarray] | None:
        """The task's ``prefix`` threshold vectors by layer, checked; None if the task has none."""
        names = {k for k in task.tensors if k.startswith(prefix)}
        if not names:
            return None
        expected = {prefix + li.name: li.n_out for li in self.layers}
        if names != set(expected):
            raise codec.CodecError(
                "tensor", f"task {prefix}* names {sorted(names)[:4]} do not match the model"
            )
        out = {}
        for li in self.layers:
            t = task.tensors[prefix + li.name]
            if not isinstance(t, codec.Threshold) or t.array.shape != (li.n_out,):
                raise codec.CodecError(
                    "tensor", f"{prefix}{li.name}: expected a threshold vector ({li.n_out},)"
                )
            out[li.name] = np.array(t.array, dtype=np.float32)  # writable copy
        return out

    def personal_model(self, state_dir: Path) -> nn.Module:
        """A device's current personalised model (weights and own τ_k); w(0), τ = 0 if it never trained."""
        model = self.build_model()
        saved = device_state.load_latest(state_dir, STATE_PREFIX)
        if saved is not None:
            load_arrays(
                model, {k.removeprefix("model/"): v for k, v in saved.items() if k.startswith("model/")}
            )
        return model

    def evaluate_device(self, task: TaskSpec, device: DeviceContext) -> dict[str, float] | None:
        """The device's current personalised model (its weights and own τ_k) on its test split."""
        model = self.personal_model(device.state_dir)
        ev = evaluate(model, device.data.x_test, device.data.y_test)
        density, layer_avg, _ = densities(model)
        return {
            "eval_accuracy": ev["accuracy"],
            "eval_loss": ev["loss"],
            "eval_samples": float(len(device.data.y_test)),
            "density": density,
            "density_layer_avg": layer_avg,
        }

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        """One round on a device (§3.5): start from the personal model with the global τ, train
        weights and τ_k locally, keep the model, send τ_k."""
        model = self.build_model()
        layers = masked_layers(model)
        last_seen, importance_applied = self._start(task, device, model, layers)
        stats = self._local_training(model, list(layers.values()), device)
        data = device.data
        density, layer_avg, per_layer = densities(model)
        ev = evaluate(model, data.x_test, data.y_test)
        n = len(data.y_train)
        per_sample = self.sparse_sample_flops(per_layer)
        if len(self._trained_flops) > 64:  # callers that never ask (direct loops) must not grow it
            self._trained_flops.clear()
        self._trained_flops[id(task)] = per_sample  # for task_flops(), which the client asks next

        arrays = {f"model/{k}": v for k, v in model_arrays(model).items()}
        arrays.update({f"last_tau/{k}": np.asarray(v, dtype=np.float32) for k, v in last_seen.items()})
        device_state.save(device.state_dir, STATE_PREFIX, device.round, arrays)

        tensors: dict[str, codec.Tensor] = {}
        if self.opts.mode == "spafl":
            tensors = {
                TAU + li.name: codec.Threshold(layers[li.name].tau.detach().numpy().astype(np.float32))
                for li in self.layers
            }
        reported = {
            MetricKey.TRAIN_LOSS: stats["train_loss"],
            MetricKey.EVAL_ACCURACY: ev["accuracy"],
            MetricKey.EVAL_LOSS: ev["loss"],
            MetricKey.EVAL_SAMPLES: float(len(data.y_test)),
            MetricKey.DENSITY: density,
            "density_layer_avg": layer_avg,
            # framework convention (shared.devices.flops); the client service overwrites it with
            # task_flops(), which is the same number
            MetricKey.TRAIN_FLOPS: float(round(per_sample * n * self.ctx.train.local_epochs)),
            # the paper's §4.3 count (MACs, backward = 2x forward, + 1.5·d for eq. 13)
            "train_flops_paper": self.paper_train_flops(per_layer, n, importance_applied),
        }
        return UpdateSpec(tensors, num_samples=n, metrics=reported)

    def _start(
        self, task: TaskSpec, device: DeviceContext, model: nn.Module, layers: dict[str, MaskedLayer]
    ) -> tuple[dict[str, np.ndarray], bool]:
        """Load the device's personal model, apply eq. 13's importance update and set τ_k = τ(t).

        Returns the global τ the device has now seen (kept for the next Δτ) and whether the
        importance update ran.
        """
        saved = device_state.load_before(device.state_dir, STATE_PREFIX, device.round)
        last_seen = {li.name: np.zeros(li.n_out, dtype=np.float32) for li in self.layers}
        if saved is not None:
            load_arrays(
                model, {k.removeprefix("model/"): v for k, v in saved.items() if k.startswith("model/")}
            )
            last_seen = {li.name: saved[f"last_tau/{li.name}"] for li in self.layers}
        if self.opts.mode != "spafl":
            if task.tensors:
                raise codec.CodecError("tensor", "a local-only SpaFL task carries no tensors")
            return last_seen, False
        glob = self._received(task, TAU)
        if glob is None:
            raise codec.CodecError("tensor", "a SpaFL task must carry the global thresholds tau/*")
        applied = False
        if self.opts.importance_update and self.opts.train_weights:
            delta = (
                self._received(task, DTAU)
                if self.opts.delta_source == "server"
                else {k: glob[k] - last_seen[k] for k in glob}
            )
            if delta is not None:
                for li in self.layers:
                    apply_importance_update(layers[li.name], torch.from_numpy(delta[li.name]), li.n_div)
                applied = True
        with torch.no_grad():
            for li in self.layers:
                layers[li.name].tau.copy_(torch.from_numpy(glob[li.name]))  # τ_k^0(t) = τ(t)
        return glob, applied

    def _local_training(
        self, model: nn.Module, layers: list[MaskedLayer], device: DeviceContext
    ) -> dict[str, float]:
        """SGD on weights and τ_k with the α Σ exp(−τ) penalty, the optional clamp and the collapse
        guard (paper A.1)."""
        opts = self.opts
        alpha = opts.alpha

        def penalty(_: nn.Module) -> torch.Tensor:
            return alpha * sum((torch.exp(-m.tau).sum() for m in layers), torch.zeros(()))

        def after_step(_: nn.Module) -> None:
            with torch.no_grad():
                for m in layers:
                    if opts.clamp:
                        m.weight.clamp_(-1.0, 1.0)
                        m.tau.clamp_(0.0, 1.0)
                    # collapse guard: judged on the mask of the forward pass just taken
                    if opts.reset_density is not None and float(m.last_mask.mean()) <= opts.reset_density:
                        m.tau.zero_()

        data = device.data
        stats = local_sgd(
            model,
            data.x_train,
            data.y_train,
            self.ctx.train,
            device.seed,
            penalty=penalty if alpha > 0 else None,
            after_step=after_step,
            # thresholds-only learning: the optimiser holds τ alone, so w(0) cannot move (momentum and
            # weight decay included)
            params=None if opts.train_weights else [m.tau for m in layers],
        )
        if opts.reset_density is not None:
            # The in-loop guard judges the mask of the forward pass *before* each step, so the last
            # step can still leave a layer dead; the same rule once more on the final mask keeps a
            # collapsed layer out of the uploaded τ_k and the personalised model.
            with torch.no_grad():
                for m in layers:
                    if float(m.current_mask().mean()) <= opts.reset_density:
                        m.tau.zero_()
        return stats

    # -- aggregation half --------------------------------------------------------------------------
    def validate_update(self, update: UpdateSpec) -> None:
        if self.opts.mode == "local_only":
            if update.tensors:
                raise codec.CodecError("tensor", "local-only SpaFL updates carry no tensors")
            return
        expected = {TAU + li.name: li.n_out for li in self.layers}
        if set(update.tensors) != set(expected):
            raise codec.CodecError(
                "tensor", f"update names {sorted(update.tensors)[:4]} are not the model's tau/* vectors"
            )
        for name, t in update.tensors.items():
            if not isinstance(t, codec.Threshold) or t.array.shape != (expected[name],):
                raise codec.CodecError("tensor", f"{name}: expected a threshold vector ({expected[name]},)")
            if not np.all(np.isfinite(t.array)):
                raise codec.CodecError("tensor", f"{name}: non-finite threshold")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """Unweighted: each device adds its τ_k and a count of 1 (eq. 7 has no D_k weighting)."""
        contribution = Partial(
            {k: np.asarray(codec.to_array(t), dtype=np.float64) for k, t in update.tensors.items()},
            {"count": 1.0},
        )
        return partial.add(contribution)
