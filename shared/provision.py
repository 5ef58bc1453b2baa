"""Broker users for client hosts, made by the server when a host joins (RabbitMQ management API).

Why per-host users: the broker vouches for a message's ``user_id`` — but only for users. With one
shared client user, any client process could speak for any host. So a client process starts with
the *join* user, which may do one thing: publish a ``join`` request whose answer comes back on
RabbitMQ's direct reply-to pseudo-queue (only the asking connection can read it). The server then
creates a user for that host alone, with the least that works:

* **configure** its own queue ``ff.<E>.client.<host>`` (declare it; delete it on leave) — nothing else;
* **write** the experiment's exchange and dead-letter exchange (publish), its queue (bind);
* **read** the exchange (bind) and its own queue (consume);
* **topic** permissions on ``ff.<E>``: publish only ``server`` and ``update``; bind only ``clients`` and
  ``host.<host>`` — so it can read nothing addressed to another host, nor round keys meant for
  aggregators, and cannot send as the server or an aggregator.

The host logs in again as that user; when it leaves or its lease expires, the server deletes the user
and its queue. A restarted server finds the experiment's host users on the broker (``host_ids``) and
deletes them by the same rules. Every regex lives here once: ``deploy/k8s/generate.py`` writes the
Kubernetes broker definitions of the fixed roles from ``role_permissions`` (``tests/test_deploy.py``,
``test_definitions_are_what_provision_says``, checks they agree).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from shared import identity
from shared.schemas import Join, JoinReply, Kind, decode, encode
from shared.transport import KEY_JOIN, names


class ProvisionError(RuntimeError):
    """The broker's management API refused or failed (message carries no password)."""


@dataclass(frozen=True)
class Permissions:
    configure: str
    write: str
    read: str
    #: topic permissions on the experiment's exchange (publish / bind routing keys)
    topic_write: str
    topic_read: str


def _e(experiment: str) -> str:
    return re.escape(names(experiment).exchange)


def host_permissions(experiment: str, host_id: str) -> Permissions:
    ex, q = _e(experiment), re.escape(names(experiment).client_queue(host_id))
    return Permissions(
        configure=f"^{q}$",
        write=f"^({ex}|{ex}\\.dlx|{q})$",
        read=f"^({ex}|{q})$",
        topic_write="^(server|update)$",
        topic_read=f"^(clients|host\\.{re.escape(host_id)})$",
    )


def role_permissions(experiment: str) -> dict[str, Permissions]:
    """The fixed roles' permissions (what the Kubernetes definitions give the role users)."""
    ex = _e(experiment)
    agg = f"{ex}\\.agg\\..+"
    return {
        identity.server_user(): Permissions(
            configure=f"^{ex}(\\..+)?$",
            write=f"^({ex}(\\..+)?|amq\\.default)$",
            read=f"^{ex}(\\..+)?$",
            topic_write="^(aggregators|clients|host\\..+|agg\\..+)$",
            topic_read="^(server|update|join)$",
        ),
        identity.aggregator_user(): Permissions(
            configure=f"^{agg}$",
            write=f"^({ex}|{ex}\\.dlx|{agg})$",
            read=f"^({ex}|{ex}\\.updates|{agg})$",
            topic_write="^server$",
            topic_read="^(aggregators|agg\\..+)$",
        ),
        identity.join_user(): Permissions(
            configure="^$", write=f"^{ex}$", read="^$", topic_write="^join$", topic_read="^$"
        ),
    }


class BrokerAdmin:
    """The few management-API calls the server needs: host users, their permissions, their queues."""

    def __init__(self, url: str, vhost: str = "/", timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProvisionError(
                f"broker admin URL must be http(s)://user:password@host:port, got {_safe(url)}"
            )
        self.base = f"{parts.scheme}://{parts.hostname}:{parts.port or 15672}"
        user = urllib.parse.unquote(parts.username or "")
        password = urllib.parse.unquote(parts.password or "")
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.vhost = vhost
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", self._auth)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s):
                return
        except urllib.error.HTTPError as err:
            if method == "DELETE" and err.code == 404:
                return
            raise ProvisionError(f"{method} {self.base}{path}: HTTP {err.code} {err.reason}") from None
        except OSError as err:
            raise ProvisionError(f"{method} {self.base}{path}: {err}") from None

    def _v(self) -> str:
        return urllib.parse.quote(self.vhost, safe="")

    def _get(self, path: str) -> Any:
        req = urllib.request.Request(self.base + path, method="GET")
        req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise ProvisionError(f"GET {self.base}{path}: HTTP {err.code} {err.reason}") from None
        except OSError as err:
            raise ProvisionError(f"GET {self.base}{path}: {err}") from None
        except ValueError as err:  # not JSON: a proxy's page, say
            raise ProvisionError(f"GET {self.base}{path}: not JSON ({err})") from None

    def tracing(self) -> bool:
        """Whether RabbitMQ's firehose tracer is on for the vhost (what ``fedfleet tap`` reads)."""
        return bool(self._get(f"/api/vhosts/{self._v()}").get("tracing"))

    def set_tracing(self, on: bool) -> None:
        self._call("PUT", f"/api/vhosts/{self._v()}", {"tracing": on})

    def trace_listeners(self) -> int:
        """How many queues are bound to the tracer's exchange (other taps still listening)."""
        path = f"/api/exchanges/{self._v()}/{urllib.parse.quote(TRACE_EXCHANGE, safe='')}/bindings/source"
        return len(self._get(path))

    def create_host_user(self, experiment: str, host_id: str, password: str) -> str:
        """Make a host's user with its permissions. If any step fails the user is deleted again: a
        user without its topic permission would be invisible to :meth:`host_ids` (so no server would
        ever delete it) and, with vhost permissions but no topic restriction, could bind any key."""
        user = identity.host_user(host_id)
        p = host_permissions(experiment, host_id)
        u = urllib.parse.quote(user, safe="")
        try:
            # inside: a PUT that timed out may still have made the user
            self._call("PUT", f"/api/users/{u}", {"password": password, "tags": ""})
            self._call(
                "PUT",
                f"/api/permissions/{self._v()}/{u}",
                {"configure": p.configure, "write": p.write, "read": p.read},
            )
            self._call(
                "PUT",
                f"/api/topic-permissions/{self._v()}/{u}",
                {"exchange": names(experiment).exchange, "write": p.topic_write, "read": p.topic_read},
            )
        except ProvisionError:
            with contextlib.suppress(ProvisionError):
                self._call("DELETE", f"/api/users/{u}")
            raise
        return user

    def host_ids(self, experiment: str) -> list[str]:
        """The hosts that have a user for ``experiment`` on this vhost now, whoever made them (a
        server that restarted adopts them: ``Server._adopt_host_users``).

        Scoped three ways, so that nothing of another experiment or deployment is ever taken: the
        vhost, this deployment's user prefix (``identity.identify``), and the experiment's exchange,
        which is what every host user's topic permission names (:meth:`create_host_user`). The
        names alone would not do: a host user's name carries no experiment."""
        exchange = names(experiment).exchange
        found: set[str] = set()
        listed = self._get(f"/api/vhosts/{self._v()}/topic-permissions")
        if not isinstance(listed, list):
            raise ProvisionError(f"topic permissions of vhost {self.vhost!r}: expected a list")
        for perm in listed:
            if not isinstance(perm, dict):
                continue
            sender = identity.identify(str(perm.get("user", "")))
            if sender.role is identity.Role.HOST and sender.host_id and perm.get("exchange") == exchange:
                found.add(sender.host_id)
        return sorted(found)

    def delete_host(self, experiment: str, host_id: str) -> None:
        """Remove a host's user (its connections close) and its queue."""
        self._call("DELETE", f"/api/users/{urllib.parse.quote(identity.host_user(host_id), safe='')}")
        queue = urllib.parse.quote(names(experiment).client_queue(host_id), safe="")
        self._call("DELETE", f"/api/queues/{self._v()}/{queue}")


#: RabbitMQ's firehose exchange: with tracing on, a copy of every message published in the vhost
TRACE_EXCHANGE = "amq.rabbitmq.trace"


def tap_permissions(experiment: str) -> Permissions:
    """The least a ``fedfleet tap`` user needs: its own server-named queue (declare, bind, consume)
    and reading the tracer's copies of this experiment's publishes — no access to any queue or
    exchange of the experiment itself, so it can take nothing away from anyone."""
    return Permissions(
        configure="^amq\\.gen-.*$",
        write="^amq\\.gen-.*$",
        read=f"^(amq\\.gen-.*|{re.escape(TRACE_EXCHANGE)})$",
        topic_write="^$",
        topic_read=f"^publish\\.{re.escape(names(experiment).exchange)}$",
    )


def new_host() -> tuple[str, str]:
    """A fresh (host id, password)."""
    return f"h{secrets.token_hex(5)}", secrets.token_urlsafe(24)


def join(url: str, experiment: str, hint: str = "", timeout_s: float = 60.0) -> JoinReply:
    """Ask the server for a broker user of this host's own (as the join user); see the module doc."""
    import pika

    params = pika.URLParameters(url)
    conn = pika.BlockingConnection(params)
    deadline = time.monotonic() + timeout_s
    try:
        ch = _await_exchange(conn, names(experiment).exchange, deadline)
        got: list[bytes] = []
        ch.basic_consume("amq.rabbitmq.reply-to", lambda _c, _m, _p, body: got.append(body), auto_ack=True)
        request = encode(Kind.JOIN, Join(hint=hint[:100]), exp=experiment, round=0, sender=hint or "join")
        props = pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", user_id=params.credentials.username)
        next_try = 0.0
        while not got:
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"no answer to the join request within {timeout_s:.0f}s: is the server running?"
                )
            if time.monotonic() >= next_try:  # a lost request (a server restart) is asked again
                ch.basic_publish(names(experiment).exchange, KEY_JOIN, request, props)
                next_try = time.monotonic() + 5.0
            conn.process_data_events(time_limit=0.2)
        _env, reply = decode(got[0], max_bytes=1 << 16)
        if not isinstance(reply, JoinReply):
            raise ProvisionError("the join request was answered with something else")
    except BaseException:
        # leaving on an error or a SIGTERM (``SystemExit``): the close must not replace it, e.g. with
        # the error of a connection the broker closed because a publish was cut between frames
        with contextlib.suppress(Exception):
            if conn.is_open:
                conn.close()
        raise
    if conn.is_open:
        conn.close()
    return reply


def _await_exchange(conn: Any, exchange: str, deadline: float) -> Any:
    """A channel once the server has declared the experiment's exchange (a passive declare that
    finds it missing closes its channel, so each try opens a new one)."""
    import pika.exceptions

    while True:
        ch = conn.channel()
        try:
            ch.exchange_declare(exchange, passive=True)
            return ch
        except pika.exceptions.ChannelClosedByBroker as err:
            if err.reply_code != 404 or time.monotonic() > deadline:
                raise ProvisionError(f"experiment exchange {exchange}: {err.reply_text}") from None
            conn.sleep(0.5)


def with_user(url: str, user: str, password: str) -> str:
    """``url`` (an AMQP URL) with other credentials."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _safe(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}"
