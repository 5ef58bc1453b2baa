"""Split a training set over devices: IID, label-Dirichlet, k classes per device, label shards.

All schemes are pure functions of ``(labels, arguments, seed)``: the server and every client
process recompute the same split independently instead of shipping index lists around, so
determinism is part of the contract, not a nicety. Each returns one sorted int64 index array
per device; the arrays are disjoint and non-empty.

What a process keeps is a :class:`Partition`: the computed split packed into two arrays
(:class:`IndexPartition`), or — the ``sampled`` scheme, for fleets larger than the dataset — each
device's draw made from its seed when asked (:class:`SampledPartition`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import overload

import numpy as np

#: partition schemes accepted by :func:`partition`
PARTITION_SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "classes", "shards")
#: the scheme made on demand per device (:class:`SampledPartition`), not by :func:`partition`
SAMPLED = "sampled"

#: how often the Dirichlet scheme redraws before it repairs a too-small device by moving samples
DIRICHLET_MAX_DRAWS = 100


def partition(
    labels: np.ndarray,
    num_devices: int,
    scheme: str,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_device: int = 2,
    shards_per_device: int = 2,
    min_samples: int = 1,
) -> list[np.ndarray]:
    """Partition the indices ``0..len(labels)-1`` over ``num_devices`` devices.

    - ``iid``: a seeded shuffle cut into near-equal parts (sizes differ by at most one).
    - ``dirichlet``: per class, proportions ~ Dir(``alpha``) over devices (Hsu et al. 2019); small
      ``alpha`` means strong label skew. Redrawn until every device has ``min_samples``; after
      :data:`DIRICHLET_MAX_DRAWS` draws the largest devices donate samples instead.
    - ``classes``: each device holds ``classes_per_device`` distinct labels, labels spread as evenly
      as possible over devices; a label's samples are shared equally by its holders. If
      ``num_devices * classes_per_device`` is below the number of labels, the labels nobody
      holds are left out (the only scheme whose union may not cover every index).
    - ``shards``: sort by label, cut into ``num_devices * shards_per_device`` equal shards and deal
      ``shards_per_device`` random shards to each device (McMahan et al. 2017).
    """
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-d, got shape {y.shape}")
    if y.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers, got {y.dtype}")
    n = len(y)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int | np.integer) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if num_devices > n:
        raise ValueError(f"num_devices ({num_devices}) exceeds the number of samples ({n})")
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1, got {min_samples}")
    if num_devices * min_samples > n:
        raise ValueError(
            f"{num_devices} devices x min_samples {min_samples} exceeds the {n} samples available"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), num_devices)
    elif scheme == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
        parts = _dirichlet(y, num_devices, alpha, min_samples, rng)
    elif scheme == "classes":
        parts = _classes(y, num_devices, classes_per_device, rng)
    elif scheme == "shards":
        parts = _shards(y, num_devices, shards_per_device, rng)
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; valid: {', '.join(PARTITION_SCHEMES)}")
    out = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    small = [i for i, p in enumerate(out) if len(p) < min_samples]
    if small:
        raise ValueError(
            f"scheme {scheme!r} left devices {small[:10]} with fewer than {min_samples} samples; "
            "use fewer devices or a less extreme setting"
        )
    return out


def _dirichlet(
    y: np.ndarray, num_devices: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = np.unique(y)
    by_class = [np.flatnonzero(y == c) for c in classes]
    parts: list[np.ndarray] = []
    for _ in range(DIRICHLET_MAX_DRAWS):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
        for idx in by_class:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(num_devices, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(np.int64)
            for device, chunk in enumerate(np.split(idx, cuts)):
                buckets[device].append(chunk)
        parts = [np.concatenate(b) for b in buckets]
        if min(len(p) for p in parts) >= min_samples:
            return parts
    return _repair(parts, min_samples, rng)


def _repair(parts: list[np.ndarray], min_samples: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Top up too-small devices with random samples of the currently largest ones (keeps the skew)."""
    parts = [rng.permutation(p) for p in parts]
    for device in range(len(parts)):
        while len(parts[device]) < min_samples:
            donor = max(range(len(parts)), key=lambda d: len(parts[d]))
            take = min(min_samples - len(parts[device]), len(parts[donor]) - min_samples)
            parts[device] = np.concatenate([parts[device], parts[donor][:take]])
            parts[donor] = parts[donor][take:]
    return parts


def _classes(y: np.ndarray, num_devices: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    classes = np.unique(y)
    if k < 1 or k > len(classes):
        raise ValueError(f"classes_per_device must be in 1..{len(classes)} (labels present), got {k}")
    load = np.zeros(len(classes), dtype=np.int64)
    holders: list[list[int]] = [[] for _ in classes]
    for device in range(num_devices):
        # The k least-held labels, ties broken at random: spreads labels evenly, pairs them randomly.
        order = rng.permutation(len(classes))
        chosen = order[np.argsort(load[order], kind="stable")[:k]]
        load[chosen] += 1
        for c in chosen:
            holders[c].append(device)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
    for c, devices in enumerate(holders):
        if not devices:
            continue
        idx = rng.permutation(np.flatnonzero(y == classes[c]))
        for device, chunk in zip(devices, np.array_split(idx, len(devices)), strict=True):
            parts[device].append(chunk)
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def _shards(y: np.ndarray, num_devices: int, per_device: int, rng: np.random.Generator) -> list[np.ndarray]:
    if per_device < 1:
        raise ValueError(f"shards_per_device must be >= 1, got {per_device}")
    num_shards = num_devices * per_device
    if num_shards > len(y):
        raise ValueError(
            f"{num_shards} shards ({num_devices} devices x {per_device}) exceed {len(y)} samples"
        )
    shards = np.array_split(np.argsort(y, kind="stable"), num_shards)
    order = rng.permutation(num_shards)
    return [
        np.concatenate([shards[s] for s in order[d * per_device : (d + 1) * per_device]])
        for d in range(num_devices)
    ]


def split_local(
    indices: np.ndarray, test_fraction: float, seed: int, *, labels: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Split one device's indices into local (train, test) for personalised evaluation.

    ``round(test_fraction * n)`` samples go to test, at least one when ``test_fraction > 0`` and the
    device has two or more, and never all of them (a device must keep something to train on).
    Given ``labels`` (indexed by the values in ``indices``), the split is stratified per label so
    the local test set has the device's own class mix.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-d, got shape {idx.shape}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n = len(idx)
    if test_fraction == 0.0 or n < 2:
        return np.sort(idx), np.empty(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    n_test = min(max(round(test_fraction * n), 1), n - 1)
    if labels is None:
        perm = rng.permutation(idx)
        test = perm[:n_test]
    else:
        test = _stratified_pick(idx, np.asarray(labels)[idx], n_test, rng)
    mask = np.isin(idx, test)
    return np.sort(idx[~mask]), np.sort(idx[mask])


def _stratified_pick(idx: np.ndarray, y: np.ndarray, n_test: int, rng: np.random.Generator) -> np.ndarray:
    """Pick ``n_test`` of ``idx`` with per-label counts proportional to the label counts."""
    classes, counts = np.unique(y, return_counts=True)
    exact = counts * (n_test / len(idx))
    take = np.floor(exact).astype(np.int64)
    # Largest remainders get the leftover picks (random tie-break), so the total is exactly n_test.
    rest = n_test - int(take.sum())
    if rest > 0:
        frac = exact - take + rng.random(len(classes)) * 1e-9
        take[np.argsort(-frac, kind="stable")[:rest]] += 1
    picked = [rng.permutation(idx[y == c])[:t] for c, t in zip(classes, take, strict=True)]
    return np.concatenate(picked)


class Partition(Sequence[np.ndarray]):
    """Every device's training indices, by device id, held compactly or made on demand.

    Why not a list of arrays: a Python list of 10,000 small arrays costs ~1 KB per device in each
    of the run's processes, and a client host serves only some of the devices. ``size`` answers
    "how many samples" without making the device's indices.
    """

    @abstractmethod
    def indices(self, device: int) -> np.ndarray:
        """The device's sorted int64 indices into the training set (read-only)."""

    @abstractmethod
    def size(self, device: int) -> int: ...

    @overload
    def __getitem__(self, device: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, device: slice) -> list[np.ndarray]: ...
    def __getitem__(self, device: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(device, slice):
            return [self.indices(d) for d in range(len(self))[device]]
        d = int(device)
        if d < 0:
            d += len(self)
        if not 0 <= d < len(self):
            raise IndexError(f"device {device} is outside the {len(self)} devices")
        return self.indices(d)


class IndexPartition(Partition):
    """A computed partition in two arrays (all indices, concatenated, and each device's offset):
    8 bytes per index plus 8 per device, instead of one Python array object per device."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if len(parts) else np.empty(0)
        self._flat = flat.astype(np.int64, copy=False)
        self._flat.flags.writeable = False

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def indices(self, device: int) -> np.ndarray:
        return self._flat[self._offsets[device] : self._offsets[device + 1]]

    def size(self, device: int) -> int:
        return int(self._offsets[device + 1] - self._offsets[device])


class SampledPartition(Partition):
    """The ``sampled`` scheme: each device draws ``per_device`` samples of the pool, uniformly, from
    its own seed — on demand, so a device that never trains costs nothing, and a fleet may have more
    devices than the pool has samples (devices then share samples, as phones of one population
    share a distribution). A device's samples are distinct unless it needs more than the pool holds
    (then, and only then, it draws with replacement)."""

    def __init__(self, pool: int, num_devices: int, per_device: int, seed: int) -> None:
        if pool < 1:
            raise ValueError("the sampled scheme needs a non-empty training set")
        if per_device < 1:
            raise ValueError(f"samples_per_device must be >= 1, got {per_device}")
        self.pool, self.num_devices, self.per_device, self.seed = pool, num_devices, per_device, seed

    def __len__(self) -> int:
        return self.num_devices

    def indices(self, device: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(device)])
        picked = rng.choice(self.pool, self.per_device, replace=self.per_device > self.pool)
        out = np.sort(picked.astype(np.int64))
        out.flags.writeable = False
        return out

    def size(self, device: int) -> int:
        return self.per_device
