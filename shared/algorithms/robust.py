"""Robust aggregation: norm clipping, coordinate-wise median, trimmed mean, Krum and multi-Krum.

Why these four: they are what FL researchers expect a framework to offer against poisoned updates
(Flower ships the same set), and each answers a different attack. Clipping bounds how far one update
can move the model; the coordinate-wise median and the trimmed mean ("Byzantine-robust distributed
learning: towards optimal statistical rates") ignore the extreme values of each coordinate; Krum
("Machine learning with adversaries: Byzantine tolerant gradient descent") keeps the update(s)
closest to their neighbours and drops the rest.

Where it runs, and why there: none of the order statistics is associative — the median of two
partial medians is not the median — so it cannot be folded into the aggregators' running sums the
way the mean is. Clipping *is* exact across an aggregator tree in principle (the sum of clipped
changes), but it clips the change from the round's global model, which only the server holds. So
when any option is on, the aggregators keep each update whole: ``reduce`` files it under its device
(``robust/<device>/<name>``), ``merge`` is the plain union (the server already refuses a partial that
overlaps devices it has, so no key is ever filed twice), and the robust step runs once, at the
server, in ``finalize``, over the updates sorted by device. The result is therefore the same however
many aggregators there are and in whatever order updates arrive. The price is what the mean avoids:
partials and the server's memory grow with the number of updates (O(updates × model)).

Which algorithms can use it (``Strategy.mean_form``): those whose aggregation is a weighted mean.
``whole``: one update folds into ``{name: n·x}`` plus a scalar ``weight`` n and ``finalize`` divides
(FedAvg). ``coordinate``: per-coordinate sums and counts over the coordinates each device's
sub-model holds (the width-slice family: HeteroFL, FedRolex, FjORD, Federated Dropout, FedDSE); an
update then travels with its per-coordinate weights (0 where its sub-model does not reach, so nothing
non-finite is sent), the server reads it as NaN there, each coordinate's statistic is over the
devices that hold it, and Krum — whose distances need common coordinates — is refused. The robust
step turns the updates into one estimate and hands the algorithm a partial of its own shape.
Algorithms that merge masks, thresholds, scores or personal layers are refused by ``check``
(``fedfleet validate`` says why).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import numpy as np

from shared.algorithms.base import Partial, ServerState, Strategy, UpdateSpec
from shared.config import RobustConfig

#: key prefix of an update filed whole inside a partial: ``robust/<device>/<tensor name>``
PREFIX = "robust/"
#: per-coordinate weights of a sub-model update: ``robust-count/<device>/<tensor name>``
COUNT = "robust-count/"


def check(strategy: type[Strategy], cfg: RobustConfig) -> None:
    """Refuse a robust option the algorithm cannot use, saying why (``fedfleet validate``)."""
    if not cfg.active:
        return
    what = f"robust.aggregation={cfg.aggregation!r}" + (" with robust.clip_norm" if cfg.clip_norm else "")
    if strategy.mean_form is None:
        usable = ", ".join(sorted(n for n, c in _registry().items() if c.mean_form is not None))
        raise ValueError(
            f"robust: algorithm {strategy.name!r} cannot use {what}: its aggregation is not a weighted "
            "mean of updates over common coordinates (it merges masks, thresholds, scores or personal "
            "layers, which a median or a distance would not mean anything over). Robust aggregation "
            f"applies to: {usable}"
        )
    if strategy.mean_form == "coordinate" and cfg.aggregation in ("krum", "multi_krum"):
        raise ValueError(
            f"robust: algorithm {strategy.name!r} cannot use {what}: its devices train sub-models that "
            "cover different coordinates, and Krum's distances need every update over the same ones. "
            "Use median, trimmed_mean or clip_norm"
        )


def _registry() -> dict[str, type[Strategy]]:
    from shared.algorithms import REGISTRY

    return REGISTRY


@cache
def wrap(strategy: type[Strategy]) -> type[Strategy]:
    """``strategy`` with its aggregation half replaced by the robust one (everything else inherited,
    so the services, the client half and the accounting see the same algorithm)."""
    return type(f"Robust{strategy.__name__}", (RobustMixin, strategy), {"base": strategy})


@dataclass
class _Update:
    """One device's update as robust aggregation sees it."""

    device: int
    #: its weight in a mean (whole updates: the algorithm's sample weight)
    weight: float
    #: its values per tensor; NaN where a sub-model does not hold the coordinate
    values: dict[str, np.ndarray]
    #: per-coordinate weights (0 where not held); None for whole updates (every coordinate held)
    counts: dict[str, np.ndarray] | None = None


class RobustMixin(Strategy):
    """The aggregation half of robust aggregation; mixed in front of a weighted-mean strategy."""

    #: the algorithm it is mixed into, whose own reduce and finalize it calls
    base: ClassVar[type[Strategy]]
    #: what the last ``finalize`` did with the updates (clipped / excluded / used): the server
    #: reads it into ``fedfleet_robust_updates_total``
    robust_counts: Counter[str]

    @property
    def robust(self) -> RobustConfig:
        return self.ctx.robust or RobustConfig()

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """File the update whole under its device: the robust step needs every update at the server."""
        if not self.robust.active:
            return self.base.reduce(self, partial, update)
        if update.device_id is None:
            raise ValueError("robust aggregation needs the update's device id")
        single = self.base.reduce(self, Partial(), update)
        key = f"{PREFIX}{update.device_id}"
        if self.mean_form == "whole":
            weight = single.scalars.get("weight", 0.0)
            if set(single.scalars) != {"weight"} or weight <= 0:
                raise TypeError(f"{self.name}: reduce does not produce a weighted-mean partial")
            for name, total in single.arrays.items():
                partial.arrays[f"{key}/{name}"] = total / weight
            partial.scalars[key] = weight
            return partial
        # per coordinate: ``sum/<name>`` = p·x and ``count/<name>`` = p where the device holds it
        rest = Partial({}, dict(single.scalars))
        for name, arr in single.arrays.items():
            if name.startswith("sum/"):
                count = single.arrays[f"count/{name[4:]}"]
                held = count > 0
                value = np.zeros(arr.shape)  # not NaN: nothing non-finite travels (the counts say)
                value[held] = arr[held] / count[held]
                partial.arrays[f"{key}/{name[4:]}"] = value
                partial.arrays[f"{COUNT}{update.device_id}/{name[4:]}"] = count
            elif not name.startswith("count/"):
                rest.arrays[name] = arr
        partial.scalars[key] = 1.0
        return partial.add(rest)

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        self.robust_counts = Counter()
        updates = _updates(partial) if partial is not None else []
        if partial is None or not updates:
            return self.base.finalize(self, state, partial, round)
        cfg = self.robust
        if cfg.clip_norm is not None:
            self.robust_counts["clipped"] = clip(updates, state.arrays, cfg.clip_norm)
        estimate, used = aggregate(updates, cfg)
        self.robust_counts["used"] = len(used)
        self.robust_counts["excluded"] = len(updates) - len(used)
        if self.mean_form == "whole":
            weight = float(sum(u.weight for u in updates))
            merged = Partial({name: value * weight for name, value in estimate.items()}, {"weight": weight})
            return self.base.finalize(self, state, merged, round)
        # per coordinate: the estimate where some device held the coordinate, with the holders' count
        merged = Partial(
            {k: v for k, v in partial.arrays.items() if not k.startswith((PREFIX, COUNT))},
            {k: v for k, v in partial.scalars.items() if not k.startswith(PREFIX)},
        )
        for name, value in estimate.items():
            held = np.sum([u.counts[name] for u in updates if u.counts is not None], axis=0)
            merged.arrays[f"sum/{name}"] = np.nan_to_num(value, nan=0.0) * held
            merged.arrays[f"count/{name}"] = held
        return self.base.finalize(self, state, merged, round)


def _updates(partial: Partial) -> list[_Update]:
    """The updates filed in a merged partial, sorted by device (so the result never depends on the
    order partials arrived in)."""
    found: dict[int, _Update] = {}
    for key, weight in partial.scalars.items():
        if key.startswith(PREFIX):
            device = int(key[len(PREFIX) :])
            found[device] = _Update(device, weight, {})
    for key, value in partial.arrays.items():
        if key.startswith(PREFIX):
            device_s, name = key[len(PREFIX) :].split("/", 1)
            found[int(device_s)].values[name] = value
        elif key.startswith(COUNT):
            device_s, name = key[len(COUNT) :].split("/", 1)
            update = found[int(device_s)]
            update.counts = {} if update.counts is None else update.counts
            update.counts[name] = value
    for update in found.values():  # a coordinate the sub-model does not hold is no value at all
        for name, count in (update.counts or {}).items():
            update.values[name] = np.where(count > 0, update.values[name], np.nan)
    return [found[d] for d in sorted(found)]


def clip(updates: list[_Update], reference: dict[str, np.ndarray], bound: float) -> int:
    """Scale each update's change from ``reference`` (the round's global model) down to L2 norm
    ``bound``, in place; returns how many were clipped. The norm is over all tensors together (the
    coordinates the device holds), as in "Learning differentially private recurrent language
    models"."""
    clipped = 0
    for u in updates:
        deltas = {n: v - np.asarray(reference[n], dtype=np.float64) for n, v in u.values.items()}
        norm = math.sqrt(sum(float(np.nansum(d * d)) for d in deltas.values()))
        if norm > bound:
            scale = bound / norm
            u.values = {n: np.asarray(reference[n], dtype=np.float64) + d * scale for n, d in deltas.items()}
            clipped += 1
    return clipped


def aggregate(updates: list[_Update], cfg: RobustConfig) -> tuple[dict[str, np.ndarray], list[int]]:
    """The robust estimate of every tensor, and the devices whose updates it used.

    Sub-model updates hold NaN where they do not hold a coordinate: each coordinate's median, trimmed
    mean or mean is over the devices that hold it (NaN where none does)."""
    names = sorted(set.intersection(*(set(u.values) for u in updates)))
    stacked = {n: np.stack([u.values[n] for u in updates]) for n in names}
    devices = [u.device for u in updates]
    k = len(updates)
    if cfg.aggregation == "mean":
        return {n: _mean(updates, n, x) for n, x in stacked.items()}, devices
    if cfg.aggregation == "median":
        with warnings.catch_warnings():  # a coordinate nobody holds is NaN, as it should be
            warnings.simplefilter("ignore", RuntimeWarning)
            return {n: np.nanmedian(x, axis=0) for n, x in stacked.items()}, devices
    if cfg.aggregation == "trimmed_mean":
        return {n: _trimmed_mean(x, cfg.trim_fraction) for n, x in stacked.items()}, devices
    weights = np.array([u.weight for u in updates], dtype=np.float64)
    chosen = krum_select(np.concatenate([x.reshape(k, -1) for x in stacked.values()], axis=1), cfg)
    w = weights[chosen]
    estimate = {n: np.tensordot(w, x[chosen], axes=1) / w.sum() for n, x in stacked.items()}
    return estimate, [devices[i] for i in chosen]


def _mean(updates: list[_Update], name: str, stacked: np.ndarray) -> np.ndarray:
    """The algorithm's own weighted mean: by sample weight, or per coordinate by its weights."""
    if all(u.counts is None for u in updates):
        weights = np.array([u.weight for u in updates], dtype=np.float64)
        return np.asarray(np.tensordot(weights, stacked, axes=1) / weights.sum())
    counts = np.stack(
        [u.counts[name] if u.counts is not None else np.ones_like(u.values[name]) for u in updates]
    )
    total = counts.sum(axis=0)
    out = np.full(total.shape, np.nan)
    held = total > 0
    out[held] = (np.nan_to_num(stacked, nan=0.0) * counts).sum(axis=0)[held] / total[held]
    return out


def _trimmed_mean(stacked: np.ndarray, fraction: float) -> np.ndarray:
    """Per coordinate, the mean without the ``⌊fraction·h⌋`` largest and smallest of its h holders."""
    k = stacked.shape[0]
    ordered = np.sort(stacked, axis=0)  # NaN (not held) sorts last
    holders = np.sum(~np.isnan(stacked), axis=0)
    cut = np.floor(fraction * holders)
    rank = np.arange(k).reshape((k,) + (1,) * (stacked.ndim - 1))
    keep = (rank >= cut) & (rank < holders - cut)
    kept = keep.sum(axis=0)
    out = np.full(holders.shape, np.nan)
    total = np.where(keep, np.nan_to_num(ordered, nan=0.0), 0.0).sum(axis=0)
    out[kept > 0] = total[kept > 0] / kept[kept > 0]
    return out


def krum_select(flat: np.ndarray, cfg: RobustConfig) -> list[int]:
    """Indices of the rows Krum (one) or multi-Krum (``multi_krum_keep``, default all but
    ``byzantine``) keeps: the lowest scores, a score being the sum of squared distances to the row's
    ``k - f - 2`` nearest other rows (at least one). Ties go to the lower index (lower device id)."""
    k = flat.shape[0]
    if k == 1:
        return [0]
    sq = np.einsum("ij,ij->i", flat, flat)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T, 0.0)
    neighbours = min(max(k - cfg.byzantine - 2, 1), k - 1)
    scores = np.array([np.sort(np.delete(dist[i], i))[:neighbours].sum() for i in range(k)])
    order = sorted(range(k), key=lambda i: (scores[i], i))
    if cfg.aggregation == "krum":
        return order[:1]
    keep = cfg.multi_krum_keep if cfg.multi_krum_keep is not None else k - cfg.byzantine
    return sorted(order[: min(max(keep, 1), k)])
