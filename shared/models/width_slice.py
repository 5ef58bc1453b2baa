"""Width slicing of sequential models: the machinery behind FedDSE, HeteroFL, FedRolex, Fed. Dropout.

Spec: ``docs/algorithms/feddse.md`` §3.3 (slicing), §2.6 (aggregation), §4.2 (accounting).
Every width-slice algorithm does the same four things and differs only in *which* units it keeps:

1. choose, for every hidden layer ``l``, a sorted index set ``S_l`` of ``k_l = max(1, floor(r·m_l))``
   units (FedDSE: by activation on local data; HeteroFL: the first ``k_l``; FedRolex: a rolling
   window; Federated Dropout: at random);
2. cut the sub-model out of the global weights — element ``(i, j, ...)`` of the slice is global
   ``(S_l[i], S_{l-1}[j], ...)``; input features and output classes are never cut;
3. build a physically narrower ``nn.Sequential`` of the same family and train it (so memory, FLOPs
   and bytes are those of the real sub-model, not of a masked full model);
4. scatter the trained slice back as a per-coordinate **sum and count**: any split of the updates
   over aggregators and any arrival order give the same average, and coordinates nobody trained keep
   their value.

Why its own module: these four steps must agree exactly (the slice that travels, the model that
trains, the coordinates that are averaged), so they are all derived from one object,
:class:`WidthStructure`, and one representation of a choice, :data:`Selection`.

The model contract is the shared unit graph's (:mod:`shared.models.unit_graph`; Hermes uses it
too), plus HeteroFL's ``Scaler`` after a weight layer. Every weight layer but the last is *hidden*
(its output units can be cut). A ``Linear`` after ``conv → Flatten`` owns ``H·W`` consecutive input
features per channel. ResNets are refused.

This module deliberately does not import :mod:`shared.algorithms` (the algorithm registry imports
the algorithms, which import this module): partials are returned as plain ``dict`` of arrays.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from shared import codec
from shared.models.layers import Scaler
from shared.models.unit_graph import UnitGraph

#: hidden layer name -> sorted, unique int64 indices of the kept units
Selection = dict[str, npt.NDArray[np.int64]]
#: hidden layer name -> number of kept units
Counts = dict[str, int]

#: the paper's capacity fluctuation step (§2.2, "alpha = 1/16")
SIXTEENTH = 1.0 / 16.0


def keep_count(rate: float, units: int, rounding: Literal["floor", "ceil"] = "floor") -> int:
    """``k = max(1, floor(r·m))`` (FedDSE code) or ``ceil`` (HeteroFL/FedRolex code), never above m.

    The 1e-9 guards against ``0.3 * 10 = 2.9999999999999996``; one rule for all methods (spec §9.8).
    """
    k = math.floor(rate * units + 1e-9) if rounding == "floor" else math.ceil(rate * units - 1e-9)
    return int(min(units, max(1, k)))


class WidthStructure(UnitGraph):
    """The sliceable structure of one sequential architecture (see the module docstring): the shared
    unit graph plus index selections, slicing, sub-model building and sum/count scattering."""

    PURPOSE = "width slicing"
    ALLOW_SCALER = True
    #: at least one hidden layer and a classifier: with nothing to slice every method is FedAvg
    MIN_WEIGHT_LAYERS = 2

    # -- counts and selections ----------------------------------------------------------------------
    def widths(self) -> Counts:
        return {h: self.layers[h].units for h in self.hidden}

    def counts(self, rate: float, rounding: Literal["floor", "ceil"] = "floor") -> Counts:
        """``k_l`` for every hidden layer at width ratio ``rate``."""
        return {h: keep_count(rate, self.layers[h].units, rounding) for h in self.hidden}

    def full_selection(self) -> Selection:
        return {h: np.arange(self.layers[h].units, dtype=np.int64) for h in self.hidden}

    def check_selection(self, sel: Mapping[str, np.ndarray]) -> Selection:
        """Validate (sorted, unique, in range, one per hidden layer) and normalise to int64."""
        if set(sel) != set(self.hidden):
            raise codec.CodecError("tensor", f"selection layers {sorted(sel)} != hidden layers {self.hidden}")
        out: Selection = {}
        for h in self.hidden:
            idx = np.asarray(sel[h])
            m = self.layers[h].units
            if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
                raise codec.CodecError("tensor", f"{h}: a selection is a non-empty 1-D integer vector")
            if np.any(idx[1:] <= idx[:-1]) or int(idx[0]) < 0 or int(idx[-1]) >= m:
                raise codec.CodecError("tensor", f"{h}: indices must be sorted, unique and in [0, {m})")
            out[h] = idx.astype(np.int64)
        return out

    def selection_counts(self, sel: Mapping[str, np.ndarray]) -> Counts:
        return {h: len(sel[h]) for h in self.hidden}

    # -- slicing ------------------------------------------------------------------------------------
    def axis_indices(self, name: str, sel: Mapping[str, np.ndarray]) -> list[npt.NDArray[np.int64] | None]:
        """Kept positions per axis of tensor ``name`` (None = whole axis, also when nothing is cut)."""
        rule, shape = self.rules[name], self.shapes[name]
        out: list[npt.NDArray[np.int64] | None] = [None] * len(shape)
        if rule.out is not None and len(sel[rule.out]) < shape[0]:
            out[0] = np.asarray(sel[rule.out], dtype=np.int64)
        if rule.src is not None and len(sel[rule.src]) < self.layers[rule.src].units:
            idx = np.asarray(sel[rule.src], dtype=np.int64)
            if rule.group > 1:  # channel c of a conv owns features c·HW .. c·HW+HW-1 after Flatten
                idx = (idx[:, None] * rule.group + np.arange(rule.group, dtype=np.int64)).ravel()
            out[1] = idx
        return out

    def slice(
        self, arrays: Mapping[str, np.ndarray], sel: Mapping[str, np.ndarray]
    ) -> dict[str, codec.Sliced]:
        """The sub-model as ``Sliced`` payloads: kept index vectors per axis + the dense block."""
        return {
            k: codec.Sliced.from_dense(np.asarray(arrays[k]), self.axis_indices(k, sel)) for k in self.shapes
        }

    def compact(
        self, arrays: Mapping[str, np.ndarray], sel: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The sub-model's own (narrow) tensors, as numpy arrays."""
        return {k: v.values for k, v in self.slice(arrays, sel).items()}

    def pack(
        self, compact: Mapping[str, np.ndarray], sel: Mapping[str, np.ndarray]
    ) -> dict[str, codec.Sliced]:
        """Wrap a sub-model's own tensors as ``Sliced`` payloads of the full shapes (the upload)."""
        return {
            k: codec.Sliced(
                self.shapes[k], tuple(self.axis_indices(k, sel)), np.asarray(compact[k], dtype=np.float32)
            )
            for k in self.shapes
        }

    def selection_from_payload(self, tensors: Mapping[str, codec.Tensor]) -> Selection:
        """Recover the selection from ``Sliced`` payloads and check every tensor agrees with it.

        Why check every tensor: an update whose bias says units {1, 2} and whose weight says {1, 3}
        would be scattered inconsistently; refusing it on the aggregator keeps the model coherent.
        """
        if set(tensors) != set(self.shapes):
            raise codec.CodecError("tensor", f"payload names {sorted(tensors)[:4]}... do not match the model")
        sel: dict[str, np.ndarray] = {}
        for h in self.hidden:
            t = tensors[f"{h}.weight"]
            if not isinstance(t, codec.Sliced | codec.Dense):
                raise codec.CodecError("tensor", f"{h}.weight must be sliced or dense")
            ix = t.indices[0] if isinstance(t, codec.Sliced) else None
            sel[h] = np.arange(self.layers[h].units, dtype=np.int64) if ix is None else ix
        checked = self.check_selection(sel)
        for k, t in tensors.items():
            expected = self.axis_indices(k, checked)
            if isinstance(t, codec.Dense):
                if t.array.shape != self.shapes[k] or any(e is not None for e in expected):
                    raise codec.CodecError("tensor", f"{k}: dense tensor where a slice was expected")
                continue
            if not isinstance(t, codec.Sliced) or t.shape != self.shapes[k]:
                raise codec.CodecError("tensor", f"{k}: expected a slice of shape {self.shapes[k]}")
            for axis, (got, want) in enumerate(zip(t.indices, expected, strict=True)):
                if (got is None) != (want is None) or (
                    got is not None and want is not None and not np.array_equal(got, want)
                ):
                    raise codec.CodecError("tensor", f"{k}: axis {axis} indices disagree with the selection")
        return checked

    # -- the narrow model ---------------------------------------------------------------------------
    def submodel(
        self,
        template: nn.Sequential,
        counts: Mapping[str, int],
        rate: float = 1.0,
        *,
        fan_in_scaling: bool = False,
    ) -> nn.Sequential:
        """A fresh ``nn.Sequential`` of ``template``'s family with ``counts[l]`` units per hidden layer.

        ``Scaler`` modules get ``rate`` (HeteroFL: divide by the client's width while training).
        ``fan_in_scaling`` inserts, before every weight layer whose *inputs* were cut, a training-only
        ``Scaler(k_in/m_in)``: the layer's input is multiplied by ``m_in/k_in`` (inverted dropout),
        so a narrow model's weighted sums have the full model's scale (biases are not scaled). Why: a
        BN-free model (the spec's MLP) has no ``Scaler`` of its own, and without it weights trained
        on ``k`` inputs are evaluated on ``m``. Parameter-free, so the state dict is unchanged.
        Weights are not meaningful until :meth:`load_compact`; they are built under a forked RNG so
        building a sub-model never shifts the global torch RNG.
        """
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        with torch.random.fork_rng(devices=[]):
            for name, m in template.named_children():
                if isinstance(m, nn.Linear):
                    layer = self.layers[name]
                    k_in = counts[layer.source] * layer.group if layer.source else m.in_features
                    k_out = counts[name] if layer.hidden else m.out_features
                    if fan_in_scaling and layer.source and k_in < m.in_features:
                        layers[f"{name}_fanin"] = Scaler(k_in / m.in_features)
                    layers[name] = nn.Linear(k_in, k_out, bias=m.bias is not None)
                elif isinstance(m, nn.Conv2d):
                    layer = self.layers[name]
                    k_in = counts[layer.source] if layer.source else m.in_channels
                    k_out = counts[name] if layer.hidden else m.out_channels
                    if fan_in_scaling and layer.source and k_in < m.in_channels:
                        layers[f"{name}_fanin"] = Scaler(k_in / m.in_channels)
                    layers[name] = nn.Conv2d(
                        k_in,
                        k_out,
                        m.kernel_size,  # type: ignore[arg-type]
                        stride=m.stride,  # type: ignore[arg-type]
                        padding=m.padding,  # type: ignore[arg-type]
                        dilation=m.dilation,  # type: ignore[arg-type]
                        bias=m.bias is not None,
                        padding_mode=m.padding_mode,
                    )
                elif isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                    k = counts.get(self.owner[name], m.num_features)
                    layers[name] = type(m)(
                        k,
                        eps=m.eps,
                        momentum=m.momentum,
                        affine=m.affine,
                        track_running_stats=m.track_running_stats,
                    )
                elif isinstance(m, Scaler):
                    layers[name] = Scaler(rate)
                else:
                    layers[name] = copy.deepcopy(m)
        return nn.Sequential(layers)

    def load_compact(self, sub: nn.Module, compact: Mapping[str, np.ndarray]) -> None:
        """Load the sliced tensors into a sub-model (integer buffers keep the sub-model's own)."""
        sd = sub.state_dict()
        new = {
            k: torch.from_numpy(np.array(compact[k], dtype=np.float32, copy=True)) if k in compact else v
            for k, v in sd.items()
        }
        sub.load_state_dict(new)

    def sub_arrays(self, sub: nn.Module) -> dict[str, np.ndarray]:
        """The sub-model's float tensors (what is uploaded, before slicing metadata is attached)."""
        return {
            k: t.detach().cpu().numpy().astype(np.float32)
            for k, t in sub.state_dict().items()
            if k in self.shapes
        }

    # -- aggregation --------------------------------------------------------------------------------
    def scatter(
        self, tensors: Mapping[str, codec.Tensor], weight: float = 1.0
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Per-coordinate ``weight · value`` sums and ``weight`` counts of one (validated) upload."""
        sums: dict[str, np.ndarray] = {}
        counts: dict[str, np.ndarray] = {}
        for k, t in tensors.items():
            shape = self.shapes[k]
            s = np.zeros(shape, dtype=np.float64)
            c = np.zeros(shape, dtype=np.float64)
            if isinstance(t, codec.Dense):
                s[...] = weight * np.asarray(t.array, dtype=np.float64)
                c[...] = weight
            elif isinstance(t, codec.Sliced):
                mesh = np.ix_(
                    *(
                        np.arange(d, dtype=np.int64) if ix is None else ix
                        for ix, d in zip(t.indices, shape, strict=True)
                    )
                )
                s[mesh] = weight * np.asarray(t.values, dtype=np.float64)
                c[mesh] = weight
            else:
                raise codec.CodecError("tensor", f"{k}: expected a dense or sliced tensor")
            sums[k], counts[k] = s, c
        return sums, counts

    @staticmethod
    def average(
        old: np.ndarray, total: np.ndarray, count: np.ndarray, *, include_global: bool = False
    ) -> np.ndarray:
        """Holder mean (spec §2.6): ``sum/cnt`` where ``cnt > 0``, the old value elsewhere.

        ``include_global`` is the authors' code variant: the old value is one extra vote,
        ``(w + sum) / (1 + cnt)`` (equal to ``w`` where nobody trained).
        """
        base = np.asarray(old, dtype=np.float64)
        if include_global:
            return ((base + total) / (1.0 + count)).astype(old.dtype)
        new = base.copy()
        held = count > 0
        new[held] = total[held] / count[held]
        return new.astype(old.dtype)

    # -- accounting (spec §4.2) ---------------------------------------------------------------------
    def kept_numel(self, counts: Mapping[str, int]) -> dict[str, int]:
        """Exact element count per tensor of the sub-model with ``counts`` (~r² for hidden-hidden)."""
        out: dict[str, int] = {}
        for k, shape in self.shapes.items():
            rule = self.rules[k]
            dims = list(shape)
            if rule.out is not None:
                dims[0] = counts[rule.out]
            if rule.src is not None:
                dims[1] = counts[rule.src] * rule.group
            out[k] = int(math.prod(dims))
        return out

    def params(self, counts: Mapping[str, int]) -> int:
        return sum(self.kept_numel(counts).values())

    def params_linear(self, rate: float) -> float:
        """The paper's Table 7 convention: every non-classifier tensor scales by ``r``, the classifier
        not at all (spec §4.3), so our numbers can be put next to the paper's."""
        last = next(n for n, layer in self.layers.items() if not layer.hidden)
        total = 0.0
        for k, shape in self.shapes.items():
            n = math.prod(shape)
            total += n if k.rsplit(".", 1)[0] == last else rate * n
        return total

    def forward_macs(self, counts: Mapping[str, int]) -> int:
        """Per-sample multiply-accumulates of the Linear/Conv layers of the sub-model."""
        total = 0
        for name, layer in self.layers.items():
            k_out = counts[name] if layer.hidden else layer.units
            k_in = counts[layer.source] * layer.group if layer.source else layer.in_dim
            total += k_out * k_in * layer.kernel * layer.positions
        return total

    def extraction_bytes(self, n_inf: int) -> int:
        """Peak memory of FedDSE's scoring pass (spec §4.2 ``Mem_extract``): the full model's float32
        parameters plus, for the whole inference batch, the largest pair of consecutive live
        activations (layer by layer, nothing cached)."""
        sizes = [self.input_numel, *self.child_out]
        peak = max(a + b for a, b in itertools.pairwise(sizes))
        return 4 * sum(math.prod(s) for s in self.shapes.values()) + 4 * n_inf * peak


@torch.no_grad()
def unit_scores(model: nn.Sequential, structure: WidthStructure, x: np.ndarray) -> dict[str, np.ndarray]:
    """Mean activation of every hidden unit on ``x`` from one forward pass of the *full* model.

    Spec §3.1: post-ReLU outputs, averaged over samples (and spatial positions for convs), scored on
    the full model (not on the progressively pruned one), layer by layer with nothing cached — each
    child's input is dropped as soon as its output exists. Means, not the authors' sums, so that
    ``softmax(s/T)`` has a scale that does not grow with the data size (§9.1). Evaluation mode, so
    dropout is off; static BN (no running stats) still uses the inference batch's statistics.
    """
    was = model.training
    model.eval()
    wanted = {v: k for k, v in structure.score_at.items()}
    out: dict[str, np.ndarray] = {}
    h = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    for name, m in model.named_children():
        h = m(h)
        if name in wanted:
            a = h if name != wanted[name] else h.abs()  # a layer without activation: magnitude
            dims = [0, *range(2, a.dim())]
            out[wanted[name]] = a.mean(dim=dims).double().numpy()
    model.train(was)
    return out


# -- capacity (spec §2.2) ---------------------------------------------------------------------------------
class WidthOptions(BaseModel):
    """Options shared by every width-slice algorithm (capacity, rounding, aggregation variants).

    * ``capacity``: how a device's width ratio ``r`` is chosen each round —
      ``paper`` (levels drawn with ``level_probs``, then the paper's ±1/16 fluctuation, §2.2),
      ``levels`` (levels drawn with ``level_probs``, no fluctuation: the authors' code, and with two
      levels the rho sweep of §7.2), ``fixed`` (every device ``fixed_rate``: Table 2's homogeneous
      rows), ``budget`` (the largest rate of ``budget_grid`` whose training footprint fits the
      device's ``memory_bytes``; devices without a profile use ``tier_rates[tier]`` or
      ``fixed_rate``). Draws are keyed by (seed, round, device): every process agrees.
    * ``cap_by_budget``: in the sampled modes, never give a device more than its memory admits (so a
      drawn rate cannot be refused at admission on a memory-limited fleet).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: how a device's width ratio r is chosen each round: ``paper`` (a level drawn with
    #: ``level_probs``, then the paper's ±1/16 fluctuation), ``levels`` (drawn, no fluctuation),
    #: ``fixed`` (``fixed_rate`` for all), ``budget`` (the largest ``budget_grid`` rate whose
    #: training footprint fits the device's memory)
    capacity: Literal["paper", "levels", "fixed", "budget"] = "paper"
    #: the width ratios ``paper`` / ``levels`` draw from
    levels: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)
    #: probabilities of ``levels`` (None = uniform, the paper's 1/5 each)
    level_probs: tuple[float, ...] | None = None
    #: every device's ratio under ``fixed``, and the fallback of ``budget`` for devices without a
    #: memory profile and without a ``tier_rates`` entry
    fixed_rate: float = Field(1.0, gt=0, le=1)
    #: ``budget`` mode: tier name -> ratio, for devices without a memory profile
    tier_rates: dict[str, float] = Field(default_factory=dict)
    #: the ratios ``budget`` mode chooses from (default: 1/16 … 16/16)
    budget_grid: tuple[float, ...] = tuple(k / 16 for k in range(1, 17))
    #: sampled modes: never give a device more width than its memory admits, so a drawn rate is
    #: not refused at admission on a memory-limited fleet
    cap_by_budget: bool = True
    #: ``k = max(1, floor(r·m))`` (FedDSE code) or ``ceil`` (HeteroFL/FedRolex code)
    rounding: Literal["floor", "ceil"] = "floor"
    #: p_n of the holder mean: 1 (the paper: unweighted) or the device's sample count
    weighting: Literal["uniform", "samples"] = "uniform"
    #: the authors' code: the old global value is one extra vote, (w + Σ w_n) / (1 + cnt)
    agg_include_global: bool = False
    #: FedRolex code: classifier rows (classes) are averaged only over clients holding that label
    agg_classifier_by_label: bool = False
    #: HeteroFL code trick: logits of classes absent from the local data are zeroed in training
    label_mask: bool = False
    #: training-only ×(m_in/k_in) on the input of every layer whose inputs were cut (``submodel``); for
    #: models without HeteroFL's ``Scaler`` (the spec's MLP has none, so the default is off)
    fan_in_scaling: bool = False

    @model_validator(mode="after")
    def _check(self) -> WidthOptions:
        for what, rates in (("levels", self.levels), ("budget_grid", self.budget_grid)):
            if not rates or any(not 0 < r <= 1 for r in rates):
                raise ValueError(f"{what} must be non-empty rates in (0, 1]")
        if self.level_probs is not None:
            if len(self.level_probs) != len(self.levels) or any(p < 0 for p in self.level_probs):
                raise ValueError("level_probs needs one non-negative probability per level")
            if abs(sum(self.level_probs) - 1.0) > 1e-6:
                raise ValueError("level_probs must sum to 1")
        if any(not 0 < r <= 1 for r in self.tier_rates.values()):
            raise ValueError("tier_rates must be in (0, 1]")
        return self


def paper_fluctuation(beta: float) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """The §2.2 table: rates ``(beta + 1/16, beta, beta - 1/16)`` and their probabilities.

    beta = 1 → (0, 0.01, 0.99) ("most clients' capacities do not reach the server's"); the smallest
    level (beta - 1/16 <= 0) never moves; every other level (0.01, 0.98, 0.01).
    """
    rates = (beta + SIXTEENTH, beta, beta - SIXTEENTH)
    if beta >= 1.0:
        probs = (0.0, 0.01, 0.99)
    elif beta - SIXTEENTH <= 1e-12:
        probs = (0.0, 1.0, 0.0)
    else:
        probs = (0.01, 0.98, 0.01)
    return rates, probs


def sample_rate(opts: WidthOptions, rng: np.random.Generator) -> float:
    """One draw of the sampled capacity modes (``paper``/``levels``; ``fixed`` returns the rate)."""
    if opts.capacity == "fixed":
        return opts.fixed_rate
    probs = (
        np.full(len(opts.levels), 1.0 / len(opts.levels)) if opts.level_probs is None else opts.level_probs
    )
    beta = float(opts.levels[int(rng.choice(len(opts.levels), p=np.asarray(probs, dtype=np.float64)))])
    if opts.capacity != "paper":
        return beta
    rates, p = paper_fluctuation(beta)
    r = float(rates[int(rng.choice(3, p=np.asarray(p)))])
    return float(min(1.0, max(SIXTEENTH, r)))


def expected_upload_fraction(structure: WidthStructure, opts: WidthOptions) -> float:
    """E[Params(r)] / Params(1) under the sampled capacity distribution (spec §4.2 / C6: 0.312 for
    the 64-128-64-10 MLP, 0.243 for the paper's CNN)."""
    full = structure.params(structure.widths())
    probs = (
        np.full(len(opts.levels), 1.0 / len(opts.levels)) if opts.level_probs is None else opts.level_probs
    )
    total = 0.0
    for beta, pb in zip(opts.levels, probs, strict=True):
        if opts.capacity == "paper":
            rates, p = paper_fluctuation(beta)
            pairs: Sequence[tuple[float, float]] = [
                (min(1.0, max(SIXTEENTH, r)), q) for r, q in zip(rates, p, strict=True)
            ]
        else:
            pairs = [(beta, 1.0)]
        for r, q in pairs:
            if q > 0:
                total += pb * q * structure.params(structure.counts(r, opts.rounding)) / full
    return total
