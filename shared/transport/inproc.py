"""An in-process broker with RabbitMQ's semantics, for single-process runs and fast tests.

It keeps the behaviour the services depend on — direct-exchange multicast, per-consumer prefetch,
manual ack, requeue with ``redelivered=True``, unroutable detection, a dead-letter queue — so that an
experiment run in-process ends with the same global model as over RabbitMQ (only timing differs).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.transport.base import Delivery, Handler, Transport, Unroutable


@dataclass
class _Msg:
    body: bytes
    key: str
    headers: dict[str, Any]
    redelivered: bool = False
    user_id: str | None = None


@dataclass
class _Consumer:
    queue: str
    handler: Handler
    prefetch: int
    owner: InprocTransport
    unacked: dict[int, _Msg] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def _topic_regex(pattern: str) -> re.Pattern[str]:
    words = []
    for word in pattern.split("."):
        words.append("[^.]+" if word == "*" else ".*" if word == "#" else re.escape(word))
    return re.compile("^" + r"\.".join(words).replace(r"\..*", r"(\..*)?").replace(r".*\.", r"(.*\.)?") + "$")


def _topic_match(pattern: str, key: str) -> bool:
    return _topic_regex(pattern).match(key) is not None


class InprocBroker:
    """Shared by every ``InprocTransport`` of one process."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[_Msg]] = {}
        self.bindings: dict[str, set[str]] = defaultdict(set)  # key -> queues
        self.consumers: dict[str, list[_Consumer]] = defaultdict(list)
        self._tags = itertools.count(1)

    def route(self, key: str, msg: _Msg) -> None:
        """Topic-exchange routing: exact binding keys, and ``*`` (one word) / ``#`` (any words)."""
        targets = set(self.bindings.get(key, set()))
        for pattern, queues in self.bindings.items():
            if queues and ("*" in pattern or "#" in pattern) and _topic_match(pattern, key):
                targets |= queues
        if not targets:
            raise Unroutable(key)
        for q in sorted(targets):
            self.queues[q].append(_Msg(msg.body, msg.key, dict(msg.headers), user_id=msg.user_id))

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


class InprocTransport(Transport):
    kind = "inproc"

    def __init__(self, broker: InprocBroker, experiment: str, user: str = "") -> None:
        super().__init__(experiment)
        self.broker = broker
        #: the "broker user" this connection publishes as (as RabbitMQ would validate it)
        self.user = user
        self._consumers: list[_Consumer] = []
        dlq = self.names.dead_letter_queue
        broker.queues.setdefault(dlq, deque())
        self.closed = False

    def declare_queue(self, queue: str, bindings: Sequence[str], *, expires_s: float | None = None) -> None:
        self.broker.queues.setdefault(queue, deque())
        for key in bindings:
            self.bind(queue, key)

    def bind(self, queue: str, key: str) -> None:
        self.broker.queues.setdefault(queue, deque())
        self.broker.bindings[key].add(queue)

    def wait_for_queue(self, queue: str) -> None:
        """In one process the server has declared it already, or will before anything is routed."""
        self.broker.queues.setdefault(queue, deque())

    def unbind(self, queue: str, key: str) -> None:
        self.broker.bindings.get(key, set()).discard(queue)

    def publish(
        self, key: str, body: bytes, headers: dict[str, Any] | None = None, *, transient: bool = False
    ) -> None:
        self.broker.route(key, _Msg(bytes(body), key, dict(headers or {}), user_id=self.user or None))

    def consume(self, queue: str, handler: Handler, prefetch: int) -> None:
        c = _Consumer(queue, handler, prefetch, self)
        self._consumers.append(c)
        self.broker.consumers[queue].append(c)

    def _deliver_one(self, c: _Consumer) -> bool:
        q = self.broker.queues.get(c.queue)
        if not q or len(c.unacked) >= c.prefetch:
            return False
        msg = q.popleft()
        tag = next(self.broker._tags)
        c.unacked[tag] = msg

        def ack(tag: int = tag) -> None:
            c.unacked.pop(tag, None)

        def nack(requeue: bool, tag: int = tag) -> None:
            m = c.unacked.pop(tag, None)
            if m is not None and requeue:
                m.redelivered = True
                self.broker.queues[c.queue].appendleft(m)

        d = Delivery(msg.body, msg.key, msg.redelivered, msg.headers, msg.user_id, None, ack, nack)
        c.handler(d)
        return True

    def process(self, timeout: float) -> None:
        """Deliver what is ready to this transport's consumers, one message per consumer per pass."""
        if self.closed:
            return
        progressed = True
        budget = 10_000
        while progressed and budget > 0:
            progressed = False
            for c in list(self._consumers):
                if self._deliver_one(c):
                    progressed = True
                    budget -= 1

    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        headers = dict(delivery.headers)
        headers.update({"x-fedfleet-reason": reason, "x-fedfleet-detail": detail[:500]})
        self.broker.queues[self.names.dead_letter_queue].append(
            _Msg(delivery.body, delivery.routing_key, headers, user_id=delivery.user_id)
        )
        delivery.ack()

    def queue_depth(self, queue: str) -> int:
        return len(self.broker.queues.get(queue, ()))

    def delete_experiment(self, queues: Sequence[str] = ()) -> None:
        prefix = self.names.exchange + "."
        for q in [q for q in self.broker.queues if q.startswith(prefix)]:
            del self.broker.queues[q]
        for qs in self.broker.bindings.values():
            qs.difference_update({q for q in qs if q.startswith(prefix)})

    def delete_queue(self, queue: str) -> None:
        self.broker.queues.pop(queue, None)
        for qs in self.broker.bindings.values():
            qs.discard(queue)

    def close(self) -> None:
        """Like a dropped connection: unacked messages go back to their queues, redelivered."""
        self.closed = True
        for c in self._consumers:
            for m in c.unacked.values():
                m.redelivered = True
                self.broker.queues.setdefault(c.queue, deque()).appendleft(m)
            c.unacked.clear()
            self.broker.consumers[c.queue].remove(c)
        self._consumers.clear()
