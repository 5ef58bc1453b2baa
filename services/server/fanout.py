"""A round's tasks as messages: what devices share travels once per host, the rest once per device.

Why: with FedAvg every device's task *is* the global model. Sent inline, 1,300 invited devices
pushed 1,300 copies of it (≈ 570 MB for a 440 KB model) through the broker every round, and every
client process decoded each copy. Here a task spec that several devices share (strategies return the
same ``TaskSpec`` object for them: FedAvg's one model, HeteroFL's one slice per width) becomes one
:class:`~shared.schemas.Payload`, content-addressed by a digest, sent once to each host that serves
one of those devices, ahead of the tasks in the same queue; each task carries the digest and what
is its device's own.

The emulation is unchanged: a device is charged the bytes its real counterpart would download — its
task plus the payload, as one message (``Outgoing.device_bytes``) — so budgets, timings and the
communication-cost figures do not depend on how the emulator moves bytes. What crossed the broker is
counted separately (``Fanout.broker_bytes``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common import encode_tensors
from shared import codec
from shared.algorithms.base import TaskSpec
from shared.schemas import Kind, Payload, Task
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


@dataclass
class Fanout:
    """A round's messages: the payloads (once per host that needs them), then the tasks."""

    payloads: list[tuple[str, str, bytes]] = field(default_factory=list)  # (host, routing key, data)
    tasks: list[Outgoing] = field(default_factory=list)
    #: digest → payload message, to answer a host's ``fetch``
    by_digest: dict[bytes, bytes] = field(default_factory=dict)

    @property
    def broker_bytes(self) -> int:
        return sum(len(d) for _, _, d in self.payloads) + sum(len(t.data) for t in self.tasks)


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
    """Encode ``devices``' tasks; a spec shared by two or more devices becomes a payload.

    A spec used by one device only goes inline: a payload would only add a message.
    """
    users: dict[int, list[int]] = {}
    for dev in devices:
        users.setdefault(id(specs[dev]), []).append(dev)
    out = Fanout()
    shared: dict[int, tuple[bytes, int, int]] = {}  # spec id → (digest, packed size, dense bytes)
    sent: set[tuple[str, bytes]] = set()
    for dev in devices:
        spec = specs[dev]
        host = host_of(dev)
        if len(users[id(spec)]) > 1:
            if id(spec) not in shared:
                tensors, dense = encode_tensors(spec.tensors)
                packed = codec.packb(tensors)
                digest = hashlib.sha256(packed).digest()[:16]
                out.by_digest[digest] = encode(Kind.PAYLOAD, Payload(digest=digest, tensors=tensors))
                shared[id(spec)] = (digest, len(packed), dense)
            digest, size, dense = shared[id(spec)]
            if (host, digest) not in sent:
                sent.add((host, digest))
                out.payloads.append((host, route(host), out.by_digest[digest]))
            body = Task(
                device_id=dev, payload=digest, payload_bytes=size, config=spec.config, key=task_key(dev)
            )
            data = encode(kind, body)
            out.tasks.append(Outgoing(dev, route(host), data, len(data) + size, dense, host))
        else:
            tensors, dense = encode_tensors(spec.tensors)
            data = encode(kind, Task(device_id=dev, tensors=tensors, config=spec.config, key=task_key(dev)))
            out.tasks.append(Outgoing(dev, route(host), data, len(data), dense, host))
    return out


def publish(
    fanout: Fanout, publish_many: Callable[[Kind, list[tuple[str, bytes, int]]], set[str]], kind: Kind
) -> set[str]:
    """Send a fan-out: payloads first (a host's queue then holds each before the tasks that need
    it), in one batch each; returns the routing keys nobody was bound for."""
    unroutable = set()
    if fanout.payloads:
        unroutable |= publish_many(Kind.PAYLOAD, [(key, data, 0) for _, key, data in fanout.payloads])
    unroutable |= publish_many(kind, [(t.routing_key, t.data, t.dense_bytes) for t in fanout.tasks])
    return unroutable
