"""Unit-structured masks for sequential MLPs/CNNs: Hermes' groups, compaction, FLOPs, group lasso.

Why a module of its own: Hermes prunes *whole units* (FC rows / conv filters) and that only pays off
if three things agree exactly — the mask the device trains under, the payload that travels (a dense
sub-block per tensor) and the physically smaller model the device deploys. All three are derived
here from one object, :class:`UnitStructure`, from the same per-layer *keep vectors*, so they cannot
drift apart.

The model contract: a flat ``nn.Sequential`` of ``Linear``/``Conv2d`` weight layers, optional
``BatchNorm1d/2d`` after a weight layer, and unit-preserving modules in between (activations, pools,
dropout, ``Flatten``). Every weight layer but the last (the classifier, whose rows are class logits)
has a keep vector over its output units. Unit ``u`` of layer ``l`` owns: row/filter ``u`` of the
weight, bias ``u``, BatchNorm entry ``u`` (weight, bias, running stats) and the input columns of the
next weight layer that unit ``u`` feeds (one column, one channel, or — after a ``Flatten`` — the
``H'·W'`` consecutive features of channel ``u``). So each tensor's mask is the outer product of an
output keep vector and an (expanded) input keep vector, and removing a unit is a slice.

ResNets (skip connections couple units across layers) are not supported and raise ``ValueError``.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from shared import codec

Keep = dict[str, npt.NDArray[np.bool_]]

#: modules that map unit ``u`` of their input to unit ``u`` of their output (or are shape-only)
_PASSTHROUGH = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Dropout,
    nn.Dropout2d,
    nn.Identity,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.Flatten,
)


@dataclass(frozen=True)
class WeightLayer:
    """One ``Linear``/``Conv2d`` layer of the chain."""

    name: str
    kind: str  # "linear" | "conv"
    out_units: int
    #: the weight layer feeding this one (None for the first) and how many input features each of its
    #: units feeds (1, or H'·W' for the first Linear after a conv + Flatten)
    source: str | None
    in_group: int
    prunable: bool
    #: output positions per sample (1 for Linear, H_out·W_out for conv): FLOPs = 2·kept weights·positions
    positions: int


@dataclass(frozen=True)
class TensorRule:
    """Which keep vector governs axis 0 (``out``) and axis 1 (``src``, expanded by ``group``)."""

    out: str | None
    src: str | None
    group: int


class UnitStructure:
    """The structured groups of one model architecture (see the module docstring)."""

    def __init__(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        if not isinstance(model, nn.Sequential):
            raise ValueError(
                f"Hermes' structured masks need a flat nn.Sequential model, got {type(model).__name__}"
            )
        layers: list[WeightLayer] = []
        norms: dict[str, str] = {}  # BN module -> weight layer it normalises
        prev: WeightLayer | None = None
        positions = _output_positions(model, input_shape)
        children = list(model.named_children())
        weight_names = [n for n, m in children if isinstance(m, nn.Linear | nn.Conv2d)]
        if len(weight_names) < 1:
            raise ValueError("the model has no Linear/Conv2d layer")
        for name, m in children:
            if isinstance(m, nn.Linear | nn.Conv2d):
                if isinstance(m, nn.Conv2d) and (
                    m.groups != 1 or (prev is not None and prev.kind == "linear")
                ):
                    raise ValueError(f"{name}: grouped convs and convs after Linear layers are not supported")
                fan_in = m.in_features if isinstance(m, nn.Linear) else m.in_channels
                out = m.out_features if isinstance(m, nn.Linear) else m.out_channels
                group = 1
                if prev is not None:
                    if fan_in % prev.out_units:
                        raise ValueError(
                            f"{name}: {fan_in} inputs are not a whole number per unit of {prev.name} "
                            f"({prev.out_units} units)"
                        )
                    group = fan_in // prev.out_units
                    if isinstance(m, nn.Conv2d) and group != 1:
                        raise ValueError(f"{name}: input channels do not match {prev.name}'s filters")
                prev = WeightLayer(
                    name=name,
                    kind="linear" if isinstance(m, nn.Linear) else "conv",
                    out_units=out,
                    source=prev.name if prev is not None else None,
                    in_group=group,
                    prunable=name != weight_names[-1],
                    positions=positions[name],
                )
                layers.append(prev)
            elif isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                if prev is None or m.num_features != prev.out_units:
                    raise ValueError(f"{name}: BatchNorm must follow a weight layer with as many units")
                norms[name] = prev.name
            elif isinstance(m, _PASSTHROUGH):
                continue
            else:
                raise ValueError(
                    f"{name}: {type(m).__name__} is not supported by unit-structured pruning "
                    "(supported: Linear, Conv2d, BatchNorm, activations, pools, dropout, Flatten)"
                )
        self.layers: dict[str, WeightLayer] = {layer.name: layer for layer in layers}
        self.norms = norms
        self.prunable: list[str] = [layer.name for layer in layers if layer.prunable]
        self.classifier: str = layers[-1].name
        self.input_shape = tuple(input_shape)
        # Rules for every float tensor of the state dict (parameters and BN running stats).
        self.rules: dict[str, TensorRule] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.param_names: list[str] = [n for n, _ in model.named_parameters()]
        for tname, t in model.state_dict().items():
            if not t.dtype.is_floating_point:
                continue
            module = tname.rsplit(".", 1)[0]
            self.shapes[tname] = tuple(t.shape)
            if module in self.layers:
                layer = self.layers[module]
                owned = module if layer.prunable else None
                if tname.endswith(".weight"):
                    self.rules[tname] = TensorRule(owned, layer.source, layer.in_group)
                else:  # bias
                    self.rules[tname] = TensorRule(owned, None, 1)
            elif module in norms:
                owner = norms[module]
                self.rules[tname] = TensorRule(owner if self.layers[owner].prunable else None, None, 1)
            else:
                raise ValueError(f"tensor {tname} belongs to no supported layer")
        self.total_params = sum(math.prod(self.shapes[n]) for n in self.param_names)

    # -- keep vectors and masks ----------------------------------------------------------------------
    def full_keep(self) -> Keep:
        """All units kept: the mask every device starts with."""
        return {name: np.ones(self.layers[name].out_units, dtype=np.bool_) for name in self.prunable}

    def axis_indices(self, tensor: str, keep: Keep) -> tuple[npt.NDArray[np.int64] | None, ...]:
        """Kept positions per axis of ``tensor`` (``None`` = whole axis), the ``Sliced`` indices."""
        rule = self.rules[tensor]
        shape = self.shapes[tensor]
        out: list[npt.NDArray[np.int64] | None] = [None] * len(shape)
        if rule.out is not None and not keep[rule.out].all():
            out[0] = np.flatnonzero(keep[rule.out]).astype(np.int64)
        if rule.src is not None and rule.src in keep and not keep[rule.src].all():
            units = np.flatnonzero(keep[rule.src]).astype(np.int64)
            out[1] = (units[:, None] * rule.group + np.arange(rule.group, dtype=np.int64)[None, :]).reshape(
                -1
            )
        return tuple(out)

    def kept_shape(self, tensor: str, keep: Keep) -> tuple[int, ...]:
        idx = self.axis_indices(tensor, keep)
        return tuple(d if ix is None else len(ix) for ix, d in zip(idx, self.shapes[tensor], strict=True))

    def tensor_mask(self, tensor: str, keep: Keep) -> npt.NDArray[np.bool_]:
        """The full boolean mask of ``tensor``: outer product of its axis keep vectors."""
        shape = self.shapes[tensor]
        vecs = []
        for ix, dim in zip(self.axis_indices(tensor, keep), shape, strict=True):
            v = np.ones(dim, dtype=np.bool_)
            if ix is not None:
                v[:] = False
                v[ix] = True
            vecs.append(v)
        mask = vecs[0]
        for v in vecs[1:]:
            mask = np.multiply.outer(mask, v)
        return np.asarray(mask, dtype=np.bool_).reshape(shape)

    def kept_params(self, keep: Keep) -> int:
        return sum(math.prod(self.kept_shape(n, keep)) for n in self.param_names)

    def density(self, keep: Keep) -> float:
        """Kept fraction of the model's parameters (so compacted size = density × dense size)."""
        return self.kept_params(keep) / self.total_params

    def flops(self, keep: Keep) -> int:
        """Forward FLOPs per sample of the compacted model: 2 · kept weights · output positions."""
        total = 0
        for layer in self.layers.values():
            total += 2 * math.prod(self.kept_shape(f"{layer.name}.weight", keep)) * layer.positions
        return total

    def torch_masks(self, keep: Keep) -> dict[str, torch.Tensor]:
        """Float 0/1 masks for the *parameters* that are not fully kept (for masked SGD)."""
        out = {}
        for name in self.param_names:
            if any(ix is not None for ix in self.axis_indices(name, keep)):
                out[name] = torch.from_numpy(self.tensor_mask(name, keep).astype(np.float32))
        return out

    def check_keep(self, keep: Keep) -> None:
        """Raise ``CodecError`` unless ``keep`` has one vector per prunable layer with ≥ 1 unit."""
        if set(keep) != set(self.prunable):
            raise codec.CodecError("tensor", f"keep vectors for {sorted(keep)}, expected {self.prunable}")
        for name, v in keep.items():
            if v.shape != (self.layers[name].out_units,) or not v.any():
                raise codec.CodecError("tensor", f"{name}: a keep vector needs ≥ 1 of {v.shape} units")

    # -- payloads --------------------------------------------------------------------------------------
    def keep_from_payload(self, tensors: Mapping[str, codec.Tensor]) -> Keep:
        """Read the keep vectors off a payload and check that *every* tensor follows them exactly.

        The payload is authoritative about the mask (a stateless emulated device learns its mask from
        it); anything not unit-structured — a stray pruned coordinate, a classifier row missing, a
        bias that disagrees with its row — is a ``CodecError``, so it is dead-lettered, not averaged.
        """
        keep: Keep = {}
        for name in self.prunable:
            t = tensors.get(f"{name}.weight")
            if t is None:
                raise codec.CodecError("tensor", f"payload lacks {name}.weight")
            keep[name] = _axis0_keep(t, self.layers[name].out_units)
        self.check_keep(keep)
        for name, shape in self.shapes.items():
            t = tensors.get(name)
            if t is None:
                raise codec.CodecError("tensor", f"payload lacks {name}")
            if _full_shape(t) != shape:
                raise codec.CodecError("tensor", f"{name}: shape {_full_shape(t)} is not {shape}")
            expected = self.axis_indices(name, keep)
            if isinstance(t, codec.Dense):
                ok = all(ix is None for ix in expected)
            elif isinstance(t, codec.Sliced):
                ok = all(
                    (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
                    for a, b in zip(t.indices, expected, strict=True)
                )
            elif isinstance(t, codec.Sparse):
                ok = bool(np.array_equal(t.mask(), self.tensor_mask(name, keep)))
            else:
                ok = False
            if not ok:
                raise codec.CodecError("tensor", f"{name}: payload is not the unit-structured mask")
        return keep

    def payload(self, arrays: Mapping[str, np.ndarray], keep: Keep) -> dict[str, codec.Tensor]:
        """``W ⊙ M`` as the smallest codec tensor per name: Dense if whole, else Sliced or Sparse.

        Sliced (kept indices per axis + the dense block) and Sparse (bitmask or COO + values) carry the
        same information; which is smaller depends on shape and density, so both are packed and the
        smaller one is sent (ties go to Sliced, the structured form).
        """
        out: dict[str, codec.Tensor] = {}
        for name in self.shapes:
            arr = np.ascontiguousarray(arrays[name], dtype=np.float32)
            idx = self.axis_indices(name, keep)
            if all(ix is None for ix in idx):
                out[name] = codec.Dense(arr)
                continue
            sliced = codec.Sliced.from_dense(arr, idx)
            sparse = codec.Sparse.from_dense(arr, self.tensor_mask(name, keep))
            out[name] = (
                sparse
                if len(codec.packb(codec.encode(sparse))) < len(codec.packb(codec.encode(sliced)))
                else sliced
            )
        return out

    # -- compaction ------------------------------------------------------------------------------------
    def compact(self, model: nn.Sequential, keep: Keep) -> nn.Sequential:
        """A physically smaller copy of ``model``: pruned units (rows, filters, channels) removed.

        The result computes exactly what ``model`` computes under the mask (pruned units contribute
        nothing downstream because their outgoing columns are masked), with
        ``num_parameters = density(keep) × num_parameters(model)``.
        """
        self.check_keep(keep)
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        new: OrderedDict[str, nn.Module] = OrderedDict()
        for name, m in model.named_children():
            if isinstance(m, nn.Linear):
                out_f, in_f = self.kept_shape(f"{name}.weight", keep)
                new[name] = nn.Linear(in_f, out_f, bias=m.bias is not None)
            elif isinstance(m, nn.Conv2d):
                out_c, in_c = self.kept_shape(f"{name}.weight", keep)[:2]
                new[name] = nn.Conv2d(
                    in_c,
                    out_c,
                    m.kernel_size,  # type: ignore[arg-type]
                    stride=m.stride,  # type: ignore[arg-type]
                    padding=m.padding,  # type: ignore[arg-type]
                    dilation=m.dilation,  # type: ignore[arg-type]
                    bias=m.bias is not None,
                    padding_mode=m.padding_mode,
                )
            elif isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                owner = self.norms[name]
                n = int(keep[owner].sum()) if owner in keep else m.num_features
                new[name] = type(m)(
                    n,
                    eps=m.eps,
                    momentum=m.momentum,
                    affine=m.affine,
                    track_running_stats=m.track_running_stats,
                )
            else:
                new[name] = copy.deepcopy(m)
        small = nn.Sequential(new)
        sd = {}
        for tname in small.state_dict():
            if tname in self.shapes:
                sliced = codec.Sliced.from_dense(state[tname], self.axis_indices(tname, keep)).values
                sd[tname] = torch.from_numpy(np.ascontiguousarray(sliced))
            else:  # integer buffers (num_batches_tracked)
                sd[tname] = torch.as_tensor(state[tname])
        small.load_state_dict(sd)
        small.train(model.training)
        return small


def _full_shape(t: codec.Tensor) -> tuple[int, ...]:
    if isinstance(t, codec.Dense | codec.Threshold):
        return tuple(t.array.shape)
    return tuple(t.shape)


def _axis0_keep(t: codec.Tensor, units: int) -> npt.NDArray[np.bool_]:
    if isinstance(t, codec.Dense):
        return np.ones(units, dtype=np.bool_)
    if isinstance(t, codec.Sliced):
        v = np.ones(units, dtype=np.bool_)
        if t.indices and t.indices[0] is not None:
            v[:] = False
            v[t.indices[0]] = True
        return v
    if isinstance(t, codec.Sparse):
        m = t.mask()
        return np.asarray(m.reshape(m.shape[0], -1).any(axis=1), dtype=np.bool_)
    raise codec.CodecError("kind", f"unexpected payload kind {type(t).__name__}")


def _output_positions(model: nn.Sequential, input_shape: tuple[int, ...]) -> dict[str, int]:
    """Output positions per sample of every weight layer, from one forward pass of a zero batch."""
    found: dict[str, int] = {}
    hooks = []
    for name, m in model.named_children():
        if isinstance(m, nn.Linear | nn.Conv2d):

            def hook(mod: nn.Module, inp: object, out: torch.Tensor, name: str = name) -> None:
                found[name] = int(out[0].numel() // out.shape[1])

            hooks.append(m.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape)))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return found


def forward_flops(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Measured forward FLOPs per sample (2 · MACs of Linear/Conv2d layers), by forward hooks.

    Independent of :meth:`UnitStructure.flops`, so a test can check that the compacted model really
    is cheaper rather than trusting the formula that predicts it.
    """
    total = 0
    hooks = []

    def hook(mod: nn.Module, inp: object, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(mod, nn.Linear):
            total += 2 * mod.in_features * mod.out_features
        elif isinstance(mod, nn.Conv2d):
            kh, kw = mod.kernel_size
            per_pos = mod.in_channels // mod.groups * mod.out_channels * kh * kw
            total += 2 * per_pos * int(out[0].numel() // out.shape[1])

    for m in model.modules():
        if isinstance(m, nn.Linear | nn.Conv2d):
            hooks.append(m.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape)))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return total


def group_lasso(structure: UnitStructure, lam: float) -> Callable[[nn.Module], torch.Tensor]:
    """``λ · R(W)`` of Hermes eq. 2–3: L2 norms of every row and column group of every weight layer.

    Conv: filter groups ``W[f]`` and channel groups ``W[:, c]``; Linear: rows ``W[r]`` and columns
    ``W[:, c]``. Pruned groups are exactly zero and contribute nothing (the norm's gradient at 0 is 0
    in torch). The classifier is included, as the paper's sum runs over all FC layers.
    """
    names = [f"{name}.weight" for name in structure.layers]

    def penalty(model: nn.Module) -> torch.Tensor:
        params = dict(model.named_parameters())
        total = torch.zeros(())
        for name in names:
            w = params[name]
            rest = tuple(range(1, w.dim()))
            cols = (0, *range(2, w.dim()))
            total = total + torch.linalg.vector_norm(w, dim=rest).sum()
            total = total + torch.linalg.vector_norm(w, dim=cols).sum()
        return lam * total

    return penalty


def structured_prune(
    structure: UnitStructure, arrays: Mapping[str, np.ndarray], keep: Keep, target: float
) -> Keep:
    """Remove the lowest-norm units so the density drops to ``≤ target`` (spec §3.4).

    The same fraction ``q`` of the *alive* units goes in every prunable layer (floor(q·alive), at least
    one unit stays), with ``q`` the smallest that reaches ``target``, found by bisection. Scores are
    the L2 norms of each alive unit's weight row/filter. A per-layer fraction rather than a global
    ranking: the spec's prototype saw a global ranking empty one hidden layer almost completely.
    Returns the new keep vectors (a subset of ``keep``: masks only shrink).
    """
    order: dict[str, npt.NDArray[np.int64]] = {}
    for name in structure.prunable:
        alive = np.flatnonzero(keep[name])
        w = np.asarray(arrays[f"{name}.weight"], dtype=np.float64)
        scores = np.sqrt((w[alive].reshape(len(alive), -1) ** 2).sum(axis=1))
        order[name] = alive[np.argsort(scores, kind="stable")]

    def cut(q: float) -> Keep:
        new = {k: v.copy() for k, v in keep.items()}
        for name, ranked in order.items():
            n = min(math.floor(q * len(ranked)), len(ranked) - 1)
            new[name][ranked[:n]] = False
        return new

    if structure.density(keep) <= target:
        return {k: v.copy() for k, v in keep.items()}
    lo, hi = 0.0, 1.0
    if structure.density(cut(hi)) > target:
        return cut(hi)  # cannot reach the target with one unit left per layer: prune as far as allowed
    for _ in range(30):
        mid = (lo + hi) / 2
        if structure.density(cut(mid)) <= target:
            hi = mid
        else:
            lo = mid
    return cut(hi)
