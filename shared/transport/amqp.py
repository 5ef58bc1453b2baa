"""RabbitMQ transport (pika ``BlockingConnection``).

Reliability choices, each because a service relies on it:

* durable exchange and queues, persistent messages (``delivery_mode=2``): a broker restart loses
  nothing that was confirmed, except what the sender marks ``transient`` (a device's update,
  ``RABBITMQ_UPDATE_DELIVERY``): its device falls silent in that round, as when its host crashes;
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
* several broker addresses (``RABBITMQ_URL`` lists them, ``;``-separated): a connection goes to the
  first that answers and, after a loss, to the next one; reconnects back off exponentially within a
  budget (settings ``reconnect_*``), and an exhausted budget is one ``BrokerUnavailable`` line that
  names the addresses (passwords redacted), never an assertion deep in a handler;
* reconnects re-declare topology and consumers; deliveries from the lost channel are not acked (the
  broker redelivers them);
* ``RABBITMQ_QUEUE_TYPE`` gives every queue declared here the same type (``quorum`` replicates it
  over a cluster's nodes); the dead-letter queue included, since dead letters must not be lost with
  one node;
* ``RABBITMQ_QUEUE_MODE=lazy`` (the default) declares every classic queue lazy: the broker writes a
  message's body to disk on arrival and keeps none in RAM, so a round's backlog of updates (at 10,000
  devices ~870 updates of ~437 KB waited in the updates queue, 364 MiB of the broker's ~700 MiB) costs
  the broker disk, not memory (docs/broker.md, "What the broker holds"); quorum queues take no mode
  (RabbitMQ refuses it on them);
* a publish the broker NACKs (a quorum queue electing a new leader does so for a fraction of a
  second) or whose channel it closes is sent again on a fresh channel, a bounded number of times and
  counted (``fedfleet_broker_publish_retries_total``); it never reaches a handler as its error;
* a consumer the broker cancels (``basic.cancel``: its queue's node or leader went away) is
  re-declared and re-subscribed, logged as ``amqp_consumer_cancelled``;
* the dead-letter publish is confirmed like any other; if it cannot be confirmed the original is
  left unacknowledged, so the broker delivers it again rather than losing it;
* a transport told it is ``winding_down`` (a leaving host that handed every device back, whose broker
  user the server is about to delete) makes one pass over the addresses after a loss and no more: a
  broker that lost a node still gets the host's last heartbeat through another, but a login refused
  (the user is deleted: the expected end) or no address answering ends it, and ``process`` raises
  ``Departed`` at once instead of spending the reconnect budget as a user that no longer exists;
* an ack or nack the broker can no longer take because the connection closed under it (a deleted
  user, a lost node) is not an error of the handler: the message is redelivered, which the services
  already handle (at-least-once); a connection found closed between two ``process`` calls goes
  through the reconnect path, not into pika (whose ioloop, once closed, raises ``ValueError``);
* handlers run only from ``process``, never from inside a publish: ``publish_many`` must pump the
  connection to see its mandatory returns, and pika would dispatch consumer deliveries there too, so a
  service's handler could run in the middle of the service's own state change (the server's
  ``register`` handler ran between a round's device draw and its ``round_open`` log). Deliveries that
  arrive during a publish wait, in order, for the next ``process``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import pika
import pika.connection
import pika.exceptions
import pika.frame
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel
from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport, _AsyncTransportBase
from pika.spec import Basic, BasicProperties

from shared import metrics
from shared.transport.base import BrokerUnavailable, Delivery, Departed, Handler, Transport, Unroutable
from shared.transport.urls import redact, scrub, split_urls

__all__ = ["AmqpTransport", "BrokerOptions", "BrokerUnavailable", "broker_reachable", "queue_arguments"]

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
#: reply codes that say "you may not" or "not like this" rather than "not now": retrying cannot help
_PERMANENT = (403, 406)

#: the most dead letters, and their bytes, one transaction stores (``dead_letter_many``): a turn
#: may reject a whole prefetch of messages as large as the broker takes, and a transaction is held
#: in the broker's memory until its commit
DEAD_LETTER_BATCH = 512
DEAD_LETTER_BATCH_BYTES = 16 << 20
#: bytes of a transaction's messages held in memory before they are written to the socket
TX_BUFFER_BYTES = 16 << 20
#: bytes of messages one transaction holds at most: the broker keeps a transaction's messages in
#: memory until its commit, so a larger batch (a fan-out of a large model to many hosts) goes as
#: several transactions, in order
TX_MAX_BYTES = 64 << 20

_Item = TypeVar("_Item")

QueueType = Literal["classic", "quorum"]
QueueMode = Literal["default", "lazy"]


class _PublishRefused(Exception):
    """A publish the broker kept refusing on fresh channels: handled like a lost connection."""


@dataclass(frozen=True)
class BrokerOptions:
    """How a transport uses the broker; the defaults are the settings' (``shared.config.Settings``)."""

    queue_type: QueueType = "classic"
    queue_mode: QueueMode = "lazy"
    #: publish what the sender marks ``transient`` (a device's update) with ``delivery_mode=1``
    #: (``RABBITMQ_UPDATE_DELIVERY``); False: everything persistent
    transient_updates: bool = True
    reconnect_budget_s: float = 120.0
    backoff_s: float = 0.25
    backoff_max_s: float = 5.0
    publish_retries: int = 8

    @classmethod
    def from_settings(cls) -> BrokerOptions:
        """From the process environment, so every transport of a deployment agrees on the queue
        type (RabbitMQ refuses a re-declaration with another type)."""
        from shared.config import Settings

        s = Settings()
        return cls(
            queue_type=s.rabbitmq_queue_type,
            queue_mode=s.rabbitmq_queue_mode,
            transient_updates=s.rabbitmq_update_delivery == "transient",
            reconnect_budget_s=s.reconnect_budget_s,
            backoff_s=s.reconnect_backoff_s,
            backoff_max_s=s.reconnect_backoff_max_s,
            publish_retries=s.publish_retries,
        )


def queue_arguments(
    queue_type: QueueType,
    dead_letter_exchange: str | None,
    expires_s: float | None,
    queue_mode: QueueMode = "default",
) -> dict[str, Any]:
    """The ``queue.declare`` arguments of a fedfleet queue.

    A classic queue is declared without ``x-queue-type`` (as before the setting existed, so queues
    of a running deployment keep their declaration); a quorum queue carries it on every declaration.
    Both take ``x-expires`` (the session queues of hosts and aggregators) and a dead-letter exchange.
    ``queue_mode="lazy"`` adds ``x-queue-mode: lazy`` to a classic queue (bodies to disk on arrival,
    none kept in RAM). A quorum queue refuses that argument (406), so it gets none: it keeps recent
    log entries in the broker's memory until its write-ahead log rolls over, whatever the mode
    (docs/broker.md, "What the broker holds").
    """
    args: dict[str, Any] = {}
    if queue_type == "quorum":
        args["x-queue-type"] = "quorum"
    elif queue_mode == "lazy":
        args["x-queue-mode"] = "lazy"
    if dead_letter_exchange is not None:
        args["x-dead-letter-exchange"] = dead_letter_exchange
    if expires_s is not None:
        args["x-expires"] = int(expires_s * 1000)
    return args


def broker_reachable(url: str, timeout: float = 3.0) -> bool:
    """True if an AMQP connection to one of the addresses of ``url`` can be opened now."""
    for one in split_urls(url):
        params = pika.URLParameters(one)
        params.socket_timeout = timeout
        params.connection_attempts = 1
        params.blocked_connection_timeout = timeout
        try:
            pika.BlockingConnection(params).close()
            return True
        except Exception:
            continue
    return False


def _ack_unflushed(chan: BlockingChannel, tag: int) -> None:
    """Ack a delivery without waiting for the ack to be written.

    Why: ``BlockingChannel.basic_ack`` runs pika's I/O loop until the ack frame is on the socket —
    a poll and a send per message, about as much CPU as a server spends handling a receipt (issue
    16's profile). Queued on the underlying channel instead, the ack is written by the next
    ``process`` (every turn of a service's loop starts with one), a publish, or ``close`` (pika
    writes its buffer in order). What is lost with a crash before then is an ack the broker did
    not get: the message is delivered again, exactly as after a crash just before the ack.
    """
    chan._impl.basic_ack(delivery_tag=tag)


#: bytes pika asks the socket for per read (pika's own default: 4,096)
RECV_BYTES = 1 << 20


def _read_in_large_chunks() -> None:
    """Make pika read its sockets up to :data:`RECV_BYTES` at a time instead of 4 KiB.

    Why: pika appends every read to its frame buffer (a ``bytes`` concatenation, a copy of the
    whole partial frame) and tries to parse a frame after each, so a 438 KB update (a
    ``fleet_2000`` phone's model) took ~107 reads, each copying up to a 128 KiB frame. Measured with
    ``python benchmarks/bench_recv.py`` (benchmarks/results.md, "Reading large messages"): the
    consumer's CPU per 438 KB message falls from ~1.8 ms to ~0.8 ms; small messages cost the same.
    At 10,000 devices each of 2 aggregators reads ~500 such updates a round. pika is pinned below 2 in
    ``pyproject.toml``; this private attribute is checked by ``tests/test_amqp_transport.py``.
    """
    _AsyncTransportBase._MAX_RECV_BYTES = RECV_BYTES


_read_in_large_chunks()


def _on_data_available(self: pika.connection.Connection, data_in: bytes) -> None:
    """pika's ``Connection._on_data_available``, parsing the frames of a read where they lie.

    pika's own version cuts each parsed frame off the front of its buffer (``_trim_frame_buffer``:
    a copy of everything after it), so a 1 MiB read of eight 128 KiB body frames is copied about
    four times over before its frames are handed on: at 10,000 devices ~11 % of an aggregator's
    samples (py-spy; ``python benchmarks/bench_recv.py`` measures the consumer's CPU per message).
    Here frames are decoded at an offset, a body frame's payload is sliced once, and only the
    partial frame left at the end is kept for the next read. What each frame is, its order and
    ``bytes_received`` are as pika's; any other frame is decoded by pika's ``decode_frame``.
    A read arriving while the frames of an earlier one are processed (pika does not do that; a
    guard all the same) is queued and parsed after them, in order.
    """
    busy = self.__dict__.get("_ff_reads")
    if busy is not None:  # re-entered: the outer call parses it after its own frames
        busy.append(data_in)
        return
    reads = self.__dict__["_ff_reads"] = [data_in]
    try:
        while reads:
            buf = self._frame_buffer + reads.pop(0) if self._frame_buffer else reads.pop(0)
            pos, end_of = 0, len(buf)
            try:
                while pos < end_of:
                    consumed, frame_value = _decode_frame_at(buf, pos)
                    if frame_value is None:
                        break
                    pos += consumed
                    self.bytes_received += consumed
                    self._process_frame(frame_value)
            finally:  # what is left (a partial frame, or the rest after a frame that raised)
                self._frame_buffer = buf[pos:] if pos else buf
    finally:  # after a frame that raised, reads handed in meanwhile stay, in order, as in pika's
        if rest := self.__dict__.pop("_ff_reads"):
            self._frame_buffer += b"".join(rest)


def _decode_frame_at(buf: bytes, pos: int) -> tuple[int, pika.frame.Frame | pika.frame.ProtocolHeader | None]:
    """The frame starting at ``buf[pos]``: (bytes it takes, the frame), or (0, None) when it is not
    all there yet. A body frame's payload is one slice of ``buf``; every other frame, small, is
    decoded by pika from a copy of exactly its bytes."""
    if len(buf) - pos < _FRAME_HEADER_SIZE:
        return 0, None
    if buf.startswith(b"AMQP", pos):  # a protocol header: 8 bytes, pika's decoder knows it
        return pika.frame.decode_frame(buf[pos : pos + 8])
    frame_type, channel, size = _FRAME_HEADER.unpack_from(buf, pos)
    end = pos + _FRAME_HEADER_SIZE + size + _FRAME_END_SIZE
    if end > len(buf):
        return 0, None
    if frame_type == pika.spec.FRAME_BODY:
        if buf[end - 1] != pika.spec.FRAME_END:
            raise pika.exceptions.InvalidFrameError("Invalid FRAME_END marker")
        return end - pos, pika.frame.Body(channel, buf[pos + _FRAME_HEADER_SIZE : end - 1])
    return pika.frame.decode_frame(buf[pos:end])


_FRAME_HEADER = struct.Struct(">BHL")
_FRAME_HEADER_SIZE, _FRAME_END_SIZE = pika.spec.FRAME_HEADER_SIZE, pika.spec.FRAME_END_SIZE
assert _FRAME_HEADER.size == _FRAME_HEADER_SIZE


#: pika's own ``Connection._on_data_available`` (the tests compare the two on the same reads)
PIKA_ON_DATA_AVAILABLE = pika.connection.Connection._on_data_available


def _parse_frames_in_place() -> None:
    """Install :func:`_on_data_available` (pika is pinned below 2 in ``pyproject.toml``;
    ``tests/test_amqp_transport.py`` checks that both give the same frames for the same reads)."""
    pika.connection.Connection._on_data_available = _on_data_available


_parse_frames_in_place()

#: buffers one ``sendmsg`` hands the kernel at most (Linux's ``IOV_MAX`` is 1,024)
SEND_BUFFERS = 256


def _produce(self: Any) -> None:
    """pika's ``_AsyncTransportBase._produce`` for plain sockets, writing every buffered frame it can
    with one ``sendmsg`` (gather I/O) instead of one ``send`` per frame.

    Why: pika buffers each frame apart (a publish is a method frame, a header frame and its body
    frames) and sends them one system call each, and with ``TCP_NODELAY`` (pika sets it) each call is
    a TCP segment of its own that wakes the broker. An aggregator's turn of receipts is ~10 frames
    of a few dozen bytes. At 50 devices a round (``benchmarks/bench_rounds.py``), strace counted
    per round 40 → 9 send calls of the aggregator, 30 → 9 of the server and 27 → 5 of each host.
    What is written, its order, and a partial write (the rest stays queued, as in pika) are
    unchanged; ``BlockingIOError`` leaves the buffers as they were, as pika's. (pika's own retries
    a send interrupted by a signal; Python does that itself since 3.5, PEP 475.)
    """
    buffers = self._tx_buffers
    while buffers:
        if len(buffers) == 1:
            sent = self._sock.send(buffers[0])
        else:
            sent = self._sock.sendmsg(list(itertools.islice(buffers, SEND_BUFFERS)))
        assert sent, "an empty frame buffer (pika's write() refuses them)"  # else no progress, ever
        self._tx_buffered_byte_count -= sent
        while sent:
            head = buffers[0]
            if sent < len(head):
                buffers[0] = head[sent:]
                break
            buffers.popleft()
            sent -= len(head)


def _coalesce_sends() -> None:
    """Install :func:`_produce` on pika's plain-socket transport where sockets have ``sendmsg``
    (not on Windows). TLS sockets keep pika's: ``ssl.SSLSocket.sendmsg`` raises
    NotImplementedError. pika is pinned below 2 in ``pyproject.toml``."""
    if hasattr(socket.socket, "sendmsg"):
        _AsyncPlaintextTransport._produce = _produce


_coalesce_sends()


class AmqpTransport(Transport):
    kind = "amqp"

    def __init__(
        self,
        url: str,
        experiment: str,
        *,
        options: BrokerOptions | None = None,
        heartbeat_s: int = 30,
        declare_topology: bool = True,
    ) -> None:
        super().__init__(experiment)
        self.url = url
        self.urls = split_urls(url)
        self.user = self.url_user(url)
        self.options = options if options is not None else BrokerOptions.from_settings()
        self.declare_topology = declare_topology
        self.heartbeat_s = heartbeat_s
        self._queues: dict[str, list[str]] = {}
        self._expires: dict[str, float] = {}
        self._consumers: list[tuple[str, Handler, int]] = []
        #: consumer tag -> its consumer, to re-subscribe what the broker cancels
        self._tags: dict[str, tuple[str, Handler, int]] = {}
        self._cancelled: list[tuple[str, Handler, int]] = []
        #: the address in use (an index into ``urls``); a loss moves on to the next one
        self._address = 0
        self._conn: pika.BlockingConnection | None = None
        self._ch: BlockingChannel | None = None
        self._pub: BlockingChannel | None = None
        self._generation = 0
        self._tx: BlockingChannel | None = None
        self._tx_generation = -1
        self._returned: set[str] = set()
        #: >0 while a batch is published: deliveries a retry's pause pumps wait in ``_deferred``
        self._publishing = 0
        self._deferred: deque[tuple[Handler, Delivery]] = deque()
        #: set by ``winding_down``: a lost connection from then on ends the transport (``Departed``)
        self._winding_down = False
        #: the connection ended while winding down; nothing is reopened
        self.departed = False
        self._connect(first=True)

    @property
    def address(self) -> str:
        """The address in use, redacted (for logs and tests)."""
        return redact(self.urls[self._address])

    # -- connection management -------------------------------------------------------------------
    def _open(self, url: str) -> None:
        params = pika.URLParameters(url)
        params.heartbeat = self.heartbeat_s
        params.blocked_connection_timeout = 300
        params.connection_attempts = 1
        params.socket_timeout = 5
        self._conn = pika.BlockingConnection(params)
        ch = self._conn.channel()
        if self.declare_topology:
            ch.exchange_declare(self.names.exchange, exchange_type="topic", durable=True)
            ch.exchange_declare(self.names.dead_letter_exchange, exchange_type="fanout", durable=True)
            self._declare_dead_letter_queue(ch)
        else:
            ch = self._await_topology(ch)
        ch.add_on_cancel_callback(self._on_cancel)
        self._ch = ch
        self._pub = None
        self._generation += 1
        # deliveries of the lost channel can no longer be acked; the broker redelivers them
        self._deferred.clear()
        self._cancelled.clear()
        self._tags.clear()
        for queue, keys in self._queues.items():
            self._declare(queue, keys)
        for queue, handler, prefetch in self._consumers:
            self._start_consumer(queue, handler, prefetch)

    def _declare_dead_letter_queue(self, ch: BlockingChannel) -> None:
        """Declare the dead-letter queue as the broker's own definitions declare it (k8s/base/rabbitmq:
        it exists from the broker's boot). Never lazy: a redeclaration whose ``x-queue-mode`` differs
        is refused (406), and the queue holds only rejected messages, so keeping them in RAM costs little.
        """
        args = queue_arguments(self.options.queue_type, None, None, "default")
        ch.queue_declare(self.names.dead_letter_queue, durable=True, arguments=args or None)
        ch.queue_bind(self.names.dead_letter_queue, self.names.dead_letter_exchange)

    @staticmethod
    def url_user(url: str) -> str:
        """The user an AMQP URL (the first of a ``;``-separated list) logs in as."""
        return str(pika.URLParameters(split_urls(url)[0]).credentials.username)

    def _await_topology(self, ch: BlockingChannel) -> BlockingChannel:
        """Wait until the owner has declared the experiment's exchanges (passive declares: a channel
        that finds one missing is closed by the broker, so each try uses a fresh one)."""
        assert self._conn is not None
        deadline = time.monotonic() + self.options.reconnect_budget_s
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

    def _connect(self, first: bool = False) -> None:
        """Connect to the first address that answers, starting at the current one (after a loss the
        caller has moved it on); pass over the list again with backoff until the budget is spent."""
        deadline = time.monotonic() + self.options.reconnect_budget_s
        delay = self.options.backoff_s
        errors: dict[str, str] = {}
        while True:
            for step in range(len(self.urls)):
                index = (self._address + step) % len(self.urls)
                try:
                    self._open(self.urls[index])
                except _CONNECTION_ERRORS as err:
                    if (
                        isinstance(err, pika.exceptions.ChannelClosedByBroker)
                        and err.reply_code in _PERMANENT
                    ):
                        self._safe_close()
                        raise BrokerUnavailable(self._describe(f"refused: {err}")) from None
                    errors[redact(self.urls[index])] = scrub(str(err) or type(err).__name__, self.urls)
                    self._safe_close()
                    continue
                self._address = index
                if not first:
                    metrics.BROKER_RECONNECTS.labels(self.names.experiment).inc()
                    log.warning(
                        "reconnected to the broker at %s",
                        redact(self.urls[index]),
                        extra={"event": "amqp_reconnected"},
                    )
                return
            if self._winding_down:  # one pass: the user is deleted, or nobody answers; either way, the end
                self._end("; ".join(f"{addr}: {why}" for addr, why in errors.items()))
                raise self._departure()
            if time.monotonic() + delay > deadline:
                last = "; ".join(f"{addr}: {why}" for addr, why in errors.items())
                raise BrokerUnavailable(
                    self._describe(f"no address usable within {self.options.reconnect_budget_s:g}s ({last})")
                )
            log.warning(
                "no broker address could be used, retrying in %.2fs: %s",
                delay,
                "; ".join(f"{addr}: {why}" for addr, why in errors.items()),
                extra={"event": "amqp_retry", "f_addresses": [redact(u) for u in self.urls]},
            )
            time.sleep(delay)
            delay = min(delay * 2, self.options.backoff_max_s)

    def _describe(self, why: str) -> str:
        addresses = ", ".join(redact(u) for u in self.urls)
        return scrub(f"cannot reach RabbitMQ at {addresses}: {why}", self.urls).replace("\n", " ")

    def winding_down(self) -> None:
        """From now on a loss gets one pass over the addresses, not the reconnect budget: the
        server is about to delete this user, and a deleted user's login is refused for good."""
        self._winding_down = True

    def _closed(self) -> bool:
        """Whether the connection is really gone (what tells a lost ack or a ``ValueError`` from a
        closed pika ioloop apart from a bug)."""
        return self._conn is None or not self._conn.is_open

    def _end(self, err: BaseException | str) -> None:
        """Winding down and the connection is gone for good: close what is left, reopen nothing."""
        if not self.departed:
            log.info(
                "the broker ended the connection at %s (%s); winding down, so not reconnecting",
                redact(self.urls[self._address]),
                scrub(str(err) or type(err).__name__, self.urls),
                extra={"event": "amqp_departed"},
            )
        self.departed = True
        self._safe_close()
        self._deferred.clear()  # their channel is gone: they can be neither acked nor handled
        self._cancelled.clear()

    def _departure(self) -> Departed:
        """What ``process`` and every broker call raise once departed (one line, no password)."""
        addresses = ", ".join(redact(u) for u in self.urls)
        return Departed(f"the connection to {addresses} ended while winding down; not reconnecting")

    def _reconnect(self, err: BaseException) -> None:
        """After a loss: drop the connection and go on with the next address (winding down: one pass
        over them, then ``Departed``; see ``_connect``). Once departed, nothing is tried again."""
        if self.departed:
            raise self._departure()
        log.log(
            logging.INFO if self._winding_down else logging.WARNING,
            "broker connection lost at %s (%s); reconnecting%s",
            redact(self.urls[self._address]),
            scrub(str(err) or type(err).__name__, self.urls),
            " once (winding down)" if self._winding_down else "",
            extra={"event": "amqp_lost"},
        )
        self.faults += 1
        self._safe_close()
        self._address = (self._address + 1) % len(self.urls)
        self._connect()

    def _with_reconnect(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; after a lost connection reconnect (within the budget) and run it again.

        A refusal (403, 406) is raised as it is: no reconnect makes it succeed. If a handler already
        reconnected inside ``fn`` (the old connection then fails under it), the new connection is
        used as it is. A ``ValueError`` counts as a loss only when the connection is really closed
        (pika's ioloop, once closed, raises it from a timer it cannot schedule); otherwise it is a
        bug and raised. Once departed (see ``winding_down``) nothing is tried: ``Departed``.
        """
        deadline = time.monotonic() + self.options.reconnect_budget_s
        while True:
            if self.departed:
                raise self._departure()
            generation = self._generation
            try:
                return fn()
            except (*_CONNECTION_ERRORS, _PublishRefused, ValueError) as err:
                if isinstance(err, ValueError) and not self._closed():
                    raise
                if isinstance(err, pika.exceptions.ChannelClosedByBroker) and err.reply_code in _PERMANENT:
                    self._reset_channel()
                    raise
                if time.monotonic() > deadline:
                    raise BrokerUnavailable(
                        self._describe(f"still failing after reconnects: {err}")
                    ) from None
                if self._generation != generation and self._conn is not None and self._conn.is_open:
                    continue
                self._reconnect(err)

    def _reset_channel(self) -> None:
        """After a refusal closed the main channel: a fresh one, with the consumers on it again."""
        if self._conn is not None and self._conn.is_open and (self._ch is None or not self._ch.is_open):
            self._safe_close()
            self._connect()

    @property
    def channel(self) -> BlockingChannel:
        if self._ch is None:  # only after an exhausted reconnect budget, which raised already
            raise BrokerUnavailable(self._describe("not connected"))
        return self._ch

    # -- topology --------------------------------------------------------------------------------
    def _queue_mode(self, queue: str) -> QueueMode:
        """The configured mode, except for the updates queue while updates are transient: a lazy
        queue writes every body to disk on arrival, transient ones included, so it would cost the
        broker the very writes transient updates are meant to save (10,000 devices: rounds 5.6-6.1 s
        lazy against 4.8-5.3 s not, docs/broker.md "Transient updates"). A backlog then stays in
        RAM until RabbitMQ's memory watermark makes it page bodies out."""
        if queue == self.names.updates_queue and self.options.transient_updates:
            return "default"
        return self.options.queue_mode

    def _declare(self, queue: str, keys: Sequence[str]) -> None:
        args = queue_arguments(
            self.options.queue_type,
            self.names.dead_letter_exchange,
            self._expires.get(queue),
            self._queue_mode(queue),
        )
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
        deadline = time.monotonic() + self.options.reconnect_budget_s
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
                self._ch.add_on_cancel_callback(self._on_cancel)

    def unbind(self, queue: str, key: str) -> None:
        keys = self._queues.get(queue, [])
        if key in keys:
            keys.remove(key)  # a reconnect re-declares the queue without it
        self._with_reconnect(lambda: self.channel.queue_unbind(queue, self.names.exchange, routing_key=key))

    # -- publishing ------------------------------------------------------------------------------
    def _publish_channel(self) -> BlockingChannel:
        """The channel publishes go on (confirm mode), apart from the consumers' channel so that a
        refused publish that closes it costs no consumer its unacked deliveries."""
        if self._pub is None or not self._pub.is_open:
            if self._conn is None or not self._conn.is_open:
                raise pika.exceptions.ConnectionWrongStateError("not connected")
            self._pub = self._conn.channel()
            self._pub.confirm_delivery()
        return self._pub

    def _confirmed(
        self, exchange: str, key: str, body: bytes, props: BasicProperties, mandatory: bool
    ) -> None:
        """Publish and wait for the broker's confirm; a NACK or a channel the broker closed is
        retried on a fresh channel (bounded, counted); ``_PublishRefused`` once the retries are spent."""
        pause = 0.05
        for attempt in range(self.options.publish_retries + 1):
            try:
                self._publish_channel().basic_publish(exchange, key, body, props, mandatory=mandatory)
                return
            except pika.exceptions.UnroutableError as err:
                raise Unroutable(key) from err
            except pika.exceptions.NackError:
                reason = "nack"
            except (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ChannelWrongStateError) as err:
                if self._conn is None or not self._conn.is_open:
                    raise
                if isinstance(err, pika.exceptions.ChannelClosedByBroker) and err.reply_code in _PERMANENT:
                    self._pub = None
                    raise
                reason = "channel-closed"
            self._pub = None
            if attempt == self.options.publish_retries:
                break
            metrics.BROKER_PUBLISH_RETRIES.labels(self.names.experiment, reason).inc()
            log.warning(
                "the broker refused a publish (%s); retrying on a fresh channel",
                reason,
                extra={"event": "amqp_publish_retry", "reason": reason},
            )
            assert self._conn is not None
            self._conn.sleep(pause)
            pause = min(pause * 2, 1.0)
        raise _PublishRefused(f"publish to {key!r} refused {self.options.publish_retries + 1} times")

    def _delivery_mode(self, transient: bool) -> int:
        """1 (not stored by the broker) for what the sender may lose, when the options allow it."""
        return 1 if transient and self.options.transient_updates else 2

    def publish(
        self, key: str, body: bytes, headers: dict[str, Any] | None = None, *, transient: bool = False
    ) -> None:
        props = BasicProperties(
            delivery_mode=self._delivery_mode(transient), headers=headers or None, user_id=self.user
        )
        self._with_reconnect(lambda: self._confirmed(self.names.exchange, key, body, props, mandatory=True))

    def publish_reply(self, reply_to: str, body: bytes) -> None:
        # Not mandatory: RabbitMQ returns direct replies as unroutable even when they are delivered,
        # and pika would log the returned body — a reply may hold credentials. Direct reply-to goes
        # to the asking connection only, so it uses the channel the request came on (not confirmed).
        props = BasicProperties(user_id=self.user)
        self._with_reconnect(lambda: self.channel.basic_publish("", reply_to, body, props))

    def _batch_channel(self) -> BlockingChannel:
        """A second channel in AMQP transaction mode: a batch is committed (and, for durable queues,
        persisted) with one round trip. Mandatory returns arrive before the commit's reply."""
        if self._tx is None or self._tx_generation != self._generation or not self._tx.is_open:
            if self._conn is None:
                raise pika.exceptions.ConnectionWrongStateError("no connection")
            ch = self._conn.channel()
            ch.tx_select()
            # on the channel itself, not through BlockingChannel's event dispatch: a batch is often
            # published from inside a consumer's handler, where pika dispatches nothing (a nested
            # dispatch), so a return would be seen only by a later batch, and blamed on its keys
            ch._impl.add_on_return_callback(
                lambda _ch, method, _props, _body: self._returned.add(method.routing_key)
            )
            self._tx, self._tx_generation = ch, self._generation
        return self._tx

    def _commit_batch(self, items: Sequence[tuple[str, str, bytes, BasicProperties]]) -> set[str]:
        """One transaction of ``(exchange, key, body, properties)`` publishes, returning the routing
        keys the broker returned (they arrive before the commit's reply); a commit the broker
        fails (a leader election) is retried like a NACK."""
        self._publishing += 1  # a retry's pause pumps the connection: its deliveries wait
        try:
            return self._commit_batch_once(items)
        finally:
            self._publishing -= 1

    def _commit_batch_once(self, items: Sequence[tuple[str, str, bytes, BasicProperties]]) -> set[str]:
        for attempt in range(self.options.publish_retries + 1):
            try:
                ch = self._batch_channel()
                self._returned.clear()
                # the channel's own publish, not BlockingChannel's: that one flushes the socket
                # after every message (a poll and a send each); the commit below flushes them all
                # in order, then waits for its reply. Past TX_BUFFER_BYTES waiting the socket takes
                # them now: a fan-out of one large payload to many hosts holds a copy per host
                publish, impl = ch._impl.basic_publish, ch.connection._impl
                for exchange, key, body, props in items:
                    publish(exchange, key, body, props, mandatory=True)
                    if impl._get_write_buffer_size() > TX_BUFFER_BYTES:
                        ch._flush_output()
                ch.tx_commit()
                break
            except (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ChannelWrongStateError) as err:
                if self._conn is None or not self._conn.is_open:
                    raise
                if isinstance(err, pika.exceptions.ChannelClosedByBroker) and err.reply_code in _PERMANENT:
                    raise
                self._tx = None
                if attempt == self.options.publish_retries:
                    raise _PublishRefused(f"batch commit refused {attempt + 1} times") from err
                metrics.BROKER_PUBLISH_RETRIES.labels(self.names.experiment, "channel-closed").inc()
                log.warning(
                    "the broker failed a batch commit; retrying on a fresh channel",
                    extra={"event": "amqp_publish_retry", "reason": "channel-closed"},
                )
                self._conn.sleep(0.05 * 2 ** min(attempt, 4))
        return set(self._returned)

    def publish_many(self, items: Sequence[tuple[str, bytes]], *, transient: bool = False) -> set[str]:
        if self.options.queue_type == "quorum":
            # A transaction's commit is no promise that a quorum queue in the middle of a leader
            # election took the messages; a publisher confirm is. One confirm per message, then.
            return super().publish_many(items, transient=transient)
        props = BasicProperties(delivery_mode=self._delivery_mode(transient), user_id=self.user)
        exchange = self.names.exchange
        unroutable: set[str] = set()
        for chunk in _tx_chunks(items, TX_MAX_BYTES, size=lambda item: len(item[1])):
            # each chunk retried on its own: one that committed is not published again. A chunk
            # that fails for good (past the reconnect budget, a refusal) raises with the earlier
            # ones committed: the caller's deliveries are not acked, so they come back
            batch = [(exchange, key, body, props) for key, body in chunk]
            unroutable |= self._with_reconnect(functools.partial(self._commit_batch, batch))
        return unroutable

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
                    self._settle("ack", lambda: _ack_unflushed(chan, tag))

            def nack(requeue: bool) -> None:
                if generation == self._generation and chan.is_open:
                    self._settle("nack", lambda: chan.basic_nack(tag, requeue=requeue))

            d = Delivery(
                body=body,
                routing_key=method.routing_key or "",
                redelivered=bool(method.redelivered),
                headers=dict(props.headers or {}),
                user_id=props.user_id,
                reply_to=props.reply_to,
                _ack=ack,
                _nack=nack,
                generation=generation,
            )
            if self._publishing:
                self._deferred.append((handler, d))
            else:
                handler(d)

        tag = ch.basic_consume(queue, on_message, auto_ack=False)
        self._tags[tag] = (queue, handler, prefetch)

    def _settle(self, what: str, call: Callable[[], None]) -> None:
        """An ack or nack. If the connection closed under it (the broker's close frame is read only
        when pika flushes the ack), the broker redelivers the message, as after any lost connection:
        not the handler's error, and the next ``process`` deals with the loss. Any other failure
        (the connection still open) is raised."""
        try:
            call()
        except (*_CONNECTION_ERRORS, ValueError) as err:
            if not self._closed():
                raise
            log.info(
                "an %s went with the lost connection (%s); the broker delivers the message again",
                what,
                scrub(str(err) or type(err).__name__, self.urls),
                extra={"event": "amqp_settle_lost"},
            )

    def _on_cancel(self, frame: pika.frame.Method[Basic.Cancel]) -> None:
        """The broker cancelled a consumer (its queue's node or leader is gone). Noted here and
        re-subscribed from ``process``: pika calls this while it dispatches, not a place to block."""
        consumer = self._tags.pop(frame.method.consumer_tag, None)
        if consumer is not None:
            self.faults += 1
            self._cancelled.append(consumer)

    def _resubscribe(self) -> None:
        """Subscribe again what the broker cancelled; winding down, a cancelled consumer (its queue
        deleted with the host's user) is the end instead, never a queue declared again."""
        if self._cancelled and self._winding_down:
            queues = ", ".join(sorted({c[0] for c in self._cancelled}))
            self._end(f"the broker cancelled the consumer of {queues}")
            raise self._departure()
        while self._cancelled:
            queue, handler, prefetch = self._cancelled[0]
            metrics.BROKER_CONSUMER_CANCELS.labels(self.names.experiment).inc()
            log.warning(
                "the broker cancelled the consumer of %s; declaring it again and re-subscribing",
                queue,
                extra={"event": "amqp_consumer_cancelled"},
            )
            if queue in self._queues:
                self._declare(queue, self._queues[queue])
            self._start_consumer(queue, handler, prefetch)
            self._cancelled.pop(0)

    def consume(self, queue: str, handler: Handler, prefetch: int) -> None:
        self._consumers.append((queue, handler, prefetch))
        self._with_reconnect(lambda: self._start_consumer(queue, handler, prefetch))

    def process(self, timeout: float) -> None:
        if self.departed:
            raise self._departure()
        if self._deferred:  # what arrived during a publish comes first, in arrival order
            while self._deferred:  # a reconnect inside a handler empties it (see ``_open``)
                handler, delivery = self._deferred.popleft()
                handler(delivery)
            return

        def _run() -> None:
            if self._cancelled:
                self._resubscribe()
            if self._closed():  # it closed under a handler, which could only note it (see ``_settle``)
                raise pika.exceptions.ConnectionWrongStateError("the connection closed")
            assert self._conn is not None
            self._conn.process_data_events(time_limit=timeout)
            if self._cancelled:
                self._resubscribe()

        self._with_reconnect(_run)

    def _dead_letter_props(self, delivery: Delivery, reason: str, detail: str) -> BasicProperties:
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
        return BasicProperties(delivery_mode=2, headers=headers, user_id=self.user)

    def dead_letter_many(self, items: Sequence[tuple[Delivery, str, str]]) -> None:
        """The dead letters in one transaction, then the originals acked; what the batch cannot
        settle (a queue type whose commit promises nothing, no dead-letter queue, a refused commit)
        goes one by one through ``dead_letter``, which knows what to do in each case. A lost
        connection leaves every original unacknowledged, to be redelivered and handled again."""
        items = [it for it in items if not it[0].settled and self._current(it[0])]
        if len(items) < 2 or self.options.queue_type == "quorum":
            super().dead_letter_many(items)
            return
        # one transaction holds at most DEAD_LETTER_BATCH messages or DEAD_LETTER_BATCH_BYTES
        for chunk in _tx_chunks(
            items, DEAD_LETTER_BATCH_BYTES, size=lambda it: len(it[0].body), max_count=DEAD_LETTER_BATCH
        ):
            if not self._dead_letter_batch(chunk):
                return

    def _current(self, delivery: Delivery) -> bool:
        """Whether ``delivery`` came on this connection (a lost one's messages come back anyway)."""
        return delivery.generation is None or delivery.generation == self._generation

    def _dead_letter_batch(self, items: Sequence[tuple[Delivery, str, str]]) -> bool:
        """One transaction of dead letters, then their originals acked; False once the connection
        is lost (what is left stays unacknowledged, to come back)."""
        publishes = [
            (self.names.dead_letter_exchange, "", d.body, self._dead_letter_props(d, reason, detail))
            for d, reason, detail in items
        ]
        generation = self._generation
        try:
            returned = self._commit_batch(publishes)
        except (*_CONNECTION_ERRORS, _PublishRefused) as err:
            if self._closed():
                self._dead_letters_lost(err, f"{len(items)} dead letters", "")
                return False
            super().dead_letter_many(items)  # a refused commit: the lone path, item by item
            return generation == self._generation
        if returned:  # no dead-letter queue took them: the lone path declares it again or requeues
            super().dead_letter_many(items)
            return generation == self._generation
        if generation != self._generation:
            return False
        for d, _, _ in items:
            d.ack()
        return True

    def _dead_letters_lost(self, err: BaseException, what: str, reason: str) -> None:
        """Dead letters the broker did not take: logged, the connection renewed; their originals
        stay unacknowledged, so they come back and are handled (and dead-lettered) again."""
        log.error(
            "could not store %s (%s); left unacknowledged, to come back",
            what,
            scrub(str(err), self.urls),
            extra={"event": "amqp_dead_letter_failed", "reason": reason},
        )
        with contextlib.suppress(Departed):  # not the handler's business: ``process`` raises it next
            self._reconnect(err)

    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Publish to the dead-letter exchange (confirmed, mandatory), then ack the original.

        If the dead letter cannot be confirmed on this connection, the original is left
        unacknowledged: the lost connection returns it to its queue and it is handled (and
        dead-lettered) again, so a dead letter is never acked away without being stored.
        """
        if not self._current(delivery):
            return  # its connection is gone: the broker delivers it again, to be handled again
        props = self._dead_letter_props(delivery, reason, detail)
        generation = self._generation
        try:
            try:
                self._confirmed(self.names.dead_letter_exchange, "", delivery.body, props, mandatory=True)
            except Unroutable:
                if not self.declare_topology:
                    raise
                # someone deleted the dead-letter queue: the owner declares it again and retries
                self._declare_dead_letter_queue(self.channel)
                self._confirmed(self.names.dead_letter_exchange, "", delivery.body, props, mandatory=True)
        except Unroutable:
            log.error(
                "no dead-letter queue to take a %s message; it goes back to its queue",
                delivery.routing_key,
                extra={"event": "amqp_dead_letter_failed", "reason": reason},
            )
            delivery.nack(requeue=True)
            return
        except (*_CONNECTION_ERRORS, _PublishRefused) as err:
            self._dead_letters_lost(err, "a dead letter", reason)
            return
        if generation == self._generation:
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
            self._forget(queue)
            try:
                self.channel.queue_delete(queue)
            except pika.exceptions.ChannelClosedByBroker:
                self._ch = self._conn.channel()
        for ex in (self.names.exchange, self.names.dead_letter_exchange):
            try:
                self.channel.exchange_delete(ex)
            except pika.exceptions.ChannelClosedByBroker:
                self._ch = self._conn.channel()

    def _forget(self, queue: str) -> None:
        """Stop declaring and consuming ``queue``: the broker's ``basic.cancel`` that follows its
        deletion is then no reason to subscribe again (an aggregator deletes its queue at stop)."""
        self._queues.pop(queue, None)
        self._expires.pop(queue, None)
        self._consumers = [c for c in self._consumers if c[0] != queue]
        self._cancelled = [c for c in self._cancelled if c[0] != queue]
        self._tags = {tag: c for tag, c in self._tags.items() if c[0] != queue}

    def delete_queue(self, queue: str) -> None:
        self._forget(queue)
        self._with_reconnect(lambda: self.channel.queue_delete(queue))

    def _safe_close(self) -> None:
        try:
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        except Exception:  # the connection is already broken; nothing else to release
            pass
        self._conn = None
        self._ch = None
        self._pub = None

    def close(self) -> None:
        self._safe_close()


def _tx_chunks(
    items: Sequence[_Item],
    limit: int,
    *,
    size: Callable[[_Item], int],
    max_count: int | None = None,
) -> list[Sequence[_Item]]:
    """``items`` cut, in order, into runs of at most ``limit`` bytes (``size`` of each item) and
    ``max_count`` items, an item larger than ``limit`` alone: one transaction each (a batch's
    publishes, a turn's dead letters)."""
    chunks: list[Sequence[_Item]] = []
    start, total = 0, 0
    for i, item in enumerate(items):
        n = size(item)
        full = total + n > limit or (max_count is not None and i - start == max_count)
        if i > start and full:
            chunks.append(items[start:i])
            start, total = i, 0
        total += n
    if start < len(items):
        chunks.append(items[start:])
    return chunks
