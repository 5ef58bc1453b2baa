"""What every service shares: structured logging, decode-or-dead-letter, counted publishing, the loop.

Why here and not in each service: "no message can crash a service" and "every byte published is
counted" must hold for all three services in the same way, so the code that guarantees them exists
once. Services stay thin: they own their state machine, this module owns the plumbing.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from shared import codec, metrics
from shared.codec.tensorset import LayoutCache
from shared.identity import ACCEPTS, Role, Sender, identify, strict
from shared.schemas import (
    ANSWER_KINDS,
    MAX_ANSWERS,
    MAX_UPDATES,
    Answers,
    DecodeError,
    Envelope,
    Heartbeat,
    Kind,
    RoundOpen,
    Updates,
    decode,
    encode,
)
from shared.schemas import _Body as Body
from shared.schemas.peers import PeerVersions
from shared.topology import TRANSIENT_KINDS, routable
from shared.transport import KEY_SERVER, KEY_UPDATE, Delivery, Transport, Unroutable, key_host


class PublishItem(NamedTuple):
    """One message of a batch (``ServiceBase._publish_many``), or of a service's outbox, waiting for
    ``flush``."""

    kind: Kind
    key: str
    data: bytes
    #: dense-equivalent bytes of its tensors
    dense: int = 0
    #: a bundle's entries (``Bundling``): the bytes of the messages of each kind it carries, counted
    #: under that kind; the bundle's own framing is counted under ``kind``
    inner: Mapping[Kind, int] | None = None
    #: in an outbox, the deliveries it answers, acked once it is published (one, or those of every
    #: message a bundle carries); ``_publish_many`` does not look at them
    answers: tuple[Delivery, ...] = ()


#: message kinds → the ``direction`` label of traffic metrics
DIRECTION = {
    Kind.TASK: "down",
    Kind.TASKS: "down",
    Kind.EVALUATE: "down",
    Kind.UPDATE: "up",
    Kind.UPDATES: "up",
    Kind.PARTIAL: "partial",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: grep-able by humans, parseable by log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in ("event", "service", "round", "device", "reason", "experiment") or key.startswith("f_"):
                out[key.removeprefix("f_")] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The transport logs every connection loss, retry and reconnect itself, with the address in use
    # and passwords redacted; pika's own records repeat them as errors with tracebacks attached.
    logging.getLogger("pika").setLevel(logging.CRITICAL)


MessageHandler = Callable[[Envelope, Any, Delivery], None]

#: ``publish_soon`` flushes once this many messages wait: one broker commit per 8 messages, while
#: whoever they go to starts on them early. (A client host has its own rule, by the bytes and the
#: age of its uploads: ``Client.outbox_full``.)
OUTBOX_LIMIT = 8


@dataclass(frozen=True)
class Bundling:
    """Messages a flush sends as one bundle of their complete encodings: which (``kinds`` on
    ``key``), as what (``kind``, whose body is ``body(entries)``), and at most how many a bundle.

    Why bundles: every message costs the broker a write, a delivery and an ack, and its two ends a
    frame each, whatever its size; a host's flush holds many small answers (``answers``) or a few
    updates (``updates``). Each entry stays the message its device would have sent alone (its MAC
    included); the receiver handles it as that message (``shared.transport.split``)."""

    kinds: frozenset[Kind]
    key: str
    kind: Kind
    body: Callable[[list[bytes]], Body]
    max_entries: int

    def __post_init__(self) -> None:
        # what goes to a host may be rewritten for its schema version (``PeerVersions.outgoing``),
        # and a bundle's entries (their MACs, the sizes counted: ``PublishItem.inner``) cannot be
        if self.key.startswith(key_host("")):
            raise ValueError(f"a bundle never goes to a host's key ({self.key!r})")


#: a host's devices' answers to the server (``ready``, ``reject``, ``eval_result``)
ANSWERS_BUNDLE = Bundling(ANSWER_KINDS, KEY_SERVER, Kind.ANSWERS, lambda m: Answers(messages=m), MAX_ANSWERS)
#: a host's devices' updates to the aggregators
UPDATES_BUNDLE = Bundling(
    frozenset({Kind.UPDATE}), KEY_UPDATE, Kind.UPDATES, lambda m: Updates(messages=m), MAX_UPDATES
)


class ServiceBase:
    """Decoding, dead-lettering and counted publishing for one service."""

    service: str = "service"

    def __init__(self, transport: Transport, experiment: str, algorithm: str, max_bytes: int) -> None:
        self.transport = transport
        self.experiment = experiment
        self.algorithm = algorithm
        self.max_bytes = max_bytes
        self.log = logging.getLogger(f"fedfleet.{self.service}")
        self.stopped = False
        #: message bytes this service put on, and took off, the broker (its share of broker traffic)
        self.bytes_published = 0
        self.bytes_consumed = 0
        #: what ``flush`` sends as bundles (a client host's answers and updates: ``Bundling``)
        self.bundling: tuple[Bundling, ...] = ()
        #: tensor-set layouts learned from the server (what a message may name by digest)
        self.layouts = LayoutCache()
        #: the schema version each host speaks: what is addressed to a host goes in its version
        self.peers = PeerVersions()
        #: messages queued by ``publish_soon`` (or ``_queue``) and not yet published (``flush``)
        self.outbox: list[PublishItem] = []
        #: of the outbox: the ids of the deliveries it answers (alive while it holds them), its
        #: uploads (how many, their bytes, when the oldest was queued), and when its oldest message
        #: was queued. Kept as it fills, not scanned per call: a host's outbox may hold a whole
        #: ``tasks`` message's answers (thousands)
        self._answering: set[int] = set()
        self._uploads = 0
        self._upload_bytes = 0
        self.uploads_since: float | None = None
        #: this turn's dead letters, stored together after its messages are handled (None: outside
        #: a turn, each one is stored as it is rejected)
        self._rejects: list[tuple[Delivery, str, str]] | None = None
        self.outbox_since: float | None = None
        #: senders are checked (role, lease) unless every service shares one broker user (dev mode)
        self.strict = strict(transport.user)
        if not self.strict:
            self.log.warning(
                "dev mode: logged in as broker user %r, not a fedfleet role user, so sender roles, "
                "host leases and per-host identities are NOT checked (docs/security.md, 'Dev mode')",
                transport.user or "(none)",
                extra={"event": "dev_mode"},
            )

    # -- receiving -------------------------------------------------------------------------------
    def dispatch(
        self, delivery: Delivery, handlers: Mapping[Kind, MessageHandler], *, entry: bool = False
    ) -> None:
        """Decode, check and route one delivery; anything wrong goes to the dead-letter queue.

        ``entry``: the delivery is one message of a bundle (``answers``, ``updates``:
        ``shared.transport.split``), whose bytes were counted as the bundle was received; it gets
        every check a lone one gets."""
        if not entry:
            metrics.RECEIVED_BYTES.labels(self.experiment, self.service, "any").inc(len(delivery.body))
            self.bytes_consumed += len(delivery.body)
        if len(delivery.body) > self.max_bytes:
            self.reject(delivery, "oversized", f"{len(delivery.body)} bytes > limit {self.max_bytes}")
            return
        try:
            env, body = decode(
                delivery.body, max_bytes=self.max_bytes, exp=self.experiment, layouts=self.layouts
            )
        except DecodeError as err:
            if err.reason == "unknown-layout" and err.env is not None:
                self.unknown_layout(err.env, delivery, str(err))
            else:
                self.reject(delivery, err.reason, str(err))
            return
        handler = handlers.get(env.kind)
        if handler is None:
            self.reject(delivery, "unexpected-kind", f"{self.service} does not accept {env.kind.value}")
            return
        sender = self.sender(delivery)
        allowed = ACCEPTS[self.service].get(env.kind)
        if self.strict and sender.role is not allowed:
            self.reject(
                delivery,
                "wrong-sender",
                f"{env.kind.value} from {sender} ({sender.role.value}); only a {allowed} may send it",
            )
            return
        if sender.role is Role.SERVER or not self.strict:
            self._learn_layouts(env, body)
        # a host's version, from its broker user (or, in dev mode, from the heartbeat's own word)
        host = sender.host_id if self.strict else body.host_id if isinstance(body, Heartbeat) else None
        if host:
            self.peers.learn(host, env.v)
        self.handle(handler, env, body, delivery)

    def handle(self, handler: MessageHandler, env: Envelope, body: Any, delivery: Delivery) -> None:
        """Run ``handler`` on one message (or one entry of a message that carries several, with its
        own delivery: ``shared.transport.split``); what it raises dead-letters that delivery alone."""
        try:
            handler(env, body, delivery)
        except codec.CodecError as err:
            self.reject(delivery, err.reason if err.reason != "malformed" else "tensor", str(err))
        except Exception as err:  # a bug or an unforeseen input must not kill the service
            metrics.HANDLER_ERRORS.labels(self.experiment, self.service, env.kind.value).inc()
            self.log.exception(
                "handler failed", extra={"event": "handler_error", "reason": type(err).__name__}
            )
            self.reject(delivery, "handler-error", f"{type(err).__name__}: {err}")

    def _learn_layouts(self, env: Envelope, body: Any) -> None:
        """Remember the layouts the server sent (inline in a payload, or listed in a round's
        announcement), so later messages may name them by digest. Only the server's: a layout a
        device made up is used for its own message and not kept (nobody can crowd the cache)."""
        for layout in env.layouts:
            self.layouts.learn(layout)
        if isinstance(body, RoundOpen):
            for layout in body.layouts:
                self.layouts.learn(layout)

    def unknown_layout(self, env: Envelope, delivery: Delivery, detail: str) -> None:
        """A message naming a tensor layout this service was not told about. By default that is a
        bad message; an aggregator that has not yet seen the round's announcement waits instead."""
        self.reject(delivery, "unknown-layout", detail)

    @staticmethod
    def sender(delivery: Delivery) -> Sender:
        """Who published ``delivery``, as the broker vouches for it (``user_id``)."""
        return identify(delivery.user_id)

    def reject(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Dead-letter ``delivery`` with ``reason``: at once outside a turn, else at the turn's end.

        It is counted (``fedfleet_dead_letters_total``) and logged when it goes to the transport to
        be stored, not here: a bundle entry refused early in a turn whose bundle a sibling then
        puts back is settled by that (``split``) and stored nowhere, and a second refusal of the
        same delivery stores nothing more. Counted here, both showed dead letters that
        ``dead_letters.jsonl`` and the dead-letter queue never held. (One the transport cannot
        store because its connection was lost comes back, is refused again and counted again: at
        least once, as the letters themselves. ``fedfleet_update_bounds_total`` still counts each
        refusal of an out-of-bounds update, a put-back one's twice.)"""
        if delivery.settled or delivery.doomed:  # stored, or to be stored at the turn's end
            return
        if self._rejects is None:
            self._store_rejects([(delivery, reason, detail)])
        else:
            delivery.doomed = True  # nobody acks or requeues it before its dead letter is stored
            self._rejects.append((delivery, reason, detail))

    def _store_rejects(self, rejects: list[tuple[Delivery, str, str]]) -> None:
        """Store the dead letters of those of ``rejects`` nothing settled meanwhile; count and log them."""
        stored = [r for r in rejects if not r[0].settled]
        for _, reason, detail in stored:
            metrics.DEAD_LETTERS.labels(self.experiment, self.service, reason).inc()
            self.log.warning(
                "dead-lettered a message: %s", detail, extra={"event": "dead_letter", "reason": reason}
            )
        if stored:
            self.transport.dead_letter_many(stored)

    # -- sending ---------------------------------------------------------------------------------
    def send(
        self,
        key: str,
        kind: Kind,
        body: Body,
        *,
        round: int,
        inc: str = "",
        dense_bytes: int = 0,
        sender: str | None = None,
        mac_key: str = "",
        known: Mapping[bytes, Any] | None = None,
    ) -> int:
        """Encode, publish (confirmed) and count one message; returns its wire size in bytes.

        ``mac_key``: a device's task key — the message then carries a MAC of its bytes.
        ``known``: layouts the receiver knows, by digest (its tensors may name theirs by reference).
        """
        data = encode(
            kind,
            body,
            exp=self.experiment,
            round=round,
            sender=self.service if sender is None else sender,
            inc=inc,
            key=mac_key,
            known=known,
        )
        return self.publish_raw(key, kind, data, dense_bytes=dense_bytes)

    def publish_soon(
        self,
        key: str,
        kind: Kind,
        data: bytes,
        *,
        dense_bytes: int = 0,
        answers: Delivery | None = None,
    ) -> None:
        """``publish_raw`` at the next ``flush`` (at once when ``outbox_full``: by default when
        :data:`OUTBOX_LIMIT` messages wait).

        ``answers``: the delivery this message is the answer to. It is acked only after the message
        is published, so a crash before that leaves the delivery to be redelivered and answered
        again (at least once, as with ``publish_raw`` then ack). If no queue took the message, the
        delivery is dead-lettered ``unroutable`` instead, as a handler raising ``Unroutable`` would.

        Why: a client host waited for one publisher confirm per update it uploaded, a broker round
        trip per device (issue 16's profile: a fifth of a client's time); this is one commit per
        batch.
        """
        self._queue(key, kind, data, dense_bytes=dense_bytes, answers=answers)
        if self.outbox_full():
            self.flush()

    def _queue(
        self, key: str, kind: Kind, data: bytes, *, dense_bytes: int = 0, answers: Delivery | None = None
    ) -> None:
        """Put a message in the outbox and never publish now, even when it is full: for a caller
        whose messages must go in one transaction and that flushes them itself (an aggregator's
        partial and its receipts, ``Aggregator._send``)."""
        _check_route(kind, key)
        if not self.outbox:
            self.outbox_since = time.monotonic()
        self.outbox.append(
            PublishItem(kind, key, data, dense_bytes, answers=() if answers is None else (answers,))
        )
        if answers is not None:
            self._answering.add(id(answers))
        if kind is Kind.UPDATE:
            if not self._uploads:
                self.uploads_since = time.monotonic()
            self._uploads += 1
            self._upload_bytes += len(data)

    def outbox_full(self) -> bool:
        """Whether ``publish_soon`` flushes now: :data:`OUTBOX_LIMIT` messages wait."""
        return len(self.outbox) >= OUTBOX_LIMIT

    def ack_unless_queued(self, d: Delivery) -> None:
        """Ack ``d`` now, unless a message waiting for the flush answers it: the flush acks it then
        (``publish_soon``'s ``answers``)."""
        if id(d) not in self._answering:
            d.ack()

    def flush(self) -> None:
        """Publish what ``publish_soon`` / ``_queue`` queued, in the order it was queued: one
        transaction for the persistent messages and one for the transient ones (updates); then ack
        the deliveries they answer."""
        try:
            self._flush()
        finally:  # what a failed publish left queued (normally nothing)
            self._answering = {id(d) for o in self.outbox for d in o.answers}
            # what a failed publish left, bundled or not (``_bundle`` ran first): its uploads still
            # count towards the next flush (``Client.outbox_full``)
            uploads = [_uploads_in(o) for o in self.outbox]
            self._uploads, self._upload_bytes = sum(n for n, _ in uploads), sum(b for _, b in uploads)
            self.outbox_since = time.monotonic() if self.outbox else None
            self.uploads_since = self.outbox_since if self._uploads else None

    def _flush(self) -> None:
        for bundling in self.bundling:
            self._bundle(bundling)
        while self.outbox:
            # one broker transaction for every queued message stored alike (all but updates are
            # persistent), in the order they were queued: what one turn sends together lands
            # together or not at all (an aggregator's partial and the receipts of its updates), up
            # to ``shared.transport.amqp.TX_MAX_BYTES`` (past it, several transactions in order)
            transient = self.outbox[0].kind in TRANSIENT_KINDS
            batch = [o for o in self.outbox if (o.kind in TRANSIENT_KINDS) is transient]
            self.outbox = [o for o in self.outbox if (o.kind in TRANSIENT_KINDS) is not transient]
            unroutable = self._publish_many(batch)
            lost = [o for o in batch if o.key in unroutable]
            for kind in dict.fromkeys(o.kind for o in lost):
                # the same as a ``send`` raising Unroutable: nobody is bound for the key (a server
                # that is gone); said, not silently dropped
                self.log.error(
                    "%d %s messages had no queue to go to (%s)",
                    sum(o.kind is kind for o in lost),
                    kind.value,
                    ", ".join(sorted({o.key for o in lost if o.kind is kind})),
                    extra={"event": "unroutable", "reason": kind.value},
                )
            for o in batch:
                for d in o.answers:
                    if o.key in unroutable:
                        self.reject(d, "unroutable", f"no queue took its {o.kind.value} ({o.key!r})")
                    else:
                        d.ack()

    def _bundle(self, bundling: Bundling) -> None:
        """Put the outbox's messages that ``bundling`` covers into bundles of at most
        ``bundling.max_entries`` entries and half the largest message a service takes
        (``processes.max_message_bytes``), where the first of them was; a message that would be
        a bundle's only entry stays alone. Each carries the answered deliveries of its messages:
        acked once it is published, dead-lettered ``unroutable`` if nobody took it, as each alone
        would have been."""
        picked = [o for o in self.outbox if o.key == bundling.key and o.kind in bundling.kinds]
        if not picked:
            return
        chunks: list[list[PublishItem]] = [[]]
        size = 0
        for o in picked:
            full = len(chunks[-1]) == bundling.max_entries or size + len(o.data) > self.max_bytes // 2
            if chunks[-1] and full:
                chunks.append([])
                size = 0
            chunks[-1].append(o)
            size += len(o.data) + 5  # with its bin frame
        bundles = []
        for chunk in chunks:
            if len(chunk) == 1:
                # alone, as it is: a bundle of one only adds its framing (and, for a message near
                # ``max_message_bytes``, could push it past the limit)
                bundles.append(chunk[0])
                continue
            body = bundling.body([o.data for o in chunk])
            data = encode(bundling.kind, body, exp=self.experiment, round=0, sender="")
            answered = tuple(d for o in chunk for d in o.answers)
            inner: dict[Kind, int] = {}
            for o in chunk:
                inner[o.kind] = inner.get(o.kind, 0) + len(o.data)
            dense = sum(o.dense for o in chunk)
            bundles.append(PublishItem(bundling.kind, bundling.key, data, dense, inner, answered))
        ids = {id(o) for o in picked}
        outbox: list[PublishItem] = []
        for o in self.outbox:
            if id(o) not in ids:
                outbox.append(o)
            elif o is picked[0]:
                outbox += bundles
        self.outbox = outbox

    def publish_raw(self, key: str, kind: Kind, data: bytes, *, dense_bytes: int = 0) -> int:
        """Publish an already-encoded message and count it — the one place wire bytes are counted,
        and where a message for a host of the previous schema version is rewritten in it."""
        _check_route(kind, key)
        data = self.peers.outgoing(key, data, exp=self.experiment, layouts=self.layouts)
        try:
            self.transport.publish(key, data, transient=kind in TRANSIENT_KINDS)
        except Unroutable:
            metrics.UNROUTABLE.labels(self.experiment, self.service, kind.value).inc()
            raise
        self.bytes_published += len(data)
        labels = (self.experiment, self.algorithm, self.service, DIRECTION.get(kind, "control"), kind.value)
        metrics.WIRE_BYTES.labels(*labels).inc(len(data))
        metrics.MESSAGES.labels(*labels).inc()
        if dense_bytes:
            metrics.DENSE_BYTES.labels(*labels).inc(dense_bytes)
        return len(data)

    def _publish_many(self, items: list[PublishItem]) -> set[str]:
        """Publish messages of any kinds stored alike (``TRANSIENT_KINDS``), in order, in one broker
        round trip (several past ``TX_MAX_BYTES``), and count the routed ones. Returns the keys
        nobody was bound for (those messages were not delivered and are not counted).

        A bundle counts as one message of its kind; its bytes count as the messages it carries
        (``PublishItem.inner``: ``fedfleet_wire_bytes_total{kind="update"}`` is every update's
        bytes, bundled or not), and its own framing as its kind."""
        if not items:
            return set()
        transient = {item.kind in TRANSIENT_KINDS for item in items}
        if len(transient) > 1:
            raise ValueError("one batch cannot mix transient and persistent messages")
        rewritten = []
        for item in items:
            _check_route(item.kind, item.key)
            data = self.peers.outgoing(item.key, item.data, exp=self.experiment, layouts=self.layouts)
            rewritten.append(item._replace(data=data))
        items = rewritten
        unroutable = self.transport.publish_many(
            [(item.key, item.data) for item in items], transient=transient == {True}
        )
        # counted per kind, not per message: a fan-out carries a message per host and device
        sent: dict[Kind, list[int]] = {}  # kind → [messages, bytes, dense bytes]

        def tally(kind: Kind, count: int, size: int, dense: int) -> None:
            total = sent.setdefault(kind, [0, 0, 0])
            total[0] += count
            total[1] += size
            total[2] += dense

        for item in items:
            if item.key in unroutable:
                metrics.UNROUTABLE.labels(self.experiment, self.service, item.kind.value).inc()
                continue
            carried = item.inner or {}
            for kind, size in carried.items():
                tally(kind, 0, size, 0)
            # the tensors' dense bytes go with the messages that carry them (a bundle's, with its
            # entries when they are all of one kind: updates)
            dense_kind = next(iter(carried)) if len(carried) == 1 else item.kind
            tally(dense_kind, 0, 0, item.dense)
            tally(item.kind, 1, len(item.data) - sum(carried.values()), 0)
        for kind, (count, size, dense) in sent.items():
            labels = (
                self.experiment,
                self.algorithm,
                self.service,
                DIRECTION.get(kind, "control"),
                kind.value,
            )
            self.bytes_published += size
            metrics.WIRE_BYTES.labels(*labels).inc(size)
            if count:
                metrics.MESSAGES.labels(*labels).inc(count)
            if dense:
                metrics.DENSE_BYTES.labels(*labels).inc(dense)
        return unroutable

    # -- the loop --------------------------------------------------------------------------------
    def terminate(self) -> None:
        """SIGTERM: stop after the current message (a client host hands its devices back first).

        Runs in the signal handler (``services/cli.py``), which may interrupt a publish between its
        frames: an override sets flags for the loop and never touches the broker itself."""
        self.stopped = True

    def tick(self) -> None:
        """Timers (deadlines, heartbeats); called between batches of deliveries."""

    def turn(self, poll_s: float) -> None:
        """One turn of the loop: handle what is ready (waiting up to ``poll_s`` for it), publish what
        that queued (``flush``), run the timers.

        The turn's dead letters (its messages' and its flush's) are stored together at its end
        (one broker round trip, ``Transport.dead_letter_many``), not one confirmed publish each: a
        burst of bad messages must not stall the service. Their originals are acked only after
        that, and nothing acks or requeues them before (``Delivery.doomed``); if handling raises,
        they stay unacknowledged and come back with the lost connection."""
        rejects: list[tuple[Delivery, str, str]] = []
        self._rejects = rejects
        try:
            self.transport.process(poll_s)
            self.flush()
        finally:
            self._rejects = None
        if rejects:
            for delivery, _, _ in rejects:
                delivery.doomed = False
            self._store_rejects(rejects)
        self.tick()

    def run(self, poll_s: float = 0.05) -> None:
        while not self.stopped:
            self.turn(poll_s)


def _uploads_in(item: PublishItem) -> tuple[int, int]:
    """How many updates an outbox item carries and their bytes: a lone update, or an ``updates``
    bundle (one answered task per update it carries)."""
    if item.kind is Kind.UPDATE:
        return 1, len(item.data)
    if item.kind is Kind.UPDATES:
        return max(len(item.answers), 1), (item.inner or {}).get(Kind.UPDATE, len(item.data))
    return 0, 0


def _check_route(kind: Kind, key: str) -> None:
    """Every kind travels on the routing keys ``shared.topology.ROUTES`` names (what the AsyncAPI
    document and the broker permissions say); anything else is a bug, caught where it happens."""
    if not routable(kind, key):
        raise ValueError(f"{kind.value} may not be published with routing key {key!r} (shared/topology.py)")


def encode_tensors(tensors: dict[str, codec.Tensor]) -> tuple[dict[str, dict[str, Any]], int]:
    """Codec-encode named tensors; returns the encoded dicts and their dense-equivalent bytes."""
    return {k: codec.encode(t) for k, t in tensors.items()}, sum(
        codec.dense_bytes(t) for t in tensors.values()
    )


def decode_tensors(encoded: dict[str, dict[str, Any]]) -> dict[str, codec.Tensor]:
    return {k: codec.decode(v) for k, v in encoded.items()}


def now() -> float:
    return time.time()
