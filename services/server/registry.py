"""The server's device registry: every registered device as strategies plan for it, made on access.

Why not a dict of ``DeviceInfo``: that held a pydantic object with a profile dict for every
registered device (~1.5 KB each: 150 MiB allocated at 100,000 devices, by ``tracemalloc``, and
every lazy profile made at start), though a round plans for ~1,300 of them. The fleet
(``LazyFleet``) already makes a profile from the seed when asked for it, and the partition says how
many samples a device has without making its indices; the registry asks them when a strategy looks
a device up. It holds nothing per device, so an idle registered device costs the server nothing here.

The values are the ones the dict held: equal ``DeviceInfo`` objects for the same ids, in id order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from shared.data.partitioning import Partition
from shared.devices import Device, LazyFleet, is_online
from shared.devices.seeding import uniform01
from shared.ids import device_id
from shared.schemas import DeviceInfo


class DeviceRegistry(Mapping[int, DeviceInfo]):
    """``Mapping[int, DeviceInfo]`` over device ids ``0..len(fleet)-1``, each value made on access.

    A lookup makes a fresh ``DeviceInfo`` (tens of microseconds; a round makes one per invited
    device): nothing is kept, so memory does not grow with the devices ever looked up.
    """

    def __init__(self, fleet: Sequence[Device], partitions: Partition) -> None:
        if len(fleet) != len(partitions):  # the experiment builds both for cfg.num_devices
            raise ValueError(f"a fleet of {len(fleet)} devices with {len(partitions)} partitions")
        self._fleet = fleet
        self._partitions = partitions

    def __len__(self) -> int:
        return len(self._fleet)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._fleet)))

    def __contains__(self, device: object) -> bool:
        return self._index(device) is not None

    def _index(self, device: object) -> int | None:
        """``device`` as an id of the fleet (numpy integers too, as dict keys took them), else None."""
        d = device_id(device)
        return d if d is not None and 0 <= d < len(self._fleet) else None

    def __getitem__(self, device: int) -> DeviceInfo:
        index = self._index(device)
        if index is None:
            raise KeyError(device)
        d = self._fleet[index]
        return DeviceInfo(
            device_id=d.device_id,
            tier=d.tier,
            num_samples=self._partitions.size(index),
            profile=d.profile.model_dump(mode="json"),
        )

    def tier(self, device: int) -> str:
        """The device's tier, without making its profile when the fleet is lazy."""
        if isinstance(self._fleet, LazyFleet):
            return self._fleet.tier(device)
        return self._fleet[device].tier

    def tier_counts(self) -> dict[str, int]:
        """Registered devices per tier, tiers in order of their first device (as counting did)."""
        if isinstance(self._fleet, LazyFleet):
            return self._fleet.tier_counts()
        counts: dict[str, int] = {}
        for d in self._fleet:
            counts[d.tier] = counts.get(d.tier, 0) + 1
        return counts


class DeviceNeed(Mapping[int, int]):
    """``device id → bytes its largest task may need on a host``: its memory budget, at most the
    full model's training footprint (admission refuses anything above the budget, and no task is
    larger than the full model).

    Why a view made on first use: a dict of it held ~90 bytes per registered device in the server
    (issue 16), and making it reads every device's profile (seconds at 100,000 devices), though the
    lease table asks for it only when a host says how much memory it has. The first lookup fills
    one ``int64`` array for the whole fleet (8 bytes per device); later ones read it.
    """

    def __init__(self, fleet: Sequence[Device], full_footprint_bytes: int) -> None:
        self._fleet = fleet
        self._full = full_footprint_bytes
        self._values: np.ndarray | None = None
        self._lock = threading.Lock()

    def _array(self) -> np.ndarray:
        with self._lock:
            if self._values is None:
                self._values = np.fromiter(
                    (min(d.profile.memory_bytes, self._full) for d in self._fleet),
                    dtype=np.int64,
                    count=len(self._fleet),
                )
            return self._values

    def __len__(self) -> int:
        return len(self._fleet)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._fleet)))

    def __getitem__(self, device: int) -> int:
        if isinstance(device, bool) or not isinstance(device, int | np.integer):
            raise KeyError(device)
        if not 0 <= device < len(self._fleet):
            raise KeyError(device)
        return int(self._array()[device])


class OnlineChances:
    """Which of the registered devices are online in a round, as ``is_online`` decides it, from each
    device's ``p_online`` kept in one array.

    Why: selection asks it of every registered device each round, and ``is_online`` reads the
    device's profile, which a lazy fleet makes from the seed: ~2.6 s per round at 100,000 devices,
    most of them idle. The first round reads every device's ``p_online`` once into a ``float64`` (the
    same value, so the same comparison) and a flag for the devices that have an availability trace
    (those keep going through ``is_online``): 9 bytes per device. A lazy fleet gives both by tier
    (``LazyFleet.online_chances``) without making a profile; any other fleet is read device by
    device. Later rounds only draw each device's coin (~0.2 s at 100,000).
    """

    def __init__(self, fleet: Sequence[Device]) -> None:
        self._fleet = fleet
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def _chances(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None and isinstance(self._fleet, LazyFleet):
            self._arrays = self._fleet.online_chances()
        if self._arrays is None:
            fleet = self._fleet
            make = fleet.__getitem__
            p = np.empty(len(fleet), dtype=np.float64)
            traced = np.zeros(len(fleet), dtype=bool)
            for d in range(len(fleet)):
                profile = make(d).profile
                p[d] = profile.p_online
                traced[d] = profile.trace is not None
            self._arrays = (p, traced)
        return self._arrays

    def online(self, devices: np.ndarray, round_: int, seed: int) -> np.ndarray:
        """A mask over ``devices`` (ids of the fleet): online in ``round_``."""
        p, traced = self._chances()
        out = np.empty(len(devices), dtype=bool)
        for i, d in enumerate(devices.tolist()):
            if traced[d]:
                out[i] = is_online(self._fleet[d], round_, seed)
            else:
                chance = float(p[d])
                out[i] = chance >= 1.0 or uniform01("online", seed, round_, d) < chance
        return out
