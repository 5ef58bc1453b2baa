"""Federated dynamic pruning machinery shared by FedTiny, FedDST and FedMef (``docs/algorithms/fedmef.md``).

What lives here, and why it is shared:

* **masks and schedules** — the random initial mask (uniform or ERK densities, the same for every
  method of a seed), the adjustment predicate, the cosine prune/regrow count ξ (§3.2) and the REX
  budget factor p(t) of budget-aware extrusion (§3.4). Every service can compute them from the round
  number, so only the mask itself ever needs to travel.
* **prune / grow** — the server's rule (§2.6: drop the ξ smallest |θ| among kept weights, grow the ξ
  largest |aggregated gradient| among pruned ones) and the client's top-ξ gradient list (O(ξ) upload).
* **FedMef's layers** — :class:`NSConv2d` (normalised sparse convolution: filter-wise weight
  standardisation over the *unpruned* weights only, scaled by γ, Eq. 7 in the fan-in-corrected form of
  §3.3) and scaled activation pruning: the conv/linear input cache that backward needs is
  magnitude-pruned to ``keep`` of its entries and stored **packed** (a 1-bit map + the kept float32
  values), so autograd really holds less, and the memory accountant's saved-tensor measurement sees
  it. :class:`MaskReLU` keeps only a 1-bit sign map (a plain ReLU would keep its dense output alive and
  undo the saving, spec §9.14); :class:`LeanAvgPool2d` keeps nothing (its backward needs only shapes).
* **the paper's memory model** — App. C's sparse storage schemes (dense / bitmap / COO / CSR) and the
  per-method training footprints (§4.1-4.2), used for the reproduction check 1.
* **a masked SGD loop** with a per-step learning rate (the REX schedule changes it every step).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_input, conv2d_weight

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.floating[Any]]

# -- masks and schedules ----------------------------------------------------------------------------


def prunable_weights(model: nn.Module, dense_layers: Sequence[str] = ()) -> list[str]:
    """Names of the Conv2d/Linear weights that carry a mask (``dense_layers`` are module names left dense).

    Why the first conv is usually left dense (spec §8, §9.11): at density 0.1 a 1×3×3 filter keeps about
    one weight, and standardisation zeroes a single-weight filter.
    """
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d | nn.Linear | SparseLayer) and name not in dense_layers:
            out.append(f"{name}.weight")
    return out


def layer_densities(
    shapes: Mapping[str, tuple[int, ...]], density: float, distribution: Literal["uniform", "erk"]
) -> dict[str, float]:
    """Per-layer densities reaching ``density`` overall: the same everywhere (uniform) or ERK.

    ERK (Evci et al. 2020): density ∝ (Σ dims) / (Π dims), scaled so the kept total is ``density`` of
    all prunable weights; layers that would exceed 1 are made dense and the rest re-scaled.
    """
    if distribution == "uniform":
        return dict.fromkeys(shapes, density)
    numel = {k: math.prod(s) for k, s in shapes.items()}
    raw = {k: sum(s) / math.prod(s) for k, s in shapes.items()}
    dense: set[str] = set()
    while True:
        budget = density * sum(numel.values()) - sum(numel[k] for k in dense)
        rest = [k for k in shapes if k not in dense]
        eps = budget / sum(raw[k] * numel[k] for k in rest)
        over = [k for k in rest if eps * raw[k] > 1.0]
        if not over:
            out = {k: 1.0 for k in dense}
            out.update({k: eps * raw[k] for k in rest})
            return out
        dense.update(over)


def random_masks(
    shapes: Mapping[str, tuple[int, ...]],
    density: float,
    seed: int,
    distribution: Literal["uniform", "erk"] = "uniform",
) -> dict[str, BoolArray]:
    """Random masks with exactly ``round(numel · d_l)`` kept weights per layer (at least one).

    Each layer draws from its own generator keyed by (seed, layer name), so two methods whose models
    share the prunable layers get the *same* initial mask (spec §2.2, §9.20), whatever else differs.
    """
    out = {}
    for name, d in layer_densities(shapes, density, distribution).items():
        n = math.prod(shapes[name])
        k = min(n, max(1, round(n * d)))
        key = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little")
        rng = np.random.default_rng([seed % (2**63), key, len(name)])
        flat = np.zeros(n, dtype=np.bool_)
        flat[rng.choice(n, size=k, replace=False)] = True
        out[name] = flat.reshape(shapes[name])
    return out


def fan_in_scaled(weight: FloatArray, mask: BoolArray) -> FloatArray:
    """``weight ⊙ mask`` with each output unit's kept weights scaled by ``√(fan_in / kept fan_in)``.

    Why: a dense initialisation (variance ∝ 1/fan_in) masked to density d leaves each unit summing
    d·fan_in inputs, so every layer shrinks the signal by ≈ √d; at 10 % density a three-layer MLP
    without normalisation starts with near-constant logits and barely trains. Rescaling each unit
    to its *sparse* fan-in restores the dense variance (Evci et al. 2022, "Gradient flow in sparse
    neural networks"). A unit with no kept input is left at zero.
    """
    w = np.asarray(weight, dtype=np.float32).reshape(weight.shape[0], -1)
    m = np.asarray(mask, dtype=np.bool_).reshape(w.shape)
    kept = m.sum(axis=1, keepdims=True)
    scale = np.sqrt(w.shape[1] / np.maximum(kept, 1)).astype(np.float32)
    return np.asarray((w * m * scale).reshape(weight.shape), dtype=np.float32)


def is_adjust_round(r: int, delta_r: int, r_stop: int, *, literal: bool = False) -> bool:
    """Is round ``r`` (0-based: rounds completed before it) a mask-adjustment round? (spec §2.3, §9.7)

    Default: r ∈ {ΔR, 2ΔR, …} with r < R_stop (adjust "after several rounds", and r = R_stop would be a
    no-op with ξ = 0). ``literal``: Algorithm 1 as printed, r mod ΔR = 0 and r ≤ R_stop (includes r = 0).
    """
    if delta_r <= 0:
        return False
    if literal:
        return r % delta_r == 0 and r <= r_stop
    return r > 0 and r % delta_r == 0 and r < r_stop


def xi_fraction(r: int, r_stop: int) -> float:
    """ξ/n_l = 0.2 (1 + cos(π r / R_stop)): 0.4 at r = 0, 0.2 at R_stop/2, 0 from R_stop on."""
    if r >= r_stop:
        return 0.0
    return 0.2 * (1.0 + math.cos(math.pi * r / r_stop))


def xi_count(r: int, r_stop: int, n_active: int, numel: int) -> int:
    """floor(ξ fraction · n_l), capped so that ξ ≤ min(n_l, numel − n_l) (spec §3.2)."""
    xi = math.floor(xi_fraction(r, r_stop) * n_active + 1e-9)
    return max(0, min(xi, n_active, numel - n_active))


def rex_factor(t: int, budget: int) -> float:
    """REX p(t) = (2T − 2t) / (2T − t) (Eq. 3): 1 at t = 0, 2/3 at T/2, 0 at T; t counts within the round."""
    if budget <= 0:
        return 0.0
    t = min(max(t, 0), budget)
    return (2 * budget - 2 * t) / (2 * budget - t)


def extrusion_lr(t: int, budget: int, low_norm: float, eta0: float, eta_r: float) -> float:
    """μ = max(η_r, β), β = p(t) · (2σ(‖θ_low‖) − 1) · η_0 (Eqs. 3-4): β ≤ η_0 and shrinks with ‖θ_low‖."""
    beta = rex_factor(t, budget) * (2.0 / (1.0 + math.exp(-low_norm)) - 1.0) * eta0
    return max(eta_r, beta)


def smallest_active(weight: FloatArray, mask: BoolArray, k: int) -> npt.NDArray[np.int64]:
    """Flat indices of the ``k`` kept weights of smallest |w| (ties by index: a stable sort)."""
    active = np.flatnonzero(mask.reshape(-1))
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    mags = np.abs(np.asarray(weight, dtype=np.float64).reshape(-1)[active])
    return np.sort(active[np.argsort(mags, kind="stable")[:k]]).astype(np.int64)


def prune_and_grow(
    weight: FloatArray, mask: BoolArray, grad: FloatArray, xi: int, rng: np.random.Generator
) -> tuple[BoolArray, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The server's mask update of one layer (spec §2.6): returns (new mask, dropped, grown).

    Drop the ξ kept weights of smallest |w| (the *aggregated* weights), grow the ξ pruned positions of
    largest |aggregated gradient|. The two sets are disjoint (kept vs pruned), so nnz is unchanged.
    If fewer than ξ pruned positions have a non-zero gradient, the rest are drawn at random (§2.6 edge
    case).
    """
    flat_mask = mask.reshape(-1)
    dropped = smallest_active(weight, mask, xi)
    inactive = np.flatnonzero(~flat_mask)
    g = np.abs(np.asarray(grad, dtype=np.float64).reshape(-1)[inactive])
    order = np.argsort(-g, kind="stable")
    nonzero = order[g[order] > 0][:xi]
    grown = inactive[nonzero]
    if len(grown) < xi:
        rest = np.setdiff1d(inactive, grown)
        grown = np.concatenate([grown, rng.choice(rest, size=xi - len(grown), replace=False)])
    grown = np.sort(grown).astype(np.int64)
    new = flat_mask.copy()
    new[dropped] = False
    new[grown] = True
    return new.reshape(mask.shape), dropped, grown


def topk_pruned(grad: torch.Tensor, mask: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The client's top-ξ list: (sorted flat indices, values) of the ``k`` largest |grad| at pruned
    positions (Alg. 1 lines 17-22); signed values, so the server's sum can cancel disagreements."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    scores = grad.detach().abs().reshape(-1).clone()
    scores[mask.reshape(-1).bool()] = -1.0
    idx = torch.topk(scores, k, sorted=False).indices
    idx = idx[scores[idx] >= 0]
    idx, _ = torch.sort(idx)
    values = grad.detach().reshape(-1)[idx]
    return idx.numpy().astype(np.int64), values.numpy().astype(np.float32)


# -- packed activation caches ---------------------------------------------------------------------

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 bytes, 8 flags per byte (LSB first): 1 bit per activation element."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).to(torch.uint8) * _BITS).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed.unsqueeze(1) & _BITS) != 0).reshape(-1)[:n]


def keep_count(numel: int, keep: float) -> int:
    """Entries a pruned cache keeps: round(keep · numel), at least one."""
    return min(numel, max(1, round(keep * numel)))


def prune_cache(x: torch.Tensor, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude-prune a cache to ``keep`` of its entries (one top-k over the whole tensor, DropIT
    min-k style, spec §3.3): returns (1-bit map, kept values in flat order). No rescaling (§3.3)."""
    flat = x.detach().reshape(-1)
    k = keep_count(flat.numel(), keep)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    m = torch.zeros(flat.numel(), dtype=torch.bool)
    m[idx] = True
    return pack_bits(m), flat[m].clone()


def unprune_cache(packed: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n = math.prod(shape)
    out = torch.zeros(n, dtype=values.dtype)
    out[unpack_bits(packed, n)] = values
    return out.reshape(shape)


class _SAPConv2d(torch.autograd.Function):
    """conv2d whose weight gradient uses the magnitude-pruned input cache (dense forward)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: tuple[int, int],
        padding: tuple[int, int],
        keep: float,
    ) -> torch.Tensor:
        out = F.conv2d(x, weight, bias, stride, padding)
        packed, values = prune_cache(x, keep)
        ctx.save_for_backward(packed, values, weight)
        ctx.x_shape, ctx.stride, ctx.padding, ctx.has_bias = x.shape, stride, padding, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        packed, values, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = conv2d_input(ctx.x_shape, weight, grad, ctx.stride, ctx.padding)
        if ctx.needs_input_grad[1]:
            xp = unprune_cache(packed, values, ctx.x_shape)
            gw = conv2d_weight(xp, weight.shape, grad, ctx.stride, ctx.padding)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum((0, 2, 3))
        return gx, gw, gb, None, None, None


class _SAPLinear(torch.autograd.Function):
    """linear whose weight gradient uses the magnitude-pruned input cache (dense forward)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep: float
    ) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        packed, values = prune_cache(x, keep)
        ctx.save_for_backward(packed, values, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        packed, values, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = grad @ weight
        if ctx.needs_input_grad[1]:
            gw = grad.t() @ unprune_cache(packed, values, ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum(0)
        return gx, gw, gb, None


class _MaskReLU(torch.autograd.Function):
    """ReLU that keeps a 1-bit sign map for backward instead of its dense output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        pos = x > 0
        ctx.save_for_backward(pack_bits(pos))
        ctx.shape = x.shape
        return x * pos

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (packed,) = ctx.saved_tensors
        return grad * unpack_bits(packed, grad.numel()).reshape(ctx.shape)


class _LeanAvgPool2d(torch.autograd.Function):
    """Non-overlapping average pooling that saves nothing (its backward only needs shapes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int) -> torch.Tensor:
        ctx.shape, ctx.k = x.shape, k
        return F.avg_pool2d(x, k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        k = ctx.k
        up = grad.repeat_interleave(k, 2).repeat_interleave(k, 3) / (k * k)
        h, w = ctx.shape[2], ctx.shape[3]
        return F.pad(up, (0, w - up.shape[3], 0, h - up.shape[2])), None


class MaskReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _MaskReLU.apply(x) if torch.is_grad_enabled() and x.requires_grad else F.relu(x)
        assert isinstance(out, torch.Tensor)
        return out


class LeanAvgPool2d(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _LeanAvgPool2d.apply(x, self.k) if torch.is_grad_enabled() and x.requires_grad else None
        return out if isinstance(out, torch.Tensor) else F.avg_pool2d(x, self.k)

    def extra_repr(self) -> str:
        return f"k={self.k}"


def standardize(
    theta: torch.Tensor, mask: torch.Tensor, gamma: float, *, literal: bool = False, eps: float = 1e-5
) -> torch.Tensor:
    """NSConv's effective weight (Eq. 7): filter-wise standardisation over the unpruned weights only.

    Default (spec §3.3 Derived, fan-in corrected): Ŵ_i = m_i ⊙ γ (θ_i − μ_i) / (σ_i √nnz_i + ε), so a
    standard conv on i.i.d. inputs gives Var = γ² E[x²] as Theorem 1 intends. ``literal``: γ √c_in
    (θ_i ⊙ m_i − μ_i) / σ_i as printed. Either way the result is re-masked (§9.9), a filter with no
    kept weight is 0 and one with a single weight is ≈ 0 (§9.11). Gradients flow through μ and σ.
    """
    dims = tuple(range(1, theta.dim()))
    m = mask.to(theta.dtype)
    nnz = m.sum(dims, keepdim=True)
    safe = nnz.clamp_min(1.0)
    mu = (theta * m).sum(dims, keepdim=True) / safe
    var = (((theta - mu) * m) ** 2).sum(dims, keepdim=True) / safe
    sigma = torch.sqrt(var + eps * eps)
    if literal:
        w = gamma * math.sqrt(theta.shape[1]) * (theta * m - mu) / sigma
    else:
        w = gamma * (theta - mu) / (sigma * torch.sqrt(safe) + eps)
    return w * m


class SparseLayer(nn.Module):
    """Common part of FedMef's conv and linear: a mask buffer, optional SAP, gradient capture.

    ``capture`` makes the forward pass retain ∂L/∂Ŵ (the effective weight the op really uses) and add
    it to ``captured``: the regrowth criterion of §3.5 (w.r.t. raw θ it is 0 at pruned positions).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    mask: torch.Tensor

    def __init__(self, keep: float) -> None:
        super().__init__()
        self.keep = keep
        self.capture = False
        self.captured: torch.Tensor | None = None

    def set_mask(self, mask: torch.Tensor) -> None:
        self.mask.copy_(mask.to(self.mask.dtype))

    def effective_weight(self) -> torch.Tensor:
        return self.weight

    def _captured(self, w: torch.Tensor) -> torch.Tensor:
        if self.capture and w.requires_grad:

            def hook(g: torch.Tensor) -> None:
                self.captured = g.detach().clone() if self.captured is None else self.captured + g.detach()

            w.register_hook(hook)
        return w


class NSConv2d(SparseLayer):
    """Normalised sparse convolution with scaled activation pruning (spec §3.3).

    ``standardize=False`` is the "w/o NSConv" ablation (a plain, un-normalised masked conv that still
    prunes its cache); ``keep = 1`` turns activation pruning off (a dense cache, standard autograd).
    """

    def __init__(
        self,
        conv: nn.Conv2d,
        *,
        keep: float,
        gamma: float = 1.0,
        standardize: bool = True,
        literal: bool = False,
    ) -> None:
        super().__init__(keep)
        if conv.groups != 1 or conv.dilation != (1, 1) or conv.padding_mode != "zeros":
            raise ValueError("NSConv2d supports plain convolutions (groups 1, dilation 1, zero padding)")
        self.weight = conv.weight  # type: ignore[assignment]
        self.bias = conv.bias  # type: ignore[assignment]
        self.stride = conv.stride
        self.padding = conv.padding
        self.gamma = gamma
        self.standardize = standardize
        self.literal = literal
        self.register_buffer("mask", torch.ones_like(conv.weight), persistent=False)

    def effective_weight(self) -> torch.Tensor:
        if not self.standardize:
            return self.weight
        return standardize(self.weight, self.mask, self.gamma, literal=self.literal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._captured(self.effective_weight())
        if self.keep >= 1.0 or not torch.is_grad_enabled():
            return F.conv2d(x, w, self.bias, self.stride, self.padding)
        out = _SAPConv2d.apply(x, w, self.bias, self.stride, self.padding, self.keep)
        assert isinstance(out, torch.Tensor)
        return out

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)}, stride={self.stride}, padding={self.padding}, keep={self.keep}, "
            f"gamma={self.gamma}, standardize={self.standardize}, literal={self.literal}"
        )


class SAPLinear(SparseLayer):
    """A masked linear layer with scaled activation pruning of its input cache."""

    def __init__(self, linear: nn.Linear, *, keep: float) -> None:
        super().__init__(keep)
        self.weight = linear.weight  # type: ignore[assignment]
        self.bias = linear.bias
        self.register_buffer("mask", torch.ones_like(linear.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._captured(self.weight)
        if self.keep >= 1.0 or not torch.is_grad_enabled():
            return F.linear(x, w, self.bias)
        out = _SAPLinear.apply(x, w, self.bias, self.keep)
        assert isinstance(out, torch.Tensor)
        return out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, keep={self.keep}"


def to_fedmef_model(
    model: nn.Sequential,
    *,
    keep: float,
    gamma: float = 1.0,
    nsconv: bool = True,
    literal: bool = False,
    lean: bool = True,
) -> nn.Sequential:
    """FedMef's variant of a sequential ReLU-Conv model (spec §3.3, §8): BatchNorm removed, every
    Conv2d an :class:`NSConv2d`, every Linear an :class:`SAPLinear` (both prune their input caches to
    ``keep``), and — with ``lean`` — ReLU/avg-pool replaced by twins that keep no dense activation.

    Parameter names are unchanged (``conv2.weight``), so masks and wire names match the baselines'.
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for name, m in model.named_children():
        if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
            continue
        if isinstance(m, nn.Conv2d):
            layers[name] = NSConv2d(m, keep=keep, gamma=gamma, standardize=nsconv, literal=literal)
        elif isinstance(m, nn.Linear):
            layers[name] = SAPLinear(m, keep=keep)
        elif lean and isinstance(m, nn.ReLU):
            layers[name] = MaskReLU()
        elif lean and isinstance(m, nn.AvgPool2d) and m.kernel_size == m.stride and m.padding == 0:
            k = m.kernel_size if isinstance(m.kernel_size, int) else m.kernel_size[0]
            layers[name] = LeanAvgPool2d(int(k))
        elif isinstance(m, nn.Sequential | nn.ModuleList | nn.ModuleDict):
            raise ValueError(f"to_fedmef_model needs a flat nn.Sequential; {name} is a container")
        else:
            layers[name] = m
    return nn.Sequential(layers)


def set_masks(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> None:
    """Give each :class:`SparseLayer` its mask (``masks`` keyed by weight name)."""
    for name, m in model.named_modules():
        if isinstance(m, SparseLayer) and f"{name}.weight" in masks:
            m.set_mask(masks[f"{name}.weight"])


# -- the masked SGD loop -----------------------------------------------------------------------------


def growth_gradients(
    model: nn.Module,
    prunable: Sequence[str],
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int,
    max_batches: int | None = None,
    last: bool = False,
) -> dict[str, torch.Tensor]:
    """Mean ∂L_task/∂Ŵ over the local minibatches (in data order), per prunable weight (spec §3.5).

    For :class:`SparseLayer` modules the gradient is taken w.r.t. the effective weight (NSConv's
    standardised Ŵ, computed with the pruned caches); for plain layers w.r.t. the weight itself (dense,
    since the layer uses the zero-filled weight directly). ``max_batches`` limits the pass (1 = the
    FedDST/RigL choice); ``last`` uses the final minibatch(es) instead of the first.
    """
    model.train()
    mods = dict(model.named_modules())
    layers = {w: mods[w.rsplit(".", 1)[0]] for w in prunable}
    params = dict(model.named_parameters())
    for m in layers.values():
        if isinstance(m, SparseLayer):
            m.capture, m.captured = True, None
    for p in params.values():
        p.grad = None
    n = len(y)
    starts = list(range(0, n, batch_size))
    if max_batches is not None:
        starts = starts[-max_batches:] if last else starts[:max_batches]
    total = sum(min(batch_size, n - s) for s in starts)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    try:
        for s in starts:
            xb, yb = xt[s : s + batch_size], yt[s : s + batch_size]
            (F.cross_entropy(model(xb), yb) * (len(yb) / total)).backward()
        out = {}
        for w, m in layers.items():
            if isinstance(m, SparseLayer):
                assert m.captured is not None
                out[w] = m.captured
            else:
                g = params[w].grad
                out[w] = g.detach().clone() if g is not None else torch.zeros_like(params[w])
        return out
    finally:
        for m in layers.values():
            if isinstance(m, SparseLayer):
                m.capture, m.captured = False, None
        for p in params.values():
            p.grad = None


# -- the paper's memory model (App. C, spec §4) ------------------------------------------------------


def storage_bits(n_rows: int, n_cols: int, nnz: int, bits: int = 32) -> int:
    """Bits to store a sparse ``n_rows × n_cols`` matrix with ``nnz`` values (App. C.1 table).

    dense d ≥ 0.9; bitmap 0.3 ≤ d < 0.9; COO 0.1 ≤ d < 0.3; CSR/CSC (the smaller) d < 0.1.
    """
    n = n_rows * n_cols
    d = nnz / n
    if d >= 0.9:
        return n * bits
    if d >= 0.3:
        return n + nnz * bits
    if d >= 0.1:
        return nnz * math.ceil(math.log2(n)) + nnz * bits
    lg_m = math.ceil(math.log2(nnz)) if nnz > 1 else 0
    csr = nnz * math.ceil(math.log2(n_cols)) + n_rows * lg_m
    csc = nnz * math.ceil(math.log2(n_rows)) + n_cols * lg_m
    return min(csr, csc) + nnz * bits


@dataclass(frozen=True)
class MemoryModel:
    """The shapes the paper's memory model needs: weights as (rows, fan-in, nnz) and the caches."""

    #: weight name -> (c_out, fan_in, nnz)
    weights: dict[str, tuple[int, int, int]]
    #: cached conv/linear inputs -> elements per sample
    caches: dict[str, int]
    batch_size: int
    bits: int = 32

    def params(self) -> int:
        """M^p: every weight in its storage scheme (a dense one is simply d = 1)."""
        return sum(storage_bits(r, c, k, self.bits) for r, c, k in self.weights.values())

    def activations(self, keep: float = 1.0) -> int:
        """M^a at cache density ``keep`` (1 = M_d^a, dense)."""
        total = 0
        for per_sample in self.caches.values():
            n = self.batch_size * per_sample
            total += storage_bits(
                self.batch_size, per_sample, keep_count(n, keep) if keep < 1 else n, self.bits
            )
        return total

    def footprint(self, method: str, *, keep: float = 0.1, xi_total: int = 0) -> int:
        """Training footprint in bits (App. C.2): fedavg 2M_d^p + 2M_d^a; pqsu 2M_s^p + 2M_d^a;
        fedtiny/feddst + 3bΣξ; fedmef 2M_s^p + M_s^a + M_d^a + 3bΣξ (the printed, corrected formula)."""
        dense_a = self.activations(1.0)
        if method == "fedavg":
            dense_p = sum(r * c * self.bits for r, c, _ in self.weights.values())
            return 2 * dense_p + 2 * dense_a
        sp = self.params()
        if method == "pqsu":
            return 2 * sp + 2 * dense_a
        if method in ("fedtiny", "feddst"):
            return 2 * sp + 2 * dense_a + 3 * self.bits * xi_total
        if method == "fedmef":
            return 2 * sp + self.activations(keep) + dense_a + 3 * self.bits * xi_total
        raise ValueError(f"unknown method {method!r}")


def memory_model(
    model: nn.Module,
    input_shape: tuple[int, ...],
    masks: Mapping[str, np.ndarray],
    batch_size: int,
    bits: int = 32,
) -> MemoryModel:
    """Read the weight shapes and per-sample cache sizes (inputs of every conv/linear) off ``model``."""
    weights: dict[str, tuple[int, int, int]] = {}
    caches: dict[str, int] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d | nn.Linear | SparseLayer):
            w = m.weight
            nnz = int(np.count_nonzero(masks[f"{name}.weight"])) if f"{name}.weight" in masks else w.numel()
            weights[f"{name}.weight"] = (int(w.shape[0]), int(w[0].numel()), nnz)

            def hook(mod: nn.Module, inp: tuple[torch.Tensor, ...], out: Any, name: str = name) -> None:
                caches[name] = int(inp[0][0].numel())

            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model.eval()
            model(torch.zeros((1, *input_shape)))
    finally:
        for h in hooks:
            h.remove()
    return MemoryModel(weights, caches, batch_size, bits)


def sparse_param_bytes(shapes: Mapping[str, tuple[int, ...]], nnz: Mapping[str, int], bits: int = 32) -> int:
    """Resident bytes of the weights in the App. C.1 storage (what a sparse on-device runtime holds)."""
    total = 0
    for name, shape in shapes.items():
        rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
        total += storage_bits(rows, cols, nnz.get(name, math.prod(shape)), bits)
    return math.ceil(total / 8)


def layer_positions(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, int]:
    """Output positions per sample of every conv/linear weight (1 for linear), for FLOP counting."""
    out: dict[str, int] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d | nn.Linear | SparseLayer):

            def hook(mod: nn.Module, inp: Any, o: torch.Tensor, name: str = name) -> None:
                out[f"{name}.weight"] = int(o[0].numel() // o.shape[1])

            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            was = model.training
            model.eval()
            model(torch.zeros((1, *input_shape)))
            model.train(was)
    finally:
        for h in hooks:
            h.remove()
    return out
