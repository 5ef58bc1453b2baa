"""The client: one process hosting emulated devices — as many as the server leases it — whose limits
it enforces.

A client process is an interchangeable *host*. It heartbeats to the server (its join, its
acknowledgements, its leave), serves exactly the devices of its newest lease (binding their task
queues, loading their data, receiving their stored state first), sends each device's state back
after every task so the device can continue elsewhere, and on SIGTERM asks to leave: it keeps
serving until the server has given its devices to others, then exits 0.

For each task addressed to one of its devices it:

1. **admits** it — the task's training footprint (parameters, gradients, optimizer state, measured
   activations; ``Strategy.task_footprint``) against the device's memory budget; a task that does not
   fit is refused with a ``reject`` naming both numbers, never trained and never silently skipped;
2. emulates the **download** over the device's link (latency + bytes × 8 / bandwidth of the bytes
   actually received), then lets the device **drop out** if its availability coin says so;
3. **trains** with the strategy's client half and emulates **compute** time (task FLOPs / device
   FLOP/s);
4. emulates the **upload** of the encoded update and publishes it — or, when the round keeps only the
   first finishers, reports ``ready`` and waits for the server's ``go``, with the encoded update
   written to the host's state directory (``<state_dir>/held``) rather than kept in memory. Where
   the strategy knows the update's size and cost from the task (``update_before_training``: FedAvg)
   and time is virtual, ``ready`` goes out *before* training, and only the devices the ``go`` keeps
   train: the finish times, bytes and global model are the same, the surplus training is not done.

Time is ``virtual`` (durations computed and carried in the update; nothing sleeps) or ``real`` (the
client sleeps them, divided by the time factor). A task is acked only after its outcome is published,
so a client killed mid-training loses nothing but time: its tasks wait in its durable queue.

Real mode serialises the devices of one process (one task at a time); run more client processes to
emulate many devices concurrently.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.client.spool import Slot, Spool
from services.common import (
    ANSWERS_BUNDLE,
    UPDATES_BUNDLE,
    MessageHandler,
    ServiceBase,
    decode_tensors,
    encode_tensors,
)
from shared import metrics
from shared.algorithms.base import DeviceContext, DeviceData, TaskSpec, UpdateSpec, derive_seed
from shared.algorithms.device_state import atomic_write_bytes
from shared.codec import tensorset
from shared.devices import (
    Device,
    LazyFleet,
    admit,
    dropout_point,
    emulate_compute,
    emulate_transfer,
    transfer_seconds,
)
from shared.experiment import Experiment, HostedData
from shared.schemas import (
    MAX_ANSWERS,
    DeviceState,
    Envelope,
    EvalResult,
    Fetch,
    Go,
    Gos,
    Heartbeat,
    Kind,
    Lease,
    MetricKey,
    Payload,
    Ready,
    Reject,
    Task,
    Tasks,
    Timings,
    Update,
    device_bytes,
    device_size,
    encode,
    pack_body,
)
from shared.transport import (
    KEY_CLIENTS,
    KEY_SERVER,
    KEY_UPDATE,
    Delivery,
    Departed,
    Transport,
    Unroutable,
    key_host,
    split,
)

#: the longest a queued answer (``ready``, ``reject``, ``eval_result``) waits for the turn's other
#: answers before the outbox is flushed (``Client.outbox_full``)
ANSWERS_WAIT_S = 0.5
#: a host flushes its queued uploads once they hold this many bytes, number this many, or the
#: oldest has waited this long (``Client.outbox_full``)
UPLOAD_FLUSH_BYTES = 4 << 20
UPLOAD_FLUSH_COUNT = 64
UPLOAD_WAIT_S = 0.2


def per_device_bytes(exp: Experiment) -> int:
    """Memory one hosted device may keep resident: its share of the training data. An upper bound:
    a host keeps only the device's id (``HostedData``) and slices its samples from the shared,
    memory-mapped dataset while its task trains; its state lives on disk. Kept at the data share so
    that the Kubernetes sizing (docs/kubernetes.md, "Sizing") stays what it was."""
    x = exp.train_x
    sample = int(x[0].nbytes) if len(x) else 0
    return max(1, sample * -(-len(x) // exp.cfg.num_devices))


@dataclass
class _Held:
    """A trained update waiting for the server's ``go`` (first-finishers rounds).

    Only where its encoded message is: with over-selection a host may hold hundreds of updates until
    the round's ``go`` (issue 16: ~325 of ~437 KB each per host at 10,000 devices, ~142 MB), and
    memory, not disk, is what a constrained host lacks. The bytes are written once and read once,
    unchanged (``services/client/spool.py``), so what goes on the wire is exactly what would have
    been sent from memory.
    """

    slot: Slot
    dense_bytes: int
    upload_s: float
    device: Device


@dataclass(frozen=True)
class _Received:
    """A task as its device received it: what training, ``ready``, encoding and the upload all need
    of it (one record instead of the same five arguments on every step)."""

    env: Envelope
    msg: Task
    device: Device
    #: what the emulated device downloaded: the task and its payload, as one message
    task_bytes: int
    #: the download's emulated seconds
    down_s: float


@dataclass
class _Deferred:
    """A task whose device reported ``ready`` before training, because its finish time follows from
    the task (``Strategy.update_before_training``); it trains only if the server's ``go`` keeps it.

    Why: with over-selection 1.3 a quarter of the invited devices train for an update the server
    then discards (issue 16: 300 of 1,300 per round at 10,000 devices). Only the task is kept, not
    the device's data (sliced from the mapped dataset when the ``go`` comes, as for any training);
    ``up_s`` and ``size`` are what ``ready`` reported, and the update is checked against them.
    """

    got: _Received
    task: TaskSpec
    compute_s: float
    flops: int
    up_s: float
    size: int


@dataclass
class _Encoded:
    """An update as it goes on the wire, and what the device's link is charged for it."""

    data: bytes
    dense_bytes: int
    #: the bytes the emulated device uploads (the message without its telemetry)
    size: int
    upload_s: float


class Client(ServiceBase):
    service = "client"

    def __init__(
        self,
        transport: Transport,
        exp: Experiment,
        *,
        experiment_id: str,
        client_id: str,
        state_dir: Path,
        pinned: list[int] | None = None,
        max_devices: int | None = None,
        memory_bytes: int | None = None,
        prefetch: int | None = None,
        on_stop: str = "exit",
        bundle: bool = True,
    ) -> None:
        cfg = exp.cfg
        super().__init__(transport, experiment_id, cfg.algorithm.name, cfg.processes.max_message_bytes)
        bad = [d for d in pinned or () if not 0 <= d < cfg.num_devices]
        if bad:
            raise ValueError(f"devices {bad[:5]} are outside the fleet of {cfg.num_devices} devices")
        self.exp = exp
        self.strategy = exp.strategy
        self.client_id = client_id
        self.pinned = sorted(pinned) if pinned is not None else None
        self.capacity = max_devices
        self.memory_bytes = memory_bytes
        self.state_dir = state_dir
        self.emulation = cfg.emulation
        self.hosts_cfg = cfg.hosts
        self.on_stop_mode = on_stop
        self.fleet = exp.fleet  # indexed by device id; profiles made on demand (shared.devices.LazyFleet)
        #: first-finishers protocol: when on, devices report ``ready`` and upload only on ``go``
        self.ready_protocol = cfg.emulation.over_selection > 1 or cfg.emulation.round_deadline_s is not None
        # a flush's ``ready``/``reject``/``eval_result`` go as one ``answers``, its updates as one
        # ``updates`` (virtual time only: in real time each update is published when its upload ends);
        # ``bundle=False`` (``FEDFLEET_BUNDLE``) sends each alone, for readers older than those kinds
        self.bundling = (ANSWERS_BUNDLE, UPDATES_BUNDLE) if bundle else ()
        self.held: dict[tuple[str, int, int], _Held] = {}
        #: first-finishers tasks answered ``ready`` before training (see ``_Deferred``), same keys
        self.deferred: dict[tuple[str, int, int], _Deferred] = {}
        #: (a round task's tensors, (their layout digest, names), the bytes they add to an update's body)
        self._tensor_size: tuple[tuple[Any, ...], tuple[bytes | None, tuple[str, ...]], int] | None = None
        #: where held updates' bytes wait, appended to a round's files. Emptied at start: a restarted host
        #: has forgotten which tasks they answered (as it did when they lived in memory), so the
        #: server's ``go`` for one finds nothing and that device's update is not sent — never twice.
        self.spool = Spool(state_dir / "held")
        #: (server incarnation, round) of the last ``go``: held updates of other rounds and server
        #: starts were discarded when it changed
        self._go_stamp: tuple[str, int] = ("", -1)
        #: the newest round's payloads, decoded (digest → tensors), and tasks waiting for one
        self.payloads: dict[bytes, dict[str, Any]] = {}
        #: payload digest → the digest of its tensors' layout (an update shaped like its task's
        #: payload names the layout by digest: the aggregators were told it with the round)
        self.payload_layouts: dict[bytes, bytes] = {}
        self.payload_round: tuple[str, int] = ("", -1)
        self.waiting: dict[bytes, list[tuple[Envelope, Task, Delivery]]] = {}
        #: the devices of the newest lease applied, with their local data (only their ids are held:
        #: the data is sliced from the memory-mapped dataset when a task needs it)
        self.data = HostedData(exp)
        #: (server incarnation, epoch) of that lease
        self.lease_inc, self.epoch = "", -1
        self.leaving = False
        self.idle = False
        self.transport_closed = False
        self.last_heartbeat = 0.0
        self.queue = transport.names.client_queue(client_id)
        # the queue outlives a crashed host only briefly; a live one consumes it all along
        expires = max(60.0, 6 * cfg.hosts.lease_timeout_s)
        transport.declare_queue(self.queue, [KEY_CLIENTS, key_host(client_id)], expires_s=expires)
        handlers: dict[Kind, MessageHandler] = {
            Kind.LEASE: self.on_lease,
            Kind.DEVICE_STATE: self.on_device_state,
            Kind.PAYLOAD: self.on_payload,
            Kind.TASK: self.on_task,
            Kind.TASKS: self.on_tasks,
            Kind.GO: self._go,  # the server sends ``gos``; a lone ``go`` is read as one of its entries
            Kind.GOS: self.on_gos,
            Kind.EVALUATE: self.on_evaluate,
            Kind.STOP: self.on_stop,
        }
        transport.consume(
            self.queue,
            lambda d: self.dispatch(d, handlers),
            prefetch=cfg.processes.client_prefetch if prefetch is None else prefetch,
        )
        self.heartbeat()
        self.log.info(
            "client host %s ready (capacity %s, memory %s, pinned %s)",
            client_id,
            max_devices,
            memory_bytes,
            self.pinned,
            extra={"event": "client_ready"},
        )

    @property
    def device_ids(self) -> list[int]:
        return sorted(self.data)

    def _create_series(self, device: Device) -> None:
        """The device's budget gauge, and its tier's histogram series before their first observation
        (a short run could otherwise end between two scrapes with nothing for rate() to work on)."""
        metrics.MEMORY_BUDGET_BYTES.labels(self.experiment, device.tier).set(device.profile.memory_bytes)
        labels = (self.experiment, self.algorithm, device.tier)
        metrics.CLIENT_TRAIN_SECONDS.labels(*labels)
        clocks = ("virtual", "real") if self.emulation.time_mode == "real" else ("virtual",)
        for clock in clocks:
            metrics.CLIENT_COMPUTE_SECONDS.labels(*labels, clock)
            for direction in ("down", "up"):
                metrics.CLIENT_TRANSFER_SECONDS.labels(*labels, direction, clock)

    # -- the host: heartbeats, leases, device state ------------------------------------------------
    def heartbeat(self) -> None:
        """Tell the server what this host can do and holds (the first one is its join).

        Clients may not declare the server's queue (least privilege on the broker), so before the
        server exists a heartbeat is unroutable: that is expected, and retried at the next tick.
        """
        self.last_heartbeat = time.time()
        beat = Heartbeat(
            host_id=self.client_id,
            capacity=self.capacity,
            memory_bytes=self.memory_bytes,
            pinned=self.pinned,
            holding=self.device_ids,
            epoch=self.epoch,
            leaving=self.leaving,
        )
        try:
            self.send(KEY_SERVER, Kind.HEARTBEAT, beat, round=0, inc=self.lease_inc, sender=self.client_id)
        except Unroutable:
            self.log.info("no server yet", extra={"event": "heartbeat_unroutable"})
        except Departed:  # the last heartbeat of a leave may be what the server deleted the user for
            self._departed()

    def tick(self) -> None:
        """The heartbeat when one is due (also right after ``terminate``, which only asks for it)."""
        if not self.idle and time.time() - self.last_heartbeat >= self.hosts_cfg.heartbeat_s:
            self.heartbeat()

    def run(self, poll_s: float = 0.05) -> None:
        while not self.stopped:
            if self.idle:  # after the run (``on_stop: idle``): no connection, nothing to do
                if not self.transport_closed:
                    self.transport.close()
                    self.transport_closed = True
                time.sleep(max(poll_s, 0.5))
                continue
            try:
                self.turn(poll_s)
            except Departed:
                self._departed()

    def _departed(self) -> None:
        """The transport ended after ``_wind_down``: the expected end of a leave. The transport winds
        down only once every device is handed back; should a lease have given it devices since, this
        is no clean leave, and ``Departed`` (a ``BrokerUnavailable``) ends it with one line, exit 3."""
        if self.data:
            raise Departed(f"host {self.client_id} lost its connection holding {len(self.data)} devices")
        self._left("the connection ended after every device was handed back")

    def terminate(self) -> None:
        """SIGTERM: ask the server to take the devices back; exit once it has (a second SIGTERM, or
        the server not answering within ``hosts.lease_timeout_s``, stops at once)."""
        if self.leaving or self.idle:
            self.stopped = True
            return
        self.leaving = True
        self.log.info("leaving: handing the devices back", extra={"event": "host_leaving"})
        if not self.data:  # nothing to hand back: the server may forget this host at once
            self._wind_down()
        # The heartbeat that says so goes from the loop's next tick (within a poll or a task), not
        # from here: this runs in a signal handler, which may have interrupted a publish between
        # its frames — a second publish then interleaves with it and the broker closes the
        # connection (505 UNEXPECTED_FRAME, seen in CI on a scale-down).
        self.last_heartbeat = 0.0

    def _wind_down(self) -> None:
        """Leaving with every device handed back, the host has nothing more to do on the broker, and
        the server is about to delete its broker user and queue (the broker then closes the host's
        connection, perhaps before the host's last ack or the confirm of its last heartbeat). The
        transport is told, so that the loss of the connection ends the host (exit 0) instead of a
        reconnect loop as a deleted user."""
        self.transport.winding_down()

    def _left(self, why: str) -> None:
        """The clean end of a leave: one ``host_left`` line, then the run loop ends."""
        if not self.stopped:
            self.log.info("left: %s", why, extra={"event": "host_left"})
        self.stopped = True

    def on_lease(self, env: Envelope, msg: Lease, d: Delivery) -> None:
        if msg.host_id != self.client_id:
            self.reject(d, "misaddressed", f"lease for {msg.host_id} reached {self.client_id}")
            return
        newer = env.inc != self.lease_inc or msg.epoch > self.epoch
        if newer:
            self._apply_lease(set(msg.devices))
            self.lease_inc, self.epoch = env.inc, msg.epoch
        done = self.leaving and not self.data
        if done:
            # before the ack and the heartbeat: the server may delete this host's user as soon as
            # the heartbeat reaches it, before the broker's confirm of it reaches this host
            self._wind_down()
        d.ack()
        self.heartbeat()  # the acknowledgement: the server opens the next round once every host has
        if done:
            self._left("every device handed back")

    def _apply_lease(self, devices: set[int]) -> None:
        """Serve exactly ``devices``: load the new ones' data, forget the others (their state is already
        with the server). Their tasks come to this host's own key, whichever devices it serves."""
        unknown = sorted(dev for dev in devices if not 0 <= dev < len(self.fleet))
        if unknown:
            raise ValueError(f"lease names devices outside the fleet: {unknown[:5]}")
        for dev in sorted(set(self.data) - devices):
            del self.data[dev]
            shutil.rmtree(self._device_dir(dev), ignore_errors=True)
        fleet = self.fleet
        for dev in sorted(devices - set(self.data)):
            self.data.add(dev)
            # made, not cached: the profiles a round's tasks need stay in the fleet's cache
            self._create_series(fleet.make(dev) if isinstance(fleet, LazyFleet) else fleet[dev])
        self.log.info(
            "serving %d devices (lease %d)", len(self.data), self.epoch + 1, extra={"event": "lease_applied"}
        )

    def on_device_state(self, env: Envelope, msg: DeviceState, d: Delivery) -> None:
        """A device's stored state, ahead of the lease that hands it the device: replaces its files."""
        target = self._device_dir(msg.device_id)
        shutil.rmtree(target, ignore_errors=True)
        for name, data in msg.files.items():
            atomic_write_bytes(target / name, data)
        d.ack()

    def _sync_state(self, dev: int) -> None:
        """Send the device's files to the server (after every task it trains): whatever happens to
        this host afterwards, the device continues from here."""
        target = self._device_dir(dev)
        if not target.is_dir():
            return
        files = {p.name: p.read_bytes() for p in sorted(target.iterdir()) if p.is_file()}
        files = {k: v for k, v in files.items() if not k.endswith(".tmp")}
        if files:
            state = DeviceState(device_id=dev, files=files)
            self.send(KEY_SERVER, Kind.DEVICE_STATE, state, round=0, sender=self.client_id)

    def _device_dir(self, dev: int) -> Path:
        return self.state_dir / f"device-{dev}"

    def on_stop(self, env: Envelope, msg: Any, d: Delivery) -> None:
        d.ack()
        self._discard_held(lambda key: True)  # the run is over: no ``go`` will come for them
        if self.on_stop_mode == "idle" and not self.leaving:
            # a Kubernetes pod must not exit when the run ends (its controller would restart it):
            # it stays up, serving /metrics, doing nothing more — without a broker connection (its
            # broker user is deleted once the run is over)
            self.data.clear()
            self.idle = True
            self.log.info("the experiment is over; idle", extra={"event": "client_idle"})
        else:  # a host already told to leave (SIGTERM) goes: idling would outlive its pod's grace period
            self.stopped = True

    def _notify(
        self, env: Envelope, msg: Task, body: Reject | Ready | EvalResult, kind: Kind, d: Delivery
    ) -> None:
        """A device's answer to its task ``d``, MAC'd with the task's key (only that task carried it).

        In virtual time it goes out with the turn's other answers (``publish_soon``), and the flush
        acks ``d``; in real time at once, when the device answers (its timing is the point)."""
        # no sender name: the device id is in the body, and a device's bytes are counted
        key = msg.key.hex()
        data = encode(kind, body, exp=self.experiment, round=env.round, sender="", inc=env.inc, key=key)
        if self.emulation.time_mode == "real":
            self.publish_raw(KEY_SERVER, kind, data)
        else:
            self.publish_soon(KEY_SERVER, kind, data, answers=d)

    def _observe(self, metric: Any, tier: str, seconds: float, real_s: float | None, **labels: str) -> None:
        metric.labels(self.experiment, self.algorithm, tier, *labels.values(), "virtual").observe(seconds)
        if real_s is not None:
            metric.labels(self.experiment, self.algorithm, tier, *labels.values(), "real").observe(real_s)

    def on_payload(self, env: Envelope, msg: Payload, d: Delivery) -> None:
        """What several of the round's tasks share, decoded once for all of them. Only the newest
        round's payloads are kept; tasks that arrived before their payload (a fetch) go now."""
        stamp = (env.inc, env.round)
        if stamp != self.payload_round:
            self.payloads.clear()
            self.payload_layouts.clear()
            self.payload_round = stamp
        self.payloads[msg.digest] = decode_tensors(msg.tensors)
        if env.layouts:
            self.payload_layouts[msg.digest] = tensorset.digest(env.layouts[0])
        d.ack()
        for env_, task, delivery in self.waiting.pop(msg.digest, []):
            # through ``on_task``: a device whose lease moved to another host while its task waited
            # is no longer this host's to train (dead-lettered ``unknown-device``, as a task that
            # arrives after the move is)
            self.on_task(env_, task, delivery)

    def _tensors(self, env: Envelope, msg: Task, d: Delivery) -> dict[str, Any] | None:
        """The task's tensors: its own plus its payload's (None: the payload is missing — fetched,
        and the task goes on when it arrives)."""
        own = decode_tensors(msg.tensors)
        if not msg.payload:
            return own
        shared = self.payloads.get(msg.payload)
        if shared is None:
            first = msg.payload not in self.waiting
            self.waiting.setdefault(msg.payload, []).append((env, msg, d))
            if first:
                self.log.info("payload %s missing; fetching it", msg.payload.hex(), extra={"event": "fetch"})
                self.send(KEY_SERVER, Kind.FETCH, Fetch(digest=msg.payload), round=env.round, inc=env.inc)
            return None
        return {**shared, **own}

    def on_task(self, env: Envelope, msg: Task, d: Delivery) -> None:
        """Admit, download, (maybe drop out,) train and upload — each step below is one method."""
        if msg.device_id not in self.data:
            self.reject(d, "unknown-device", f"device {msg.device_id} is not hosted by {self.client_id}")
            return
        self._dispatch_task(env, msg, d)

    def outbox_full(self) -> bool:
        """Flush once the queued uploads hold :data:`UPLOAD_FLUSH_BYTES`, number
        :data:`UPLOAD_FLUSH_COUNT` or the oldest has waited :data:`UPLOAD_WAIT_S` (so the
        aggregators get to work while the turn trains on, and what a host holds is bounded), a full
        ``answers`` of other messages waits, or the oldest message has waited :data:`ANSWERS_WAIT_S`.

        Why bytes and time, not a count: every flush is a broker transaction (a round trip, and CPU
        in the host, the broker and each aggregator that wakes for it), and 8 uploads a flush, the
        rule before, made four a host and round at 50 small devices a round whose training takes
        ~20 ms a host. Flushing by bytes and age, a small round goes in one transaction, while a
        host of large updates (the 440 KB phones of ``experiments/fleet_2000.yaml``) or slow
        training still flushes every ~10 updates or 0.2 s. Three paired runs of
        ``benchmarks/bench_rounds.py --sizes 50 --rounds 60 --transports amqp`` on a 2-core VM
        (2026-12-02): CPU per round 92-104 ms against 98-113 ms with 8 a flush (the aggregator's
        15-17 against 18-21, the broker's 10-12 against 12-16); median rounds 0.054-0.059 s
        against 0.053-0.063 s, within the VM's drift.

        Why not 8 answers, as other services flush: in a first-finishers round a host answers
        ``ready`` for every device of its ``tasks`` before training any (``_defer``, FedAvg), and 8
        at a time made ~40 ``answers`` and broker commits a host and round at 10,000 devices
        instead of one. Why a time bound: an algorithm that must train before it knows its finish
        time queues each ``ready`` after a training, and the server decides at its deadline with
        the readies it has: they must not wait for the end of a long turn."""
        clock = time.monotonic()
        uploads = self._uploads >= UPLOAD_FLUSH_COUNT or self._upload_bytes >= UPLOAD_FLUSH_BYTES
        aged = self.uploads_since is not None and clock - self.uploads_since >= UPLOAD_WAIT_S
        waited = self.outbox_since is not None and clock - self.outbox_since >= ANSWERS_WAIT_S
        return uploads or aged or waited or len(self.outbox) >= MAX_ANSWERS

    def on_tasks(self, env: Envelope, msg: Tasks, d: Delivery) -> None:
        """Every task of the message, in its order, as a lone ``task`` would be: each has a delivery
        of its own (``split``) whose body is that lone message, so its device is charged the same
        bytes, and an entry that fails (a device this host does not serve, a handler error) is
        dead-lettered alone while the others go on. The message is acked once every entry is
        settled, so a crash before then redelivers all of it."""
        self._each(env, Kind.TASK, msg.tasks, d, self.on_task)

    def _each(
        self, env: Envelope, kind: Kind, entries: Sequence[Any], d: Delivery, handler: MessageHandler
    ) -> None:
        """``handler`` on each entry of a message that carries several, as on the lone ``kind``
        message the entry stands for: with that message's envelope, and a delivery of its own whose
        body is that message (``split``: what its device is charged, what its dead letter holds).
        What one entry's handling raises dead-letters that entry alone (``handle``)."""
        lone = env.model_copy(update={"kind": kind})
        exp, rnd, sender, inc, v = self.experiment, env.round, env.sender, env.inc, env.v
        bodies = [encode(kind, e, exp=exp, round=rnd, sender=sender, inc=inc, version=v) for e in entries]
        for entry, part in zip(entries, split(d, bodies), strict=True):
            self.handle(handler, lone, entry, part)

    def _dispatch_task(self, env: Envelope, msg: Task, d: Delivery) -> None:
        if env.kind is Kind.EVALUATE:
            self._evaluate(env, msg, d)
            return
        tensors = self._tensors(env, msg, d)
        if tensors is None:
            return
        dev = msg.device_id
        device = self.fleet[dev]
        task = TaskSpec(tensors, dict(msg.config))
        # what the emulated device downloads: its task and the payload, as one message
        task_bytes = len(d.body) + msg.payload_bytes
        if self._admitted(env, msg, task, device, task_bytes, d):
            got = _Received(env, msg, device, task_bytes, self._download(task, device, task_bytes))
            if not self._dropped_out(env, msg, device, task_bytes, d) and not self._defer(got, task, d):
                update, compute_s = self._train(env, task, device)
                self._sync_state(dev)  # before the update: the server has it before the round ends
                self._deliver(got, update, compute_s, d)
        self.ack_unless_queued(d)  # an answer waiting for the flush acks it once published
        # a turn may train many tasks (``processes.client_prefetch``): the heartbeat must not wait
        # for its end, or a host busy with slow tasks would lose its lease
        self.tick()

    def _admitted(
        self, env: Envelope, msg: Task, task: TaskSpec, device: Device, task_bytes: int, d: Delivery
    ) -> bool:
        """Memory admission: nothing ever trains over budget. A refused task is reported, never skipped."""
        dev, tier = device.device_id, device.tier
        extra = self.strategy.task_extra_peak(task, len(self.data[dev].y_train))
        verdict = admit(
            self.strategy.task_footprint(task), device.profile.memory_bytes, tier=tier, extra=extra
        )
        metrics.MEMORY_FOOTPRINT_BYTES.labels(self.experiment, self.algorithm, tier).set(
            verdict.footprint_bytes
        )
        if verdict.admitted:
            return True
        self.log.info(verdict.detail, extra={"event": "reject", "device": dev, "reason": verdict.reason})
        refusal = Reject(
            device_id=dev,
            reason=verdict.reason,
            detail=verdict.detail,
            footprint_bytes=verdict.footprint_bytes,
            budget_bytes=verdict.budget_bytes,
            task_bytes=task_bytes,
        )
        self._notify(env, msg, refusal, Kind.REJECT, d)
        return False

    def _download(self, task: TaskSpec, device: Device, task_bytes: int) -> float:
        """Emulate the task's download over the device's link; returns its emulated seconds."""
        mode, factor = self.emulation.time_mode, self.emulation.time_factor
        t0 = time.perf_counter()
        messages = self.strategy.task_download_messages(task)
        down_s = emulate_transfer(
            task_bytes, device.profile, "down", mode=mode, time_factor=factor, messages=messages
        )
        real_s = time.perf_counter() - t0 if mode == "real" else None
        self._observe(metrics.CLIENT_TRANSFER_SECONDS, device.tier, down_s, real_s, direction="down")
        return down_s

    def _dropped_out(self, env: Envelope, msg: Task, device: Device, task_bytes: int, d: Delivery) -> bool:
        """The device's availability coin for this round: True if it vanishes after the download."""
        dev = device.device_id
        if dropout_point(device, env.round, self.exp.cfg.seed) is None:
            return False
        self.log.info("device %d dropped out", dev, extra={"event": "dropout", "device": dev})
        if self.emulation.time_mode != "real":
            # In virtual time the server's deadline would pass at no cost; tell it now instead of
            # making it wait in wall time. In real mode the device just goes silent.
            notice = Reject(device_id=dev, reason="dropout", task_bytes=task_bytes)
            self._notify(env, msg, notice, Kind.REJECT, d)
        return True

    def _defer(self, got: _Received, task: TaskSpec, d: Delivery) -> bool:
        """In a first-finishers round in virtual time, report ``ready`` before training when the
        strategy knows the update's size and cost from the task; True if it did (``_Deferred``).

        The finish time is what training would have given: compute from ``task_flops`` (the FLOPs
        ``_train`` charges when the strategy reports none), upload from the size of an update of the
        task's shapes. Real time trains first: there the training's own duration is part of the
        device's time."""
        if not self.ready_protocol or self.emulation.time_mode == "real":
            return False
        env, msg, device = got.env, got.msg, got.device
        dev = device.device_id
        samples = self.exp.train_samples(dev)
        template = self.strategy.update_before_training(task, samples)
        if template is None:
            return False
        flops = self.strategy.task_flops(task, samples)
        compute_s = emulate_compute(flops, device.profile, mode="virtual")
        self._observe(metrics.CLIENT_COMPUTE_SECONDS, device.tier, compute_s, None)
        if msg.key:
            size = self._predicted_size(env, msg, template)
            up_s = transfer_seconds(size, device.profile.uplink_bps, device.profile.latency_s)
        else:  # keyless (no sender checks): no MAC, so ``device_size`` does not apply; measure an encoding
            sized = self._encode_update(got, template, compute_s, body=False)
            size, up_s = sized.size, sized.upload_s
        slot = (env.inc, env.round, dev)
        self._forget(slot)  # a redelivered task's earlier answer: replaced
        self.deferred[slot] = _Deferred(got, task, compute_s, flops, up_s, size)
        ready = Ready(device_id=dev, finish_s=got.down_s + compute_s + up_s, update_bytes=size)
        self._notify(env, msg, ready, Kind.READY, d)
        return True

    def _predicted_size(self, env: Envelope, msg: Task, template: UpdateSpec) -> int:
        """What the device will upload for ``template``'s update (``device_size``), without packing
        its tensors for every device.

        Why: packing a 438 KB model to learn its size cost as much as the training deferral saves.
        An update's counted body is a list of fields (device id, samples, tensor set; the rest is
        telemetry) followed by the tensor set's blob, so its length is the length without tensors
        plus what the tensors add; that part is computed once for the tensors of a round's task (the
        same objects for all its devices, kept referenced so that their ids cannot be reused), their
        names and layout. ``_train_deferred`` compares the real update's size with this one."""
        layout = self.payload_layouts.get(msg.payload)
        known = {layout: self.layouts[layout]} if layout is not None and layout in self.layouts else None
        tensors = tuple(template.tensors.values())
        names = tuple(template.tensors)
        cached = self._tensor_size
        if (
            cached is None
            or cached[1] != (layout, names)
            or len(cached[0]) != len(tensors)
            or any(a is not b for a, b in zip(cached[0], tensors, strict=True))
        ):
            full = Update(device_id=0, num_samples=0, tensors=encode_tensors(template.tensors)[0])
            empty = Update(device_id=0, num_samples=0)
            added = len(pack_body(Kind.UPDATE, full, known=known)) - len(pack_body(Kind.UPDATE, empty))
            cached = self._tensor_size = (tensors, (layout, names), added)
        bare = Update(device_id=msg.device_id, num_samples=template.num_samples)
        packed = len(pack_body(Kind.UPDATE, bare)) + cached[2]
        return device_size(Kind.UPDATE, packed, exp=self.experiment, round=env.round, sender="", inc=env.inc)

    def _train_deferred(self, job: _Deferred, d: Delivery) -> None:
        """The ``go`` kept a deferred device: train it now and upload, as ``ready`` announced."""
        got = job.got
        dev, tier = got.device.device_id, got.device.tier
        # the device's data as any training takes it; leases change between rounds, but a device
        # that is no longer served here still trains what its ``ready`` promised
        data = self.data[dev] if dev in self.data else self.exp.device_data(dev)
        started = time.perf_counter()
        update = self.strategy.train(job.task, self._context(dev, got.env.round, data))
        metrics.CLIENT_TRAIN_SECONDS.labels(self.experiment, self.algorithm, tier).observe(
            time.perf_counter() - started
        )
        reported = update.metrics.get(MetricKey.TRAIN_FLOPS)
        if reported is not None and int(reported) != job.flops:  # the same contract as the size
            self.log.error(
                "device %d reports %d training FLOPs, %d charged in ready (%s.update_before_training "
                "requires train to report none)",
                dev,
                int(reported),
                job.flops,
                type(self.strategy).__name__,
                extra={"event": "ready_flops_mismatch", "device": dev},
            )
        update.metrics = self._finite_metrics(
            dev, {**update.metrics, MetricKey.TRAIN_FLOPS: float(job.flops)}
        )
        self._sync_state(dev)
        enc = self._encode_update(got, update, job.compute_s, upload_s=job.up_s)
        if enc.size != job.size:  # the strategy's update_before_training does not describe its train
            self.log.error(
                "device %d uploads %d bytes, %d announced in ready (%s.update_before_training is wrong)",
                dev,
                enc.size,
                job.size,
                type(self.strategy).__name__,
                extra={"event": "ready_size_mismatch", "device": dev},
            )
        self._upload(enc.data, enc.dense_bytes, got.device, job.up_s, d)

    def _train(self, env: Envelope, task: TaskSpec, device: Device) -> tuple[UpdateSpec, float]:
        """Train with the strategy's client half; returns the update and the emulated compute seconds
        of its FLOPs (the update's ``train_flops`` metric is set to them)."""
        dev, tier = device.device_id, device.tier
        mode, factor = self.emulation.time_mode, self.emulation.time_factor
        started = time.perf_counter()
        update = self.strategy.train(task, self._context(dev, env.round))
        trained_s = time.perf_counter() - started
        metrics.CLIENT_TRAIN_SECONDS.labels(self.experiment, self.algorithm, tier).observe(trained_s)
        # a strategy whose cost depends on what training produced (e.g. the density SpaFL reached)
        # reports it; otherwise the accountant's count of the task
        reported = update.metrics.get(MetricKey.TRAIN_FLOPS)
        flops = int(reported) if reported else self.strategy.task_flops(task, self.exp.train_samples(dev))
        compute_s = emulate_compute(
            flops, device.profile, mode=mode, time_factor=factor, measured_s=trained_s
        )
        real_s = time.perf_counter() - started if mode == "real" else None
        self._observe(metrics.CLIENT_COMPUTE_SECONDS, tier, compute_s, real_s)
        update.metrics = self._finite_metrics(dev, {**update.metrics, MetricKey.TRAIN_FLOPS: float(flops)})
        return update, compute_s

    def _finite_metrics(self, dev: int, reported: dict[str, float]) -> dict[str, float]:
        """Drop non-finite numbers a strategy reported (a diverged loss): the wire schema refuses them,
        and losing the whole update over a diagnostic would stall the round."""
        bad = sorted(k for k, v in reported.items() if not math.isfinite(v))
        if bad:
            self.log.warning(
                "device %d reported non-finite %s; not sent",
                dev,
                ", ".join(bad),
                extra={"event": "non_finite_metric", "device": dev},
            )
        return {k: v for k, v in reported.items() if k not in bad}

    def _deliver(self, got: _Received, update: UpdateSpec, compute_s: float, d: Delivery) -> None:
        """Encode the update and upload it — or, in first-finishers rounds, hold it and report ``ready``."""
        env, msg, device, down_s = got.env, got.msg, got.device, got.down_s
        dev = device.device_id
        enc = self._encode_update(got, update, compute_s)
        if self.ready_protocol:
            slot = (env.inc, env.round, dev)
            self._forget(slot)  # a redelivered task's earlier answer: replaced
            self.held[slot] = _Held(self.spool.put(slot[:2], enc.data), enc.dense_bytes, enc.upload_s, device)
            ready = Ready(device_id=dev, finish_s=down_s + compute_s + enc.upload_s, update_bytes=enc.size)
            self._notify(env, msg, ready, Kind.READY, d)
        else:
            self._upload(enc.data, enc.dense_bytes, device, enc.upload_s, d)

    def _encode_update(
        self,
        got: _Received,
        update: UpdateSpec,
        compute_s: float,
        *,
        upload_s: float | None = None,
        body: bool = True,
    ) -> _Encoded:
        """The update's message and the device's upload of it (``upload_s``: the upload's emulated
        seconds when already known, else from the size); ``body=False``: only the size and seconds."""
        env, msg, device, task_bytes, down_s = got.env, got.msg, got.device, got.task_bytes, got.down_s
        dev = device.device_id
        tensors, dense = encode_tensors(update.tensors)

        def update_msg(up_s: float) -> Update:
            return Update(
                device_id=dev,
                num_samples=update.num_samples,
                tensors=tensors,
                metrics=update.metrics,
                task_bytes=task_bytes,
                timings=Timings(download_s=down_s, compute_s=compute_s, upload_s=up_s),
            )

        layout = self.payload_layouts.get(msg.payload)
        known = {layout: self.layouts[layout]} if layout is not None and layout in self.layouts else None
        # what the device uploads is the message without its telemetry (metrics and timings are the
        # emulator's, not the device's): its size is known from the packed body, before the upload's
        # duration is (telemetry, changing only that), so the message is encoded and MAC'd once
        exp, rnd, inc = self.experiment, env.round, env.inc
        packed = pack_body(Kind.UPDATE, update_msg(0.0), known=known)
        key = msg.key.hex()

        def encoded(upd: Update) -> bytes:
            return encode(
                Kind.UPDATE, upd, exp=exp, round=rnd, sender="", inc=inc, key=key, known=known, packed=packed
            )

        if key:
            size = device_size(Kind.UPDATE, packed, exp=exp, round=rnd, sender="", inc=inc)
        else:  # a task without a key (no sender checks): no MAC to save, the size of an encoding
            size = device_bytes(encoded(update_msg(0.0)))
        if upload_s is None:
            upload_s = transfer_seconds(size, device.profile.uplink_bps, device.profile.latency_s)
        return _Encoded(encoded(update_msg(upload_s)) if body else b"", dense, size, upload_s)

    def _forget(self, slot: tuple[str, int, int]) -> None:
        """Drop whatever answer waits for ``slot``'s ``go`` (a held update or a deferred task)."""
        earlier = self.held.pop(slot, None)
        if earlier is not None:
            self.spool.drop(earlier.slot)
        self.deferred.pop(slot, None)

    def _upload(self, data: bytes, dense: int, device: Device, up_s: float, d: Delivery) -> None:
        """Publish an update, the answer to ``d`` (a task, or the ``go`` of a held or deferred one).

        Why two ways: in real time the upload is paced as the device's link would take it, and
        published when that time is over, one by one. In virtual time nothing waits, so the
        uploads of one turn of the loop go out together (one broker commit, not a confirm each);
        ``d``, the task, is acked after that, so a crash in between redelivers the task."""
        if self.emulation.time_mode != "real":
            self.publish_soon(KEY_UPDATE, Kind.UPDATE, data, dense_bytes=dense, answers=d)
            self._observe(metrics.CLIENT_TRANSFER_SECONDS, device.tier, up_s, None, direction="up")
            return
        t0 = time.perf_counter()
        emulate_transfer(
            device_bytes(data), device.profile, "up", mode="real", time_factor=self.emulation.time_factor
        )
        self.publish_raw(KEY_UPDATE, Kind.UPDATE, data, dense_bytes=dense)
        self._observe(
            metrics.CLIENT_TRANSFER_SECONDS, device.tier, up_s, time.perf_counter() - t0, direction="up"
        )

    def _context(self, dev: int, round: int, data: DeviceData | None = None) -> DeviceContext:
        return DeviceContext(
            device_id=dev,
            round=round,
            data=self.data[dev] if data is None else data,
            state_dir=self._device_dir(dev),
            seed=derive_seed(self.exp.cfg.seed, "train", round, dev) % (2**32),
            tier=self.fleet[dev].tier,
        )

    def on_evaluate(self, env: Envelope, msg: Task, d: Delivery) -> None:
        if msg.device_id not in self.data:
            self.reject(d, "unknown-device", f"device {msg.device_id} is not hosted by {self.client_id}")
            return
        self._dispatch_task(env, msg, d)

    def _evaluate(self, env: Envelope, msg: Task, d: Delivery) -> None:
        """The all-device evaluation: the personalised model on the device's own test split."""
        tensors = self._tensors(env, msg, d)
        if tensors is None:
            return
        dev = msg.device_id
        task = TaskSpec(tensors, dict(msg.config))
        result = self.strategy.evaluate_device(task, self._context(dev, env.round))
        # a diverged personal model (NaN loss) is still a result: its finite metrics are reported
        metrics = self._finite_metrics(dev, result) if result is not None else {}
        body = EvalResult(device_id=dev, supported=result is not None, metrics=metrics)
        self._notify(env, msg, body, Kind.EVAL_RESULT, d)
        self.ack_unless_queued(d)

    def _discard_held(self, stale: Callable[[tuple[str, int, int]], bool]) -> None:
        for key in [k for k in self.held if stale(k)]:
            self.spool.drop(self.held.pop(key).slot)
        for key in [k for k in self.deferred if stale(k)]:
            del self.deferred[key]

    def on_gos(self, env: Envelope, msg: Gos, d: Delivery) -> None:
        """Every ``go`` of the message, in its order, as a lone one would be, with a delivery of its
        own (``split``, as in ``on_tasks``): an entry whose handling fails is dead-lettered alone
        and the others go on. The message is acked once every upload it asked for is published (a
        crash before that redelivers it, and a restarted host holds nothing it could upload: its
        devices count as dropped)."""
        self._each(env, Kind.GO, msg.goes, d, self._go)
        self.flush()

    def _go(self, env: Envelope, msg: Go, d: Delivery) -> None:
        """Upload (train first, if deferred) or discard one device's update. ``d``: the delivery
        (an entry of a ``gos``, or a lone ``go``) the upload answers, acked once it is published."""
        slot = (env.inc, env.round, msg.device_id)
        held = self.held.pop(slot, None)
        deferred = self.deferred.pop(slot, None)
        if deferred is not None and msg.upload:
            self._train_deferred(deferred, d)
            self.tick()  # a host may train hundreds of kept devices in one turn: keep its lease
        if held is not None:
            if msg.upload:
                self._upload(self.spool.take(held.slot), held.dense_bytes, held.device, held.upload_s, d)
            else:
                self.spool.drop(held.slot)
        # forget anything older than this round (a round can be abandoned by a server restart).
        # Scanned when the round or the server start changes, not per ``go``: a host holds hundreds
        # of updates at 10,000 devices, and a scan per ``go`` made the round's goes quadratic.
        stamp = (env.inc, env.round)
        if stamp != self._go_stamp:
            self._go_stamp = stamp
            self._discard_held(lambda key: key[1] < env.round)
        self.ack_unless_queued(d)
