"""Unit-structured masks for sequential MLPs/CNNs: Hermes' groups, compaction, FLOPs, group lasso.

Why a module of its own: Hermes prunes *whole units* (FC rows / conv filters) and that only pays off
if three things agree exactly — the mask the device trains under, the payload that travels (a dense
sub-block per tensor) and the physically smaller model the device deploys. All three are derived
here from one object, :class:`UnitStructure`, from the same per-layer *keep vectors*, so they cannot
drift apart.

The model contract and what a unit owns are the shared unit graph's
(:mod:`shared.models.unit_graph`): each tensor's mask is the outer product of an output keep vector
and an (expanded) input keep vector, and removing a unit is a slice. The classifier's rows (class
logits) are never pruned; ResNets are refused.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from shared import codec
from shared.models.unit_graph import UnitGraph

#: hidden layer name -> boolean keep vector over its output units
Keep = dict[str, npt.NDArray[np.bool_]]


class UnitStructure(UnitGraph):
    """Hermes' structured groups of one architecture (see the module docstring): the shared unit
    graph plus boolean keep vectors, masks, payloads and compaction."""

    PURPOSE = "Hermes' structured masks"
    MIN_WEIGHT_LAYERS = 1

    # -- keep vectors and masks ----------------------------------------------------------------------
    def full_keep(self) -> Keep:
        """All units kept: the mask every device starts with."""
        return {name: np.ones(self.layers[name].units, dtype=np.bool_) for name in self.hidden}

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
        if set(keep) != set(self.hidden):
            raise codec.CodecError("tensor", f"keep vectors for {sorted(keep)}, expected {self.hidden}")
        for name, v in keep.items():
            if v.shape != (self.layers[name].units,) or not v.any():
                raise codec.CodecError("tensor", f"{name}: a keep vector needs ≥ 1 of {v.shape} units")

    # -- payloads --------------------------------------------------------------------------------------
    def keep_from_payload(self, tensors: Mapping[str, codec.Tensor]) -> Keep:
        """Read the keep vectors off a payload and check that *every* tensor follows them exactly.

        The payload is authoritative about the mask (a stateless emulated device learns its mask from
        it); anything not unit-structured — a stray pruned coordinate, a classifier row missing, a
        bias that disagrees with its row — is a ``CodecError``, so it is dead-lettered, not averaged.
        """
        keep: Keep = {}
        for name in self.hidden:
            t = tensors.get(f"{name}.weight")
            if t is None:
                raise codec.CodecError("tensor", f"payload lacks {name}.weight")
            keep[name] = _axis0_keep(t, self.layers[name].units)
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
                owner = self.owner[name]
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
    for name in structure.hidden:
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
