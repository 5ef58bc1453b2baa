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

#: the prefix of every fedfleet broker user (``FEDFLEET_USER_PREFIX``; one broker can then serve
#: several fedfleet deployments, or test sessions, whose users do not collide)
DEFAULT_PREFIX = "fedfleet-"
_prefix = DEFAULT_PREFIX


def configure(prefix: str) -> None:
    """Set the user-name prefix of this process's deployment (every process of it must agree)."""
    global _prefix
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", prefix):
        raise ValueError(f"user prefix {prefix!r}: use letters, digits, '_', '.', '-' (at most 41)")
    _prefix = prefix


def server_user() -> str:
    return f"{_prefix}server"


def aggregator_user() -> str:
    return f"{_prefix}aggregator"


def join_user() -> str:
    return f"{_prefix}join"


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
    return f"{_prefix}host-{host_id}"


_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


def identify(user: str | None) -> Sender:
    """The role of a broker user (``UNKNOWN`` for none or a foreign one)."""
    name = user or ""
    if name == server_user():
        return Sender(name, Role.SERVER)
    if name == aggregator_user():
        return Sender(name, Role.AGGREGATOR)
    if name == join_user():
        return Sender(name, Role.JOIN)
    host_prefix = f"{_prefix}host-"
    if name.startswith(host_prefix) and _HOST_ID.match(name[len(host_prefix) :]):
        return Sender(name, Role.HOST, name[len(host_prefix) :])
    return Sender(name, Role.UNKNOWN)


def strict(own_user: str | None) -> bool:
    """Whether a service logged in as ``own_user`` checks senders: only when it is itself a role
    user (in dev mode every service shares one user and roles cannot be told apart)."""
    return identify(own_user).role is not Role.UNKNOWN


_FROM_HOSTS = (
    Kind.HEARTBEAT,
    Kind.DEVICE_STATE,
    Kind.REJECT,
    Kind.READY,
    Kind.EVAL_RESULT,
    Kind.FETCH,
    Kind.ANSWERS,
)
_TO_AGGREGATORS = (Kind.ROUND_OPEN, Kind.FLUSH, Kind.DECISION, Kind.ROUND_SUMMARY, Kind.STOP)
_TO_HOSTS = (
    Kind.LEASE,
    Kind.DEVICE_STATE,
    Kind.PAYLOAD,
    Kind.TASK,
    Kind.TASKS,
    Kind.GO,
    Kind.GOS,
    Kind.EVALUATE,
    Kind.STOP,
)

#: receiving service → message kind → the one role allowed to send it there: the one table every
#: receiver checks (``ServiceBase.dispatch``)
ACCEPTS: dict[str, dict[Kind, Role]] = {
    "server": {
        **dict.fromkeys(_FROM_HOSTS, Role.HOST),
        Kind.RECEIPT: Role.AGGREGATOR,
        Kind.RECEIPTS: Role.AGGREGATOR,
        Kind.PARTIAL: Role.AGGREGATOR,
        Kind.JOIN: Role.JOIN,
    },
    "aggregator": {
        Kind.UPDATE: Role.HOST,
        Kind.UPDATES: Role.HOST,
        **dict.fromkeys(_TO_AGGREGATORS, Role.SERVER),
    },
    "client": dict.fromkeys(_TO_HOSTS, Role.SERVER),
}
