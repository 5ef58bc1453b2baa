"""A round's tasks as messages: what devices share travels once per host, the rest once per device.

Why: with FedAvg every device's task *is* the global model. Sent inline, 1,300 invited devices
pushed 1,300 copies of it (≈ 570 MB for a 440 KB model) through the broker every round, and every
client process decoded each copy. Here the tensors of a task spec become one
:class:`~shared.schemas.Payload`, content-addressed by a digest, sent once to each host that serves
a device using it (strategies return the same ``TaskSpec`` object for devices that share it:
FedAvg's one model, HeteroFL's one slice per width), ahead of the tasks in the same queue; each task
carries the digest, its config and its key. A host that reads schema version 7 gets its devices'
tasks of the round as one ``tasks`` message (:class:`~shared.schemas.Tasks`), not one each.

The emulation is unchanged: a device is charged the bytes its real counterpart would download — its
task plus the payload, as one message (``Outgoing.device_bytes``) — so budgets, timings and the
communication-cost figures do not depend on how the emulator moves bytes. What crossed the broker is
counted separately, as it is published (``ServiceBase._publish_many``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common import PublishItem, encode_tensors
from shared import codec
from shared.algorithms.base import TaskSpec
from shared.codec import tensorset
from shared.schemas import MAX_TASKS, Kind, Payload, Task, Tasks
from shared.schemas import _Body as Body

#: encode(kind, body) → message bytes (the server's envelope for the current round)
Encode = Callable[[Kind, Body], bytes]


@dataclass
class Outgoing:
    """One device's task message."""

    device: int
    routing_key: str
    data: bytes
    #: what the emulated device downloads: its task plus the payload it refers to
    device_bytes: int
    #: dense-equivalent bytes of every tensor the device receives
    dense_bytes: int
    #: the host whose queue this goes to
    host: str
    #: the task itself (batched with the host's others into a ``tasks`` message, where it reads them)
    body: Task


@dataclass
class Fanout:
    """A round's messages: the payloads (once per host that needs them), then the tasks."""

    payloads: list[tuple[str, str, bytes]] = field(default_factory=list)  # (host, routing key, data)
    tasks: list[Outgoing] = field(default_factory=list)
    #: digest → payload message, to answer a host's ``fetch``
    by_digest: dict[bytes, bytes] = field(default_factory=dict)
    #: the payloads' tensor-set layouts by digest (the round's announcement lists them)
    layouts: dict[bytes, tensorset.Layout] = field(default_factory=dict)


def build(
    kind: Kind,
    specs: dict[int, TaskSpec],
    devices: list[int],
    *,
    host_of: Callable[[int], str],
    route: Callable[[str], str],
    task_key: Callable[[int], str],
    encode: Encode,
) -> Fanout:
    """Encode ``devices``' tasks; the tensors of every spec become a payload, once per host.

    Even a spec only one device uses goes as a payload: the task then carries no tensors, so it
    never needs a layout (a payload carries its layout inline, and the update that answers it can
    name that layout by digest). The emulated device is charged the payload as a device that knows
    its model's architecture would receive it: the tensor set with its layout's digest, not the
    layout (``tensorset.digest_only_size``).
    """
    out = Fanout()
    shared: dict[int, tuple[bytes, int, int]] = {}  # spec id → (digest, device-charged size, dense bytes)
    sent: set[tuple[str, bytes]] = set()
    for dev in devices:
        spec = specs[dev]
        host = host_of(dev)
        if not spec.tensors:
            bare = Task(device_id=dev, config=spec.config, key=bytes.fromhex(task_key(dev)))
            data = encode(kind, bare)
            out.tasks.append(Outgoing(dev, route(host), data, len(data), 0, host, bare))
            continue
        if id(spec) not in shared:
            tensors, dense = encode_tensors(spec.tensors)
            wire = tensorset.to_wire(tensors)
            digest = hashlib.sha256(codec.packb(wire)).digest()[:8]
            out.by_digest[digest] = encode(Kind.PAYLOAD, Payload(digest=digest, tensors=tensors))
            out.layouts.setdefault(tensorset.digest(wire[0]), wire[0])
            shared[id(spec)] = (digest, tensorset.digest_only_size(wire), dense)
        digest, size, dense = shared[id(spec)]
        if (host, digest) not in sent:
            sent.add((host, digest))
            out.payloads.append((host, route(host), out.by_digest[digest]))
        body = Task(
            device_id=dev,
            payload=digest,
            payload_bytes=size,
            config=spec.config,
            key=bytes.fromhex(task_key(dev)),
        )
        data = encode(kind, body)
        out.tasks.append(Outgoing(dev, route(host), data, len(data) + size, dense, host, body))
    return out


def publish(
    fanout: Fanout,
    publish_many: Callable[[list[PublishItem]], set[str]],
    kind: Kind,
    *,
    batched: Callable[[str], bool] = lambda key: False,
    encode: Encode | None = None,
) -> set[str]:
    """Send a fan-out in one ``publish_many``, payloads first (a host's queue then holds each
    before the tasks that need it); returns the routing keys nobody was bound for. On classic
    queues that is one transaction, one broker round trip (several, in order, past
    ``TX_MAX_BYTES``); quorum queues take a confirm per message, in the same order
    (``AmqpTransport.publish_many``).

    Why one: the payloads and the tasks went as two transactions, and the hosts got their tasks
    only after the second commit, which took the server 2–12 ms at 50 devices a round (a timer
    around each commit) while the hosts were already decoding the payloads on the same two cores.
    Measured with prints at a round's open and at a host's ``on_tasks`` (not committed), in four
    paired runs of ``benchmarks/bench_rounds.py --sizes 50 --rounds 40 --transports amqp`` on a
    2-core Intel Xeon VM: the median time from open to a host's tasks fell by 1.4, 0.2, 1.3 and
    1.4 ms (7.6–8.4 ms before, 6.2–7.9 ms after). Within one transaction the broker keeps the order
    of the messages bound for one queue.

    ``batched(routing key)``: does that host read ``tasks``? Its tasks then go as one
    ``tasks`` message per :data:`~shared.schemas.MAX_TASKS`, in the order of ``fanout.tasks``
    (encoded with ``encode``); the others one by one. Evaluation tasks (``kind`` evaluate) always
    go one by one: they are sent once per run.
    """
    items: list[PublishItem] = [PublishItem(Kind.PAYLOAD, key, data) for _, key, data in fanout.payloads]
    singles: list[PublishItem] = []
    by_key: dict[str, list[Outgoing]] = {}
    for t in fanout.tasks:
        if kind is Kind.TASK and encode is not None and batched(t.routing_key):
            by_key.setdefault(t.routing_key, []).append(t)
        else:
            singles.append(PublishItem(kind, t.routing_key, t.data, t.dense_bytes))
    if by_key:
        assert encode is not None
        for key, outs in by_key.items():
            for i in range(0, len(outs), MAX_TASKS):
                chunk = outs[i : i + MAX_TASKS]
                data = encode(Kind.TASKS, Tasks(tasks=[t.body for t in chunk]))
                items.append(PublishItem(Kind.TASKS, key, data, sum(t.dense_bytes for t in chunk)))
    items += singles
    return publish_many(items)
