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

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.algorithms.device_state import atomic_write_bytes


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
    devices: set[int] = field(default_factory=set)
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
    changed: dict[str, set[int]] = field(default_factory=dict)
    unplaced: list[int] = field(default_factory=list)


class HostTable:
    """Live hosts and their device leases (see the module docstring)."""

    def __init__(self, devices: Iterable[int], need: Mapping[int, int] | None = None) -> None:
        self.all_devices = sorted(devices)
        self._devices = frozenset(self.all_devices)
        #: bytes a device's largest task may need on its host (min of its budget and the full model)
        self.need = dict(need or {})
        self.hosts: dict[str, Host] = {}
        self.lease: dict[int, str] = {}
        self.epoch = 0
        self._seq = 0
        #: something changed since the last rebalance (a join, a leave, an expiry)
        self.dirty = False
        self.last_join = 0.0

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
            # after a server restart a host still holds devices: keep them where possible
            host.devices = {d for d in holding if self.lease.get(d, host_id) == host_id}
            for d in host.devices:
                self.lease[d] = host_id
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
            for d in host.devices:
                if self.lease.get(d) == host_id:
                    del self.lease[d]
            self.dirty = True
        return host

    # -- what the server reads ---------------------------------------------------------------------
    def available(self) -> list[int]:
        """Devices leased to a live host that has applied the lease: safe to send a task to."""
        return sorted(
            d for d, h in self.lease.items() if self.hosts[h].settled and not self.hosts[h].draining
        )

    def settled(self) -> bool:
        return all(h.settled for h in self.hosts.values())

    def host_of(self, device: int) -> str | None:
        return self.lease.get(device)

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
                if d in self._devices:
                    pinned_by.setdefault(d, h.host_id)
        for d, hid in pinned_by.items():
            want[hid].add(d)
        free_hosts = [h for h in live if h.pinned is None]
        pool = [d for d in self.all_devices if d not in pinned_by]
        target = self._targets(free_hosts, pool)
        orphans: list[int] = []
        for d in pool:  # keep a device where it is while its host is under its target
            holder = self.hosts.get(self.lease.get(d, ""))
            keep = holder is not None and holder.host_id in target and self._fits(holder, d)
            if holder is not None and keep and len(want[holder.host_id]) < target[holder.host_id]:
                want[holder.host_id].add(d)
            else:
                orphans.append(d)
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
            in_pool = set(pool)
            order = sorted(left, key=lambda h: (-len(h.devices & in_pool), h.seq))
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
        changed = {
            hid: devs
            for hid, devs in want.items()
            if devs != self.hosts[hid].devices or self.hosts[hid].acked_epoch < 0
        }
        if changed:
            self.epoch += 1
        result = Rebalance(self.epoch, unplaced=unplaced)
        for hid, devs in changed.items():
            host = self.hosts[hid]
            result.changed[hid] = devs - host.devices
            host.devices = devs
            host.assigned_epoch = self.epoch
        self.lease = {d: hid for hid, h in self.hosts.items() for d in h.devices}
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
