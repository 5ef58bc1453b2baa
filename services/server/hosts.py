"""The device table: which client host serves which device, until when.

Why the server owns it: client processes are interchangeable hosts. Nothing may depend on how many
there are or what they are called — a Kubernetes scale-up adds hosts, a scale-down or a crash takes
them away, mid-run. So a host only says what it *can* do (capacity, memory, pinned devices) and the
server decides what it *does*: it leases devices to live hosts, balances them, takes them back when
a host stops heartbeating or leaves, and gives them to others — always between rounds, never inside a
device's task.

Placement never changes results: a device's data, seed and state travel with it (its state is kept
by the server, see ``DeviceStore``), and selection draws from the devices, not from hosts. A lease
is a complete, versioned assignment: each change gets a new ``epoch``; a host applies the newest
lease it receives and acknowledges its epoch in a heartbeat. The devices a host serves count as
*available* only once it has acknowledged them, so no task is sent to a device whose task queue is
not bound yet.
"""

from __future__ import annotations

import operator
import shutil
from collections.abc import Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.algorithms.device_state import atomic_write_bytes
from shared.ids import device_id


class DeviceSet(Set[int]):
    """An immutable set of device ids held as one sorted ``int64`` array.

    Why not a ``set[int]``: a host's lease lists a quarter of a 100,000-device fleet, and a Python
    set of ints costs ~70 bytes per member (its table plus an int object each) where this costs 8
    (issue 16: an idle registered device should cost next to nothing). It compares equal to a
    ``set`` with the same members, so code and tests that read a host's devices as a set still work.
    """

    __slots__ = ("array",)

    def __init__(self, ids: Iterable[int] | np.ndarray = ()) -> None:
        if isinstance(ids, np.ndarray):
            arr = np.unique(ids.astype(np.int64, copy=False))
        else:
            arr = np.unique(np.fromiter((operator.index(d) for d in ids), dtype=np.int64))
        arr.flags.writeable = False
        #: the members, sorted, without repeats (read-only)
        self.array: np.ndarray = arr

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> DeviceSet:  # type: ignore[override]
        return cls(it)

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __contains__(self, device: object) -> bool:
        d = device_id(device)
        if d is None:
            return False
        i = int(np.searchsorted(self.array, d))
        return i < len(self.array) and int(self.array[i]) == d

    def __repr__(self) -> str:
        return f"DeviceSet({self.array.tolist()!r})"


@dataclass
class Host:
    host_id: str
    #: order of joining (ties in balancing go to the earlier host: deterministic, not by name)
    seq: int
    last_seen: float
    capacity: int | None = None
    memory_bytes: int | None = None
    pinned: frozenset[int] | None = None
    draining: bool = False
    #: the devices leased to it, as of ``assigned_epoch``
    devices: DeviceSet = field(default_factory=DeviceSet)
    assigned_epoch: int = 0
    acked_epoch: int = -1

    @property
    def settled(self) -> bool:
        """It has applied its current lease."""
        return self.acked_epoch >= self.assigned_epoch


@dataclass
class Rebalance:
    """What one rebalance changed: the hosts whose lease must be (re)sent, and the devices each of
    them newly receives (whose stored state goes with the lease)."""

    epoch: int
    changed: dict[str, DeviceSet] = field(default_factory=dict)
    unplaced: list[int] = field(default_factory=list)


class LeaseView(Mapping[int, str]):
    """``device → host id`` of every leased device, read from the table's per-device array."""

    def __init__(self, table: HostTable) -> None:
        self._table = table

    def __getitem__(self, device: int) -> str:
        host = self._table.host_of(device)
        if host is None:
            raise KeyError(device)
        return host

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._table._holder >= 0).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self._table._holder >= 0))


class HostTable:
    """Live hosts and their device leases (see the module docstring).

    Per device it holds 4 bytes (the slot of the host holding its lease, in ``_holder``) plus 8 in
    its host's :class:`DeviceSet`: dicts and sets of Python ints here cost the server ~300 bytes per
    registered device, idle or not (issue 16). Device ids are small non-negative integers (the
    fleet's ``0..n-1``), so an array indexed by id is the compact form of a ``device → host`` map.
    """

    def __init__(self, devices: Iterable[int], need: Mapping[int, int] | None = None) -> None:
        #: every device the table leases, in id order (a ``range`` is kept as one: no list of ints)
        self.all_devices: range | list[int] = (
            devices if isinstance(devices, range) and devices.step == 1 else sorted(devices)
        )
        self._members: range | frozenset[int] = (
            self.all_devices if isinstance(self.all_devices, range) else frozenset(self.all_devices)
        )
        #: bytes a device's largest task may need on its host (min of its budget and the full model);
        #: kept as given, not copied (the server's is made on first use: see ``DeviceNeed``)
        self.need: Mapping[int, int] = need if need is not None else {}
        self.hosts: dict[str, Host] = {}
        #: per device id, the slot (index in ``_slots``) of the host holding its lease, -1 for none
        self._holder = np.full(max(self._members, default=-1) + 1, -1, dtype=np.int32)
        #: host id of each slot; a host gets a new slot each time it joins (never reused)
        self._slots: list[str] = []
        self._slot_of: dict[str, int] = {}
        self.epoch = 0
        self._seq = 0
        #: something changed since the last rebalance (a join, a leave, an expiry)
        self.dirty = False
        self.last_join = 0.0

    @property
    def lease(self) -> LeaseView:
        """``device → host id`` of every leased device (a read-only view)."""
        return LeaseView(self)

    # -- what hosts say ---------------------------------------------------------------------------
    def heartbeat(
        self,
        host_id: str,
        now: float,
        *,
        capacity: int | None = None,
        memory_bytes: int | None = None,
        pinned: Iterable[int] | None = None,
        holding: Iterable[int] = (),
        epoch: int = -1,
        leaving: bool = False,
    ) -> Host:
        """A host's heartbeat: its join when new, its acknowledgement of ``epoch``, its leave."""
        host = self.hosts.get(host_id)
        if host is None:
            self._seq += 1
            host = Host(host_id, self._seq, now, capacity, memory_bytes)
            host.pinned = frozenset(pinned) if pinned is not None else None
            slot = self._slot_of[host_id] = len(self._slots)
            self._slots.append(host_id)
            # after a server restart a host still holds devices: keep them where possible (devices
            # of this table only: another's ids have no place here, and balancing drops them anyway)
            held = np.fromiter((d for d in holding if d in self._members), dtype=np.int64)
            held = held[self._holder[held] < 0]  # a device another host holds stays with it
            host.devices = DeviceSet(held)
            self._holder[host.devices.array] = slot
            self.hosts[host_id] = host
            self.dirty = True
            self.last_join = now
        host.last_seen = now
        if epoch >= host.assigned_epoch:
            host.acked_epoch = max(host.acked_epoch, epoch)
        if leaving and not host.draining:
            host.draining = True
            self.dirty = True
        return host

    def expire(self, now: float, timeout_s: float) -> list[Host]:
        """Drop the hosts silent for longer than ``timeout_s``; their devices become unleased."""
        gone = [h for h in self.hosts.values() if now - h.last_seen > timeout_s]
        for host in gone:
            self.remove(host.host_id)
        return gone

    def remove(self, host_id: str) -> Host | None:
        host = self.hosts.pop(host_id, None)
        if host is not None:
            self._holder[self._holder == self._slot_of.pop(host_id)] = -1
            self.dirty = True
        return host

    # -- what the server reads ---------------------------------------------------------------------
    def available(self) -> list[int]:
        """Devices leased to a live host that has applied the lease: safe to send a task to."""
        return self.available_ids().tolist()

    def available_ids(self) -> np.ndarray:
        """``available()`` as a sorted ``int64`` array: 8 bytes per device where a list of ints
        takes ~36 (the server reads it for every registered device each round)."""
        ok = np.zeros(len(self._slots) + 1, dtype=bool)  # the last entry: slot -1, no host
        for host_id, slot in self._slot_of.items():
            h = self.hosts[host_id]
            ok[slot] = h.settled and not h.draining
        return np.flatnonzero(ok[self._holder]).astype(np.int64, copy=False)

    def settled(self) -> bool:
        return all(h.settled for h in self.hosts.values())

    def host_of(self, device: int) -> str | None:
        try:
            d = operator.index(device)
        except TypeError:
            return None
        if not 0 <= d < len(self._holder):
            return None
        slot = int(self._holder[d])
        return self._slots[slot] if slot >= 0 else None

    def done_draining(self) -> list[Host]:
        """Leaving hosts that have given every device back (their empty lease applied)."""
        return [h for h in self.hosts.values() if h.draining and not h.devices and h.settled]

    # -- balancing ---------------------------------------------------------------------------------
    def rebalance(self) -> Rebalance:
        """Lease every device to a live host: pinned ones to their host, the rest spread evenly over
        the hosts that can hold them (each keeps what it has where it can). Returns what changed."""
        self.dirty = False
        live = sorted((h for h in self.hosts.values() if not h.draining), key=lambda h: h.seq)
        want: dict[str, set[int]] = {h.host_id: set() for h in self.hosts.values()}
        pinned_by: dict[int, str] = {}
        for h in live:
            for d in sorted(h.pinned or ()):
                if d in self._members:
                    pinned_by.setdefault(d, h.host_id)
        for d, hid in pinned_by.items():
            want[hid].add(d)
        free_hosts = [h for h in live if h.pinned is None]
        pool = [d for d in self.all_devices if d not in pinned_by]
        target = self._targets(free_hosts, pool)
        # the host holding each device now (None: no host), by slot: one lookup per device below
        by_slot = [self.hosts.get(hid) for hid in self._slots] + [None]
        holders = self._holder.tolist()
        orphans: list[int] = []
        for d in pool:  # keep a device where it is while its host is under its target
            holder = by_slot[holders[d]]
            keep = holder is not None and holder.host_id in target and self._fits(holder, d)
            if holder is not None and keep and len(want[holder.host_id]) < target[holder.host_id]:
                want[holder.host_id].add(d)
            else:
                orphans.append(d)
        del holders, by_slot
        unplaced: list[int] = []
        for d in orphans:  # to the emptiest host under its target; else any with room
            fitting = [h for h in free_hosts if self._fits(h, d) and self._room(h, want[h.host_id])]
            under = [h for h in fitting if len(want[h.host_id]) < target[h.host_id]]
            candidates = under or fitting
            if not candidates:
                unplaced.append(d)
                continue
            best = min(candidates, key=lambda h: (len(want[h.host_id]), h.seq))
            want[best.host_id].add(d)
        return self._apply(want, unplaced)

    def _targets(self, hosts: list[Host], pool: list[int]) -> dict[str, int]:
        """How many of ``pool`` each host should serve: as even as capacities allow (water-filling),
        the odd devices to the hosts that hold most now (fewest moves)."""
        remaining, left, target = len(pool), list(hosts), {}
        while left:
            fair = remaining / len(left)
            capped = [h for h in left if h.capacity is not None and h.capacity < fair]
            if not capped:
                break
            for h in capped:
                target[h.host_id] = int(h.capacity or 0)
                remaining -= target[h.host_id]
                left.remove(h)
        if left:
            base, extra = divmod(remaining, len(left))
            in_pool = np.asarray(pool, dtype=np.int64)
            held = {h.host_id: int(np.count_nonzero(np.isin(h.devices.array, in_pool))) for h in left}
            order = sorted(left, key=lambda h: (-held[h.host_id], h.seq))
            for i, h in enumerate(order):
                target[h.host_id] = base + (1 if i < extra else 0)
        return target

    def _fits(self, host: Host, device: int) -> bool:
        return host.memory_bytes is None or self.need.get(device, 0) <= host.memory_bytes

    @staticmethod
    def _room(host: Host, current: set[int]) -> bool:
        return host.capacity is None or len(current) < host.capacity

    def _apply(self, want: dict[str, set[int]], unplaced: list[int]) -> Rebalance:
        # a host new to this server (also one that held devices before a server restart) gets a
        # lease even when its devices stay the same: it must apply and acknowledge this lease
        wanted = {
            hid: DeviceSet(np.fromiter(devs, dtype=np.int64, count=len(devs))) for hid, devs in want.items()
        }
        want.clear()  # the sets of Python ints go now, before the arrays are compared
        changed = {
            hid: devs
            for hid, devs in wanted.items()
            if not np.array_equal(devs.array, self.hosts[hid].devices.array)
            or self.hosts[hid].acked_epoch < 0
        }
        if changed:
            self.epoch += 1
        result = Rebalance(self.epoch, unplaced=unplaced)
        for hid, devs in changed.items():
            host = self.hosts[hid]
            result.changed[hid] = DeviceSet(devs.array[~np.isin(devs.array, host.devices.array)])
            host.devices = devs
            host.assigned_epoch = self.epoch
        self._holder[:] = -1
        for hid, h in self.hosts.items():
            self._holder[h.devices.array] = self._slot_of[hid]
        return result


class DeviceStore:
    """The newest state of every device, kept by the server in ``<run>/device-state/device-<id>/``.

    Why the server: it already owns the run's durable volume (checkpoints, results); a pod's own disk
    goes with the pod, a volume every pod can mount (ReadWriteMany) is not available on every cluster,
    and a broker is not a store. A host sends a device's files after each task the device trains, so
    a device that moves — or whose host is killed — continues from its last finished task.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, device: int) -> Path:
        return self.root / f"device-{device}"

    def save(self, device: int, files: Mapping[str, bytes]) -> None:
        """Replace the device's files with ``files`` (each written whole; names already checked)."""
        target = self.path(device)
        target.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            atomic_write_bytes(target / name, data)
        for old in target.iterdir():
            if old.is_file() and old.name not in files and not old.name.endswith(".tmp"):
                old.unlink()

    def load(self, device: int) -> dict[str, bytes]:
        """The device's files (empty: it never trained)."""
        target = self.path(device)
        if not target.is_dir():
            return {}
        return {
            p.name: p.read_bytes()
            for p in sorted(target.iterdir())
            if p.is_file() and not p.name.endswith(".tmp")
        }

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
