"""Where every message kind travels: its routing keys, the queues bound to them, who sends, who reads.

Why one table: the same facts decide what the services publish (``ServiceBase`` refuses a kind on
a key not listed here), what each role's broker permissions allow (``shared.provision``), and what
the AsyncAPI document says (``shared.asyncapi``). Kept apart from the transport, which moves bytes
and need not know what they mean.

Routing-key patterns use ``{host}`` (a client host's id) and ``{aggregator}`` (an aggregator's id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.schemas import Kind
from shared.transport import KEY_AGGREGATORS, KEY_CLIENTS, KEY_JOIN, KEY_SERVER, KEY_UPDATE

HOST_KEY = "host.{host}"
AGGREGATOR_KEY = "agg.{aggregator}"
#: RabbitMQ's direct reply-to pseudo-queue: a join's answer reaches only the connection that asked
REPLY_TO = "amq.rabbitmq.reply-to"

#: kind → the routing keys it may be published with
ROUTES: dict[Kind, tuple[str, ...]] = {
    Kind.JOIN: (KEY_JOIN,),
    Kind.JOIN_REPLY: (REPLY_TO,),
    Kind.HEARTBEAT: (KEY_SERVER,),
    Kind.LEASE: (HOST_KEY,),
    Kind.PAYLOAD: (HOST_KEY,),
    Kind.FETCH: (KEY_SERVER,),
    Kind.DEVICE_STATE: (KEY_SERVER, HOST_KEY),
    Kind.ROUND_OPEN: (KEY_AGGREGATORS,),
    Kind.TASK: (HOST_KEY,),
    Kind.UPDATE: (KEY_UPDATE,),
    Kind.UPDATES: (KEY_UPDATE,),
    Kind.RECEIPT: (KEY_SERVER,),
    Kind.RECEIPTS: (KEY_SERVER,),
    Kind.REJECT: (KEY_SERVER,),
    Kind.FLUSH: (KEY_AGGREGATORS,),
    Kind.PARTIAL: (KEY_SERVER,),
    Kind.DECISION: (AGGREGATOR_KEY,),
    Kind.ROUND_SUMMARY: (KEY_AGGREGATORS,),
    Kind.STOP: (KEY_AGGREGATORS, KEY_CLIENTS),
    Kind.READY: (KEY_SERVER,),
    Kind.GO: (HOST_KEY,),
    Kind.EVALUATE: (HOST_KEY,),
    Kind.EVAL_RESULT: (KEY_SERVER,),
    Kind.GOS: (HOST_KEY,),
    Kind.TASKS: (HOST_KEY,),
    Kind.ANSWERS: (KEY_SERVER,),
}


#: kinds a broker restart may lose without harm beyond their round, published transient (see
#: ``Transport.publish``; ``RABBITMQ_UPDATE_DELIVERY=persistent`` makes them persistent too): a
#: device's update, one per device per round and the bulk of the bytes, alone or in a host's
#: ``updates``.
#: Losing it leaves its device silent in that round, as a crashed host does: the round completes
#: without it, or is lost and repeated if it merged nothing (docs/broker.md, "Transient updates").
#: Everything else (tasks a host has not read yet, leases, device state, round control) stays
#: persistent: a run relies on them beyond one round.
TRANSIENT_KINDS = frozenset({Kind.UPDATE, Kind.UPDATES})


@dataclass(frozen=True)
class Queue:
    """One queue an experiment declares: its name (``{exp}`` the experiment id), the routing keys it
    is bound with, the service that consumes it, and why it has its lifetime."""

    name: str
    bindings: tuple[str, ...]
    consumer: str
    declared_by: str
    expires: str = "never (durable)"


QUEUES: tuple[Queue, ...] = (
    Queue("ff.{exp}.server", (KEY_SERVER, KEY_JOIN), "server", "server"),
    Queue(
        "ff.{exp}.updates",
        (KEY_UPDATE,),
        "aggregator",
        "server",
        "never (durable; shared by all aggregators)",
    ),
    Queue(
        "ff.{exp}.agg.{aggregator}",
        (KEY_AGGREGATORS, AGGREGATOR_KEY),
        "aggregator",
        "aggregator",
        "600 s unused (named by the aggregator's identity, so a restart reuses it; "
        "bound to its session's key)",
    ),
    Queue(
        "ff.{exp}.client.{host}",
        (KEY_CLIENTS, HOST_KEY),
        "client",
        "client",
        "6 x hosts.lease_timeout_s unused, at least 60 s (a crashed host's queue goes)",
    ),
    Queue(
        "ff.{exp}.dead",
        ("(dead-letter exchange ff.{exp}.dlx)",),
        "people and `fedfleet report`",
        "every service",
    ),
)


def _pattern(route: str) -> re.Pattern[str]:
    parts = re.split(r"(\{host\}|\{aggregator\})", route)
    return re.compile("".join("[A-Za-z0-9_.:-]+" if p.startswith("{") else re.escape(p) for p in parts) + "$")


_COMPILED = {kind: tuple(_pattern(r) for r in routes) for kind, routes in ROUTES.items()}


def routable(kind: Kind, key: str) -> bool:
    """Whether ``kind`` may be published with routing key ``key`` (the table above)."""
    return any(p.match(key) for p in _COMPILED[kind])
