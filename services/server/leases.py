"""The server's side of the elastic fleet: hosts' heartbeats in, leases and device state out.

``HostTable`` (``hosts.py``) decides who serves what; this class talks to the hosts about it: it
records heartbeats, expires silent hosts, sends every changed lease — preceded by the stored state
of each device the host newly receives — and keeps the devices' state as hosts report it. The server
calls :meth:`settle` between rounds and opens the next round only once every lease is applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path

from services.server.hosts import DeviceStore, Host, HostTable
from shared import metrics
from shared.schemas import DeviceState, Heartbeat, Kind, Lease
from shared.schemas import _Body as Body
from shared.transport import Unroutable, key_host

log = logging.getLogger("fedfleet.server")

#: send(key, kind, body) for the current incarnation; raises ``Unroutable``
Send = Callable[[str, Kind, Body], int]


class Leases:
    def __init__(
        self,
        num_devices: int,
        need: Mapping[int, int],
        store_dir: Path,
        send: Send,
        *,
        experiment: str,
        lease_timeout_s: float,
    ) -> None:
        self.table = HostTable(range(num_devices), need)
        self.store = DeviceStore(store_dir)
        self.send = send
        self.experiment = experiment
        self.lease_timeout_s = lease_timeout_s

    # -- from hosts --------------------------------------------------------------------------------
    def heartbeat(self, msg: Heartbeat, epoch: int, now: float) -> None:
        """A host's heartbeat; ``epoch`` is the lease epoch it applied in *this* server's incarnation
        (-1 when it speaks of another's, e.g. after a server restart)."""
        new = msg.host_id not in self.table.hosts
        host = self.table.heartbeat(
            msg.host_id,
            now,
            capacity=msg.capacity,
            memory_bytes=msg.memory_bytes,
            pinned=msg.pinned,
            holding=msg.holding,
            epoch=epoch,
            leaving=msg.leaving,
        )
        if new:
            log.info(
                "host %s joined (capacity %s, memory %s, pinned %s)",
                host.host_id,
                host.capacity,
                host.memory_bytes,
                sorted(host.pinned) if host.pinned is not None else None,
                extra={"event": "host_joined"},
            )
        self._gauges()

    def device_state(self, host_id: str, msg: DeviceState) -> bool:
        """Keep a device's files if ``host_id`` holds its lease (False: not its device)."""
        if self.table.host_of(msg.device_id) != host_id:
            return False
        self.store.save(msg.device_id, msg.files)
        return True

    # -- timers ------------------------------------------------------------------------------------
    def expire(self, now: float) -> tuple[list[Host], list[Host]]:
        """Forget hosts silent for ``lease_timeout_s`` (first) and hosts that finished leaving."""
        gone = self.table.expire(now, self.lease_timeout_s)
        for host in gone:
            log.warning(
                "host %s missed its heartbeats for %.1fs; its %d devices go to other hosts",
                host.host_id,
                self.lease_timeout_s,
                len(host.devices),
                extra={"event": "host_lost"},
            )
            metrics.HOSTS_LOST.labels(self.experiment).inc()
        left = self.table.done_draining()
        for host in left:
            self.table.remove(host.host_id)
            log.info("host %s left", host.host_id, extra={"event": "host_left"})
        if gone or left:
            self._gauges()
        return gone, left

    def settle(self) -> bool:
        """Rebalance if anything changed and send the changed leases; True once every lease is applied."""
        if self.table.dirty:
            plan = self.table.rebalance()
            for host_id, received in plan.changed.items():
                self._send_lease(self.table.hosts[host_id], received, plan.epoch)
            if plan.unplaced:
                log.warning(
                    "%d devices have no host that can hold them: %s",
                    len(plan.unplaced),
                    plan.unplaced[:10],
                    extra={"event": "devices_unplaced"},
                )
            self._gauges()
        return self.table.settled()

    def _send_lease(self, host: Host, received: AbstractSet[int], epoch: int) -> None:
        """The stored state of each device the host newly receives, then the lease itself (one
        queue, in order: the host has the files before it serves the device)."""
        try:
            for device in sorted(received):
                files = self.store.load(device)
                if files:
                    self.send(
                        key_host(host.host_id), Kind.DEVICE_STATE, DeviceState(device_id=device, files=files)
                    )
            lease = Lease(host_id=host.host_id, epoch=epoch, devices=sorted(host.devices))
            self.send(key_host(host.host_id), Kind.LEASE, lease)
        except Unroutable:
            # its queue is gone: the host is gone too; its heartbeats stop and it expires
            log.warning("host %s cannot be reached", host.host_id, extra={"event": "host_unreachable"})
        log.info(
            "lease %d: host %s serves %d devices (%d new)",
            epoch,
            host.host_id,
            len(host.devices),
            len(received),
            extra={"event": "lease"},
        )

    def _gauges(self) -> None:
        metrics.HOSTS.labels(self.experiment).set(len(self.table.hosts))
        metrics.HOSTED_DEVICES.labels(self.experiment).set(len(self.table.lease))
