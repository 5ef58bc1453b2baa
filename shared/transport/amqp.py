"""RabbitMQ transport (pika ``BlockingConnection``).

Reliability choices, each because a service relies on it:

* durable exchange and queues, persistent messages (``delivery_mode=2``): a broker restart loses
  nothing that was confirmed;
* every publish carries the connection's user as ``user_id``, which RabbitMQ validates: receivers
  know who sent a message (``Delivery.user_id``, see ``shared.identity``);
* only the experiment's owner (the server) declares the exchange, the dead-letter exchange and queue;
  with ``declare_topology=False`` a service checks they exist (a passive declare needs no permission)
  and waits for them, so least-privilege users never need the right to create or delete them;
* publisher confirms and ``mandatory=True``: ``publish`` returns only once the broker has the message,
  and a message no queue is bound for raises ``Unroutable`` instead of vanishing (the server treats a
  task nobody can receive as a dropout);
* manual acks after processing and a bounded prefetch per consumer: a crashed service's unacked
  messages are redelivered (``redelivered=True``) to another consumer, and no consumer hoards the queue;
* every queue dead-letters into the experiment's DLX, and services dead-letter bad messages
  explicitly (republished with ``x-fedfleet-reason``) so the dead-letter queue says why;
* reconnect with exponential backoff: topology and consumers are re-declared; deliveries from the
  lost channel are not acked (the broker redelivers them);
* handlers run only from ``process``, never from inside a publish: ``publish_many`` must pump the
  connection to see its mandatory returns, and pika would dispatch consumer deliveries there too, so a
  service's handler could run in the middle of the service's own state change (the server's
  ``register`` handler ran between a round's device draw and its ``round_open`` log). Deliveries that
  arrive during a publish wait, in order, for the next ``process``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

from shared.transport.base import Delivery, Handler, Transport, Unroutable

log = logging.getLogger(__name__)

T = TypeVar("T")

_CONNECTION_ERRORS = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPHeartbeatTimeout,
    pika.exceptions.ConnectionWrongStateError,
    pika.exceptions.StreamLostError,
    pika.exceptions.ConnectionClosedByBroker,
    pika.exceptions.ChannelWrongStateError,
    pika.exceptions.ChannelClosedByBroker,
    ConnectionResetError,
)


def broker_reachable(url: str, timeout: float = 3.0) -> bool:
    """True if an AMQP connection to ``url`` can be opened now."""
    params = pika.URLParameters(url)
    params.socket_timeout = timeout
    params.connection_attempts = 1
    params.blocked_connection_timeout = timeout
    try:
        pika.BlockingConnection(params).close()
        return True
    except Exception:
        return False


class AmqpTransport(Transport):
    kind = "amqp"

    def __init__(
        self,
        url: str,
        experiment: str,
        *,
        reconnect_timeout_s: float = 120.0,
        heartbeat_s: int = 30,
        declare_topology: bool = True,
    ) -> None:
        super().__init__(experiment)
        self.url = url
        self.user = self.url_user(url)
        self.declare_topology = declare_topology
        self.reconnect_timeout_s = reconnect_timeout_s
        self.heartbeat_s = heartbeat_s
        self._queues: dict[str, list[str]] = {}
        self._expires: dict[str, float] = {}
        self._consumers: list[tuple[str, Handler, int]] = []
        self._conn: pika.BlockingConnection | None = None
        self._ch: BlockingChannel | None = None
        self._generation = 0
        self._tx: BlockingChannel | None = None
        self._tx_generation = -1
        self._returned: set[str] = set()
        #: >0 while publishing: consumer deliveries are queued in ``_deferred`` instead of handled
        self._publishing = 0
        self._deferred: deque[tuple[Handler, Delivery]] = deque()
        self._connect(first=True)

    # -- connection management -------------------------------------------------------------------
    def _open(self) -> None:
        params = pika.URLParameters(self.url)
        params.heartbeat = self.heartbeat_s
        params.blocked_connection_timeout = 300
        params.connection_attempts = 1
        self._conn = pika.BlockingConnection(params)
        ch = self._conn.channel()
        ch.confirm_delivery()
        if self.declare_topology:
            ch.exchange_declare(self.names.exchange, exchange_type="topic", durable=True)
            ch.exchange_declare(self.names.dead_letter_exchange, exchange_type="fanout", durable=True)
            ch.queue_declare(self.names.dead_letter_queue, durable=True)
            ch.queue_bind(self.names.dead_letter_queue, self.names.dead_letter_exchange)
        else:
            ch = self._await_topology(ch)
        self._ch = ch
        self._generation += 1
        # deliveries of the lost channel can no longer be acked; the broker redelivers them
        self._deferred.clear()
        for queue, keys in self._queues.items():
            self._declare(queue, keys)
        for queue, handler, prefetch in self._consumers:
            self._start_consumer(queue, handler, prefetch)

    @staticmethod
    def url_user(url: str) -> str:
        """The user an AMQP URL logs in as."""
        return str(pika.URLParameters(url).credentials.username)

    def _await_topology(self, ch: BlockingChannel) -> BlockingChannel:
        """Wait until the owner has declared the experiment's exchanges (passive declares: a channel
        that finds one missing is closed by the broker, so each try uses a fresh one)."""
        assert self._conn is not None
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                ch.exchange_declare(self.names.exchange, passive=True)
                ch.exchange_declare(self.names.dead_letter_exchange, passive=True)
                return ch
            except pika.exceptions.ChannelClosedByBroker as err:
                if err.reply_code != 404 or time.monotonic() > deadline:
                    raise
                log.info(
                    "waiting for the server to create the experiment's exchange",
                    extra={"event": "amqp_await_topology"},
                )
                self._conn.sleep(0.5)
                ch = self._conn.channel()
                ch.confirm_delivery()

    def _connect(self, first: bool = False) -> None:
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay = 0.25
        while True:
            try:
                self._open()
                if not first:
                    log.warning("reconnected to the broker", extra={"event": "amqp_reconnected"})
                return
            except _CONNECTION_ERRORS as err:
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(f"cannot reach RabbitMQ at {_redact(self.url)}: {err}") from err
                log.warning(
                    "broker unreachable, retrying in %.2fs: %s", delay, err, extra={"event": "amqp_retry"}
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _with_reconnect(self, fn: Callable[[], T]) -> T:
        for _attempt in range(5):
            try:
                return fn()
            except _CONNECTION_ERRORS as err:
                log.warning("broker connection lost (%s); reconnecting", err, extra={"event": "amqp_lost"})
                self._safe_close()
                self._connect()
        return fn()

    @property
    def channel(self) -> BlockingChannel:
        assert self._ch is not None
        return self._ch

    # -- topology --------------------------------------------------------------------------------
    def _declare(self, queue: str, keys: Sequence[str]) -> None:
        args: dict[str, Any] = {"x-dead-letter-exchange": self.names.dead_letter_exchange}
        if queue in self._expires:
            args["x-expires"] = int(self._expires[queue] * 1000)
        self.channel.queue_declare(queue, durable=True, arguments=args)
        for key in keys:
            self.channel.queue_bind(queue, self.names.exchange, routing_key=key)

    def declare_queue(self, queue: str, bindings: Sequence[str], *, expires_s: float | None = None) -> None:
        if expires_s is not None:
            self._expires[queue] = expires_s
        self._queues.setdefault(queue, [])
        for key in bindings:
            if key not in self._queues[queue]:
                self._queues[queue].append(key)
        self._with_reconnect(lambda: self._declare(queue, bindings))

    def bind(self, queue: str, key: str) -> None:
        self.declare_queue(queue, [key])

    def wait_for_queue(self, queue: str) -> None:
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                self.channel.queue_declare(queue, passive=True)
                return
            except pika.exceptions.ChannelClosedByBroker as err:
                if err.reply_code != 404 or time.monotonic() > deadline:
                    raise
                assert self._conn is not None
                log.info("waiting for queue %s", queue, extra={"event": "amqp_await_queue"})
                self._conn.sleep(0.5)
                self._ch = self._conn.channel()
                self._ch.confirm_delivery()

    def unbind(self, queue: str, key: str) -> None:
        keys = self._queues.get(queue, [])
        if key in keys:
            keys.remove(key)  # a reconnect re-declares the queue without it
        self._with_reconnect(lambda: self.channel.queue_unbind(queue, self.names.exchange, routing_key=key))

    # -- publishing ------------------------------------------------------------------------------
    def publish(self, key: str, body: bytes, headers: dict[str, Any] | None = None) -> None:
        props = BasicProperties(delivery_mode=2, headers=headers or None, user_id=self.user)

        def _pub() -> None:
            try:
                self.channel.basic_publish(self.names.exchange, key, body, props, mandatory=True)
            except pika.exceptions.UnroutableError as err:
                raise Unroutable(key) from err

        self._with_reconnect(_pub)

    def publish_reply(self, reply_to: str, body: bytes) -> None:
        # Not mandatory: RabbitMQ returns direct replies as unroutable even when they are delivered,
        # and pika would log the returned body — a reply may hold credentials.
        props = BasicProperties(user_id=self.user)
        self._with_reconnect(lambda: self.channel.basic_publish("", reply_to, body, props))

    def _batch_channel(self) -> BlockingChannel:
        """A second channel in AMQP transaction mode: a batch is committed (and, for durable queues,
        persisted) with one round trip. Mandatory returns arrive before the commit's reply."""
        if self._tx is None or self._tx_generation != self._generation or not self._tx.is_open:
            assert self._conn is not None
            ch = self._conn.channel()
            ch.tx_select()
            ch.add_on_return_callback(
                lambda _ch, method, _props, _body: self._returned.add(method.routing_key)
            )
            self._tx, self._tx_generation = ch, self._generation
        return self._tx

    def publish_many(self, items: Sequence[tuple[str, bytes]]) -> set[str]:
        props = BasicProperties(delivery_mode=2, user_id=self.user)

        def _pub() -> set[str]:
            ch = self._batch_channel()
            self._returned.clear()
            for key, body in items:
                ch.basic_publish(self.names.exchange, key, body, props, mandatory=True)
            ch.tx_commit()
            assert self._conn is not None
            self._publishing += 1
            try:  # dispatch the basic.return callbacks; consumer deliveries are deferred
                self._conn.process_data_events(0)
            finally:
                self._publishing -= 1
            return set(self._returned)

        return self._with_reconnect(_pub)

    # -- consuming -------------------------------------------------------------------------------
    def _start_consumer(self, queue: str, handler: Handler, prefetch: int) -> None:
        ch = self.channel
        generation = self._generation
        ch.basic_qos(prefetch_count=prefetch)

        def on_message(
            chan: BlockingChannel, method: Basic.Deliver, props: BasicProperties, body: bytes
        ) -> None:
            tag = method.delivery_tag

            def ack() -> None:
                if generation == self._generation and chan.is_open:
                    chan.basic_ack(tag)

            def nack(requeue: bool) -> None:
                if generation == self._generation and chan.is_open:
                    chan.basic_nack(tag, requeue=requeue)

            d = Delivery(
                body=body,
                routing_key=method.routing_key or "",
                redelivered=bool(method.redelivered),
                headers=dict(props.headers or {}),
                user_id=props.user_id,
                reply_to=props.reply_to,
                _ack=ack,
                _nack=nack,
            )
            if self._publishing:
                self._deferred.append((handler, d))
            else:
                handler(d)

        ch.basic_consume(queue, on_message, auto_ack=False)

    def consume(self, queue: str, handler: Handler, prefetch: int) -> None:
        self._consumers.append((queue, handler, prefetch))
        self._with_reconnect(lambda: self._start_consumer(queue, handler, prefetch))

    def process(self, timeout: float) -> None:
        if self._deferred:  # what arrived during a publish comes first, in arrival order
            while self._deferred:  # a reconnect inside a handler empties it (see ``_open``)
                handler, delivery = self._deferred.popleft()
                handler(delivery)
            return

        def _run() -> None:
            assert self._conn is not None
            self._conn.process_data_events(time_limit=timeout)

        self._with_reconnect(_run)

    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        headers = dict(delivery.headers)
        headers.update(
            {
                "x-fedfleet-reason": reason,
                "x-fedfleet-detail": detail[:500],
                "x-original-key": delivery.routing_key,
            }
        )
        # the original sender stays readable in a header; the dead letter itself is published by us
        if delivery.user_id:
            headers["x-fedfleet-user"] = delivery.user_id
        props = BasicProperties(delivery_mode=2, headers=headers, user_id=self.user)
        self._with_reconnect(
            lambda: self.channel.basic_publish(self.names.dead_letter_exchange, "", delivery.body, props)
        )
        delivery.ack()

    def queue_depth(self, queue: str) -> int:
        def _depth() -> int:
            res = self.channel.queue_declare(queue, passive=True)
            return int(res.method.message_count)

        return self._with_reconnect(_depth)

    def delete_experiment(self, queues: Sequence[str] = ()) -> None:
        """Delete the experiment's queues and exchanges, on a fresh channel (passive errors close it)."""
        assert self._conn is not None
        for queue in dict.fromkeys([*self._queues, *queues, self.names.dead_letter_queue]):
            try:
                self.channel.queue_delete(queue)
            except pika.exceptions.ChannelClosedByBroker:
                self._ch = self._conn.channel()
        for ex in (self.names.exchange, self.names.dead_letter_exchange):
            try:
                self.channel.exchange_delete(ex)
            except pika.exceptions.ChannelClosedByBroker:
                self._ch = self._conn.channel()

    def delete_queue(self, queue: str) -> None:
        self._queues.pop(queue, None)
        self._with_reconnect(lambda: self.channel.queue_delete(queue))

    def _safe_close(self) -> None:
        try:
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        except Exception:  # the connection is already broken; nothing else to release
            pass
        self._conn = None
        self._ch = None

    def close(self) -> None:
        self._safe_close()


def _redact(url: str) -> str:
    params = pika.URLParameters(url)
    return f"amqp://{params.host}:{params.port}{params.virtual_host and '/' + params.virtual_host}"
