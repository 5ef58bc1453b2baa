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

Which algorithms can use it: those whose aggregation is a sample-weighted mean of whole updates
(``Strategy.weighted_mean``): one update folds into ``{name: n·x}`` plus a scalar ``weight`` n, and
``finalize`` divides. The robust step turns the updates into one estimate and hands the algorithm a
partial of that shape. Algorithms that average per coordinate over sub-models, masks or thresholds
are refused by ``check`` (``fedfleet validate`` says why).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import numpy as np

from shared.algorithms.base import Partial, ServerState, Strategy, UpdateSpec
from shared.config import RobustConfig

log = logging.getLogger("fedfleet.robust")

#: key prefix of an update filed whole inside a partial: ``robust/<device>/<tensor name>``
PREFIX = "robust/"


def check(strategy: type[Strategy], cfg: RobustConfig) -> None:
    """Refuse a robust option the algorithm cannot use, saying why (``fedfleet validate``)."""
    if cfg.active and not strategy.weighted_mean:
        raise ValueError(
            f"robust: algorithm {strategy.name!r} cannot use robust.aggregation={cfg.aggregation!r}"
            f"{' with robust.clip_norm' if cfg.clip_norm is not None else ''}: its aggregation is not a "
            "sample-weighted mean of whole updates (it averages per coordinate over sub-models, masks "
            "or thresholds, so the updates have no common coordinates to take a median or distance "
            "over). Robust aggregation applies to: fedavg"
        )


@cache
def wrap(strategy: type[Strategy]) -> type[Strategy]:
    """``strategy`` with its aggregation half replaced by the robust one (everything else inherited,
    so the services, the client half and the accounting see the same algorithm)."""
    return type(f"Robust{strategy.__name__}", (RobustMixin, strategy), {"base": strategy})


@dataclass
class _Update:
    device: int
    weight: float
    values: dict[str, np.ndarray]


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
        weight = single.scalars.get("weight", 0.0)
        if set(single.scalars) != {"weight"} or weight <= 0:
            raise TypeError(f"{self.name}: reduce does not produce a weighted-mean partial")
        key = f"{PREFIX}{update.device_id}"
        for name, total in single.arrays.items():
            partial.arrays[f"{key}/{name}"] = total / weight
        partial.scalars[key] = weight
        return partial

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        self.robust_counts = Counter()
        updates = _updates(partial) if partial is not None else []
        if not updates:
            return self.base.finalize(self, state, partial, round)
        cfg = self.robust
        if cfg.clip_norm is not None:
            self.robust_counts["clipped"] = clip(updates, state.arrays, cfg.clip_norm)
        estimate, used = aggregate(updates, cfg)
        self.robust_counts["used"] = len(used)
        self.robust_counts["excluded"] = len(updates) - len(used)
        weight = float(sum(u.weight for u in updates))
        merged = Partial({name: value * weight for name, value in estimate.items()}, {"weight": weight})
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
    return [found[d] for d in sorted(found)]


def clip(updates: list[_Update], reference: dict[str, np.ndarray], bound: float) -> int:
    """Scale each update's change from ``reference`` (the round's global model) down to L2 norm
    ``bound``, in place; returns how many were clipped. The norm is over all tensors together, as
    in "Learning differentially private recurrent language models"."""
    clipped = 0
    for u in updates:
        deltas = {n: v - np.asarray(reference[n], dtype=np.float64) for n, v in u.values.items()}
        norm = math.sqrt(sum(float(np.vdot(d, d)) for d in deltas.values()))
        if norm > bound:
            scale = bound / norm
            u.values = {n: np.asarray(reference[n], dtype=np.float64) + d * scale for n, d in deltas.items()}
            clipped += 1
    return clipped


def aggregate(updates: list[_Update], cfg: RobustConfig) -> tuple[dict[str, np.ndarray], list[int]]:
    """The robust estimate of every tensor, and the devices whose updates it used."""
    names = sorted(set.intersection(*(set(u.values) for u in updates)))
    stacked = {n: np.stack([u.values[n] for u in updates]) for n in names}
    weights = np.array([u.weight for u in updates], dtype=np.float64)
    devices = [u.device for u in updates]
    k = len(updates)
    if cfg.aggregation == "mean":
        return {n: np.tensordot(weights, x, axes=1) / weights.sum() for n, x in stacked.items()}, devices
    if cfg.aggregation == "median":
        return {n: np.median(x, axis=0) for n, x in stacked.items()}, devices
    if cfg.aggregation == "trimmed_mean":
        cut = math.floor(cfg.trim_fraction * k)
        return {n: np.sort(x, axis=0)[cut : k - cut].mean(axis=0) for n, x in stacked.items()}, devices
    chosen = krum_select(np.concatenate([x.reshape(k, -1) for x in stacked.values()], axis=1), cfg)
    w = weights[chosen]
    estimate = {n: np.tensordot(w, x[chosen], axes=1) / w.sum() for n, x in stacked.items()}
    return estimate, [devices[i] for i in chosen]


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
