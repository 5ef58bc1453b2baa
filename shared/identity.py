"""Who sent a message: the broker user, which RabbitMQ validates, mapped to a fedfleet role.

Why the broker user: the envelope's ``sender`` field is whatever the sender wrote. RabbitMQ refuses a
publish whose ``user_id`` property is not the connection's own user, so a ``user_id`` on a delivery
is a fact the broker vouches for. Each role logs in as its own user, and every client host as a user
of its own (the server creates it when the host joins, see ``shared.provision``):

=========================== =============== ====================================================
broker user                 role            may send
=========================== =============== ====================================================
``fedfleet-server``         server          round_open, flush, decision, round_summary, stop,
                                            lease, device_state, task, go, evaluate, join_reply
``fedfleet-aggregator``     aggregator      receipt, partial
``fedfleet-host-<id>``      host ``<id>``   heartbeat, device_state, reject, ready, update,
                                            eval_result — for the devices it holds a lease of
``fedfleet-join``           join            join (asking for a host user of its own)
=========================== =============== ====================================================

**Dev mode.** A run whose services all log in as one user (RabbitMQ's ``guest``, the in-process
broker without users) cannot tell roles apart: role, lease and sender checks are then off, and every
service says so once at start. Anything else is *strict*.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from shared.schemas import Kind

#: the prefix of every fedfleet broker user
PREFIX = "fedfleet-"
SERVER_USER = f"{PREFIX}server"
AGGREGATOR_USER = f"{PREFIX}aggregator"
JOIN_USER = f"{PREFIX}join"
HOST_PREFIX = f"{PREFIX}host-"
_HOST = re.compile(rf"^{re.escape(HOST_PREFIX)}([A-Za-z0-9][A-Za-z0-9_.:-]*)$")


class Role(StrEnum):
    SERVER = "server"
    AGGREGATOR = "aggregator"
    HOST = "host"
    JOIN = "join"
    #: no user, or one that is not a fedfleet role user
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Sender:
    user: str
    role: Role
    #: the host id of a host user (None otherwise)
    host_id: str | None = None

    def __str__(self) -> str:
        return self.user or "(no user)"


def host_user(host_id: str) -> str:
    return f"{HOST_PREFIX}{host_id}"


def identify(user: str | None) -> Sender:
    """The role of a broker user (``UNKNOWN`` for none or a foreign one)."""
    name = user or ""
    if name == SERVER_USER:
        return Sender(name, Role.SERVER)
    if name == AGGREGATOR_USER:
        return Sender(name, Role.AGGREGATOR)
    if name == JOIN_USER:
        return Sender(name, Role.JOIN)
    m = _HOST.match(name)
    if m:
        return Sender(name, Role.HOST, m.group(1))
    return Sender(name, Role.UNKNOWN)


def strict(own_user: str | None) -> bool:
    """Whether a service logged in as ``own_user`` checks senders: only when it is itself a role
    user (in dev mode every service shares one user and roles cannot be told apart)."""
    return identify(own_user).role is not Role.UNKNOWN


_FROM_HOSTS = (Kind.HEARTBEAT, Kind.DEVICE_STATE, Kind.REJECT, Kind.READY, Kind.EVAL_RESULT)
_TO_AGGREGATORS = (Kind.ROUND_OPEN, Kind.FLUSH, Kind.DECISION, Kind.ROUND_SUMMARY, Kind.STOP)
_TO_HOSTS = (Kind.LEASE, Kind.DEVICE_STATE, Kind.TASK, Kind.GO, Kind.EVALUATE, Kind.STOP)

#: receiving service → message kind → the one role allowed to send it there: the one table every
#: receiver checks (``ServiceBase.dispatch``)
ACCEPTS: dict[str, dict[Kind, Role]] = {
    "server": {
        **dict.fromkeys(_FROM_HOSTS, Role.HOST),
        Kind.RECEIPT: Role.AGGREGATOR,
        Kind.PARTIAL: Role.AGGREGATOR,
        Kind.JOIN: Role.JOIN,
    },
    "aggregator": {Kind.UPDATE: Role.HOST, **dict.fromkeys(_TO_AGGREGATORS, Role.SERVER)},
    "client": dict.fromkeys(_TO_HOSTS, Role.SERVER),
}
