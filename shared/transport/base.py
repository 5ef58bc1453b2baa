"""The transport interface every service talks to: queues, routing keys, acks, a dead-letter path.

Why an interface with two implementations: the services must run unchanged over RabbitMQ (separate
processes, the real thing) and in one process (fast unit tests, single-process runs). Both give the
same semantics the services rely on: durable named queues bound to routing keys on one topic
exchange per experiment (bound with exact keys; several queues on one key all get a copy — that is
how broadcasts work; a topic exchange lets the broker restrict each user's keys),
manual acks after processing, redelivery of unacked messages with ``redelivered=True``, and a
dead-letter queue that receives messages with the reason in a header.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def names(experiment: str) -> ExperimentNames:
    return ExperimentNames(experiment)


@dataclass(frozen=True)
class ExperimentNames:
    """Broker object names of one experiment (one place, so dashboards and tests agree)."""

    experiment: str

    @property
    def exchange(self) -> str:
        return f"ff.{self.experiment}"

    @property
    def dead_letter_exchange(self) -> str:
        return f"ff.{self.experiment}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        return f"ff.{self.experiment}.dead"

    @property
    def server_queue(self) -> str:
        return f"ff.{self.experiment}.server"

    @property
    def updates_queue(self) -> str:
        return f"ff.{self.experiment}.updates"

    def aggregator_queue(self, agg_id: str) -> str:
        return f"ff.{self.experiment}.agg.{agg_id}"

    def client_queue(self, client_id: str) -> str:
        return f"ff.{self.experiment}.client.{client_id}"


# Routing keys on the experiment's direct exchange.
KEY_SERVER = "server"
KEY_UPDATE = "update"
KEY_AGGREGATORS = "aggregators"  # broadcast to every aggregator
KEY_CLIENTS = "clients"  # broadcast to every client process


def key_aggregator(agg_id: str) -> str:
    return f"agg.{agg_id}"


def key_host(host_id: str) -> str:
    """A client host's own key: its leases, its devices' state and tasks, ``go`` and evaluations."""
    return f"host.{host_id}"


#: a new host's request for a broker user of its own (answered by direct reply-to)
KEY_JOIN = "join"


@dataclass
class Delivery:
    """One received message. ``ack``/``nack`` are bound to the channel it came from."""

    body: bytes
    routing_key: str
    redelivered: bool
    headers: dict[str, Any] = field(default_factory=dict)
    #: the publisher's broker user, as the broker validated it (None: the publisher set none)
    user_id: str | None = None
    #: where the publisher wants its answer (RabbitMQ's direct reply-to pseudo-queue), if anywhere
    reply_to: str | None = None
    _ack: Callable[[], None] = field(default=lambda: None, repr=False)
    _nack: Callable[[bool], None] = field(default=lambda requeue: None, repr=False)
    settled: bool = False
    #: rejected, its dead letter not yet stored (a service stores a turn's together): nobody may ack
    #: or requeue it meanwhile, or it would be acked unrecorded, or handled again and recorded twice
    doomed: bool = False
    #: the transport connection it came on (None: the transport has one for good): a dead letter of
    #: a delivery from a lost connection is not stored, because the broker delivers it again
    generation: int | None = None

    def ack(self) -> None:
        if not self.settled and not self.doomed:
            self.settled = True
            self._ack()

    def nack(self, requeue: bool) -> None:
        if not self.settled and not self.doomed:
            self.settled = True
            self._nack(requeue)


def split(delivery: Delivery, bodies: list[bytes]) -> list[Delivery]:
    """One delivery per entry of a message that carries several (``tasks``, ``answers``,
    ``updates``), each settled on its own.

    ``bodies``: each entry as the lone message it stands for (what a dead letter of that entry
    stores, and whose length its device is charged). The message itself is acked once every part
    is settled (acked or dead-lettered), so a crash before that redelivers all of it, and every
    entry is handled again as a redelivered lone message would be (one dead-lettered before is
    dead-lettered again: a lone one, acked once its dead letter is stored, would not come back).
    A part nacked with requeue nacks the whole message at once (an aggregator puts back the
    updates of a partial the server found overlapping): its other entries come back too,
    redelivered, at least once as with a lost connection, and the message is settled, so what its
    other parts do afterwards reaches the broker no more. Without requeue the broker would
    dead-letter them all, so such a part is only settled (nothing nacks that way).
    """
    left = [len(bodies)]
    parts: list[Delivery] = []

    def settled() -> None:
        left[0] -= 1
        if left[0] == 0:
            delivery.ack()

    def nacked(requeue: bool) -> None:
        if requeue:
            delivery.nack(requeue=True)
            # the whole message comes back: no part of it is settled on its own any more (the dead
            # letter of a part rejected earlier in this turn, still to be stored, is not stored:
            # its redelivery is dead-lettered again)
            for part in parts:
                part.settled = True
        else:
            settled()

    parts += [
        Delivery(
            body=body,
            routing_key=delivery.routing_key,
            redelivered=delivery.redelivered,
            headers=delivery.headers,
            user_id=delivery.user_id,
            reply_to=delivery.reply_to,
            _ack=settled,
            _nack=nacked,
            generation=delivery.generation,
        )
        for body in bodies
    ]
    return parts


Handler = Callable[[Delivery], None]


class Unroutable(Exception):
    """A message no queue is bound for (e.g. a task for a device whose client is gone)."""


class BrokerUnavailable(ConnectionError):
    """No broker address answered within the reconnect budget. Its message is one line naming the
    addresses tried (passwords redacted): what a service prints before it exits non-zero."""


class Departed(BrokerUnavailable):
    """The connection of a transport that was winding down (``Transport.winding_down``) is gone,
    and will not be opened again.

    For a client host that handed every device back this is the expected end, not a fault: the server
    then deletes the host's broker user, which makes the broker close its connection, and
    reconnecting as a deleted user could only spend the reconnect budget and fail. A subclass of
    ``BrokerUnavailable`` so that anyone not expecting it still ends with one line, not a traceback.
    """


class Transport(ABC):
    """What services need from a message broker."""

    kind: str = "abstract"
    #: the broker user this transport is logged in as (every message it publishes carries it)
    user: str = ""
    #: broker faults this transport met and recovered from so far: lost connections and consumers
    #: the broker cancelled. Messages in flight may have gone with them; the server compares the
    #: count across a round (``RoundState.lost_to_broker``). Always 0 in one process.
    faults: int = 0

    def __init__(self, experiment: str) -> None:
        self.names = names(experiment)

    @abstractmethod
    def declare_queue(self, queue: str, bindings: Sequence[str], *, expires_s: float | None = None) -> None:
        """Declare a durable queue (dead-lettering to the experiment's DLX) bound to ``bindings``.

        ``expires_s``: the broker deletes the queue after that long without consumers — for queues
        that belong to one process session, so crashed sessions leave nothing behind.
        """

    @abstractmethod
    def wait_for_queue(self, queue: str) -> None:
        """Wait until another service has declared ``queue`` (a least-privilege user may consume a
        queue it may not create)."""

    @abstractmethod
    def bind(self, queue: str, key: str) -> None: ...

    @abstractmethod
    def unbind(self, queue: str, key: str) -> None:
        """Stop routing ``key`` to ``queue`` (a device that moved to another host)."""

    @abstractmethod
    def publish(
        self, key: str, body: bytes, headers: dict[str, Any] | None = None, *, transient: bool = False
    ) -> None:
        """Publish persistently and wait for the broker's confirm. Raises ``Unroutable``.

        ``transient``: the sender can afford to lose this message to a broker restart (a device's
        update: its device falls silent in that round, as when its host crashes), so the broker need
        not store it (AMQP: ``delivery_mode=1`` unless ``RABBITMQ_UPDATE_DELIVERY=persistent``). The
        confirm still says the broker took it.
        """

    def publish_many(self, items: Sequence[tuple[str, bytes]], *, transient: bool = False) -> set[str]:
        """Publish a batch persistently (``transient``: as ``publish``); returns the routing keys
        nobody was bound for.

        For fan-out bursts (a round's tasks): one broker acknowledgement for the whole batch instead
        of one round trip per message. The default publishes one by one.
        """
        unroutable: set[str] = set()
        for key, body in items:
            try:
                self.publish(key, body, transient=transient)
            except Unroutable:
                unroutable.add(key)
        return unroutable

    def publish_reply(self, reply_to: str, body: bytes) -> None:
        """Answer a request on its ``reply_to`` (RabbitMQ's direct reply-to: only the asking
        connection can read it). In one process nobody asks that way: hosts get their user at start."""
        raise Unroutable(reply_to)

    @abstractmethod
    def consume(self, queue: str, handler: Handler, prefetch: int) -> None: ...

    @abstractmethod
    def process(self, timeout: float) -> None:
        """Dispatch deliveries to handlers for up to ``timeout`` seconds (0 = what is ready now)."""

    @abstractmethod
    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Move a message to the dead-letter queue with its reason, then ack the original."""

    def dead_letter_many(self, items: Sequence[tuple[Delivery, str, str]]) -> None:
        """``dead_letter`` each ``(delivery, reason, detail)``; a transport may store them together.

        Why: a hostile sender's burst of bad messages (or one ``answers`` of 4,096 bad entries)
        cost a confirmed publish each, 0.8 ms apiece over a local RabbitMQ: a stall of seconds
        for the service. Stored with one broker round trip, they cost what a batch does. A
        delivery settled meanwhile is left alone."""
        for delivery, reason, detail in items:
            if not delivery.settled:
                self.dead_letter(delivery, reason, detail)

    @abstractmethod
    def queue_depth(self, queue: str) -> int: ...

    @abstractmethod
    def delete_experiment(self, queues: Sequence[str] = ()) -> None:
        """Remove the experiment's queues (those declared here plus ``queues``) and exchanges."""

    @abstractmethod
    def delete_queue(self, queue: str) -> None: ...

    def winding_down(self) -> None:
        """Nothing more is expected of the broker: a lost connection from now on is the end.

        A leaving client host calls this once it has handed every device back, because the server
        then deletes its broker user and queue and the broker closes its connection. From then on a
        lost connection (or a cancelled consumer) is not reconnected: ``process`` raises
        ``Departed``. In one process nothing is deleted under a service, so this does nothing.
        """
        return  # nothing to note: no broker deletes anything under an in-process service

    @abstractmethod
    def close(self) -> None: ...
