"""The message plane as an AsyncAPI 3 document, generated from the code so that it cannot drift.

Sources, each the one place its facts live:

* message bodies — the pydantic models of ``shared.schemas`` (their JSON Schemas);
* where each kind travels — ``shared.topology.ROUTES`` (the services refuse to publish elsewhere)
  and the queues in ``shared.topology.QUEUES``;
* who may send each kind to whom — ``shared.identity.ACCEPTS`` (every receiver checks it against
  the broker-validated ``user_id``).

``fedfleet asyncapi --out docs/asyncapi.yaml`` writes it; ``tests/test_asyncapi.py`` regenerates it,
compares it with the committed file and runs the official ``asyncapi validate`` on it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shared.identity import ACCEPTS, Role
from shared.schemas import (
    ACCEPTED_VERSIONS,
    BODY_MODELS,
    KIND_CODES,
    PREVIOUS_VERSION,
    SCHEMA_VERSION,
    TELEMETRY,
    Envelope,
    Kind,
)
from shared.topology import QUEUES, REPLY_TO, ROUTES, TRANSIENT_KINDS

SCHEMAS = "#/components/schemas/{model}"
#: the role that publishes each kind where no receiver's table names it
_EXTRA_SENDERS = {Kind.JOIN_REPLY: Role.SERVER}
#: receiving service → the broker role its processes log in as
_SERVICE_ROLE = {"server": Role.SERVER, "aggregator": Role.AGGREGATOR, "client": Role.HOST}


def _channel_id(route: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", route.replace("{", "").replace("}", "")).strip("-")


def senders(kind: Kind) -> dict[str, Role]:
    """Receiving service → the role allowed to send it ``kind`` (from ``ACCEPTS``)."""
    return {svc: kinds[kind] for svc, kinds in ACCEPTS.items() if kind in kinds}


def _receivers(kind: Kind, route: str) -> list[str]:
    """The services whose queues are bound to ``route`` and that accept ``kind``."""
    if route == REPLY_TO:
        return ["joining client (its own connection)"]
    bound = {q.consumer for q in QUEUES if route in q.bindings}
    return sorted(svc for svc in senders(kind) if svc in bound)


def _schemas() -> dict[str, Any]:
    models: list[type[BaseModel]] = sorted(set(BODY_MODELS.values()), key=lambda m: m.__name__)
    models.append(Envelope)
    pairs: list[tuple[type[BaseModel], Literal["validation"]]] = [(m, "validation") for m in models]
    _, top = models_json_schema(pairs, ref_template=SCHEMAS)
    defs: dict[str, Any] = top["$defs"]
    env = defs["Envelope"]
    env["description"] = (
        f"Every message (schema version {SCHEMA_VERSION}). On the wire it is a msgpack ARRAY of these "
        "fields in this order: v, kind (integer code, see x-fedfleet-kind-codes), exp_tag, inc (bytes; "
        "a 4-byte one as an unsigned int), round, sender, body (bytes: the body model's fields as a "
        "msgpack array in declaration order, trailing defaults left out, a `tensors` field as "
        "[head, *counts] of its tensor set, whose blob follows the array raw), mac, telemetry; "
        "trailing empty fields left out. `exp` and `layouts` are not sent. See docs/wire.md."
    )
    env["x-fedfleet-kind-codes"] = {k.value: KIND_CODES[k] for k in Kind}
    return dict(sorted(defs.items()))


def _message(kind: Kind) -> dict[str, Any]:
    model = BODY_MODELS[kind]
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    sent_by = sorted(
        {r.value for r in senders(kind).values()}
        | ({_EXTRA_SENDERS[kind].value} if kind in _EXTRA_SENDERS else set())
    )
    msg: dict[str, Any] = {
        "name": kind.value,
        "title": f"{kind.value} ({model.__name__})",
        "summary": " ".join(doc.split()),
        "contentType": "application/msgpack",
        "payload": {"$ref": SCHEMAS.format(model=model.__name__)},
        "bindings": {"amqp": {"bindingVersion": "0.3.0", "messageType": kind.value}},
        "x-fedfleet-kind-code": KIND_CODES[kind],
        "x-fedfleet-sender-roles": sent_by,
        "x-fedfleet-receivers": sorted(senders(kind)) or ["joining client"],
    }
    if kind in TELEMETRY:
        msg["x-fedfleet-telemetry-fields"] = list(TELEMETRY[kind])
    return msg


def _channels() -> dict[str, Any]:
    routes = sorted({r for rs in ROUTES.values() for r in rs})
    channels: dict[str, Any] = {}
    for route in routes:
        kinds = [k for k in Kind if route in ROUTES[k]]
        params = {p: {"description": f"a {p}'s id"} for p in re.findall(r"\{(\w+)\}", route)}
        queues = [q for q in QUEUES if route in q.bindings]
        ch: dict[str, Any] = {
            "address": route,
            "title": f"routing key {route}",
            "description": (
                "RabbitMQ's direct reply-to pseudo-queue: only the connection that asked reads it."
                if route == REPLY_TO
                else "Routing key on the experiment's topic exchange ff.{experiment}. Bound queues: "
                + ", ".join(f"{q.name} (consumed by the {q.consumer}; expires: {q.expires})" for q in queues)
                + "."
            ),
            "messages": {k.value: {"$ref": f"#/components/messages/{k.value}"} for k in kinds},
            "bindings": {
                "amqp": {
                    "bindingVersion": "0.3.0",
                    "is": "routingKey",
                    "exchange": {
                        "name": "ff.{experiment}" if route != REPLY_TO else "",
                        "type": "topic" if route != REPLY_TO else "default",
                        "durable": True,
                        "autoDelete": False,
                        "vhost": "/",
                    },
                }
            },
        }
        if params:
            ch["parameters"] = params
        channels[_channel_id(route)] = ch
    return channels


def _operations() -> dict[str, Any]:
    ops: dict[str, Any] = {}
    for kind in Kind:
        roles = sorted(
            {r.value for r in senders(kind).values()}
            | ({_EXTRA_SENDERS[kind].value} if kind in _EXTRA_SENDERS else set())
        )
        for route in ROUTES[kind]:
            ch = _channel_id(route)
            ref = {"$ref": f"#/channels/{ch}"}
            msg = [{"$ref": f"#/channels/{ch}/messages/{kind.value}"}]
            for role in roles:
                ops[f"{role}-sends-{kind.value}-on-{ch}"] = {
                    "action": "send",
                    "channel": ref,
                    "messages": msg,
                    "summary": f"the {role} publishes {kind.value} with routing key {route}",
                    "bindings": {
                        "amqp": {
                            "bindingVersion": "0.3.0",
                            "userId": f"the {role}'s broker user",
                            # 1 (transient) by default for updates (RABBITMQ_UPDATE_DELIVERY)
                            "deliveryMode": 1 if kind in TRANSIENT_KINDS else 2,
                        }
                    },
                }
            for svc in _receivers(kind, route):
                key = re.sub(r"[^A-Za-z0-9]+", "-", svc).strip("-")
                ops[f"{key}-receives-{kind.value}-on-{ch}"] = {
                    "action": "receive",
                    "channel": ref,
                    "messages": msg,
                    "summary": f"the {svc} consumes {kind.value} (acked after processing; anything bad "
                    "is dead-lettered with a reason)",
                    "bindings": {"amqp": {"bindingVersion": "0.3.0", "ack": True}},
                }
    return ops


def document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of this build's message plane."""
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "fedfleet message plane",
            "version": str(SCHEMA_VERSION),
            "description": (
                "Server, aggregators and client hosts of one fedfleet experiment exchange these "
                "messages over one RabbitMQ topic exchange per experiment (ff.{experiment}). Every "
                "message is msgpack (no pickle); its sender is the broker-validated AMQP user_id, and "
                "each receiver accepts a kind only from the role named in x-fedfleet-sender-roles. "
                f"This build writes schema version {SCHEMA_VERSION} (version {PREVIOUS_VERSION} to a "
                f"client host that speaks only that) and reads versions "
                f"{', '.join(map(str, ACCEPTED_VERSIONS))}. Generated by `fedfleet asyncapi` from "
                "shared/schemas, shared/topology and shared/identity; see docs/wire.md and "
                "docs/security.md."
            ),
        },
        "defaultContentType": "application/msgpack",
        "servers": {
            "rabbitmq": {
                "host": "rabbitmq:5672",
                "protocol": "amqp",
                "protocolVersion": "0.9.1",
                "description": "RABBITMQ_URL; one or several nodes of a RabbitMQ cluster",
            }
        },
        "channels": _channels(),
        "operations": _operations(),
        "components": {
            "messages": {k.value: _message(k) for k in Kind},
            "schemas": _schemas(),
        },
    }


def render() -> str:
    """The document as YAML, deterministic (the committed file is compared byte for byte)."""
    head = "# Generated by `fedfleet asyncapi` from the code; do not edit (docs/wire.md).\n"
    return head + yaml.safe_dump(document(), sort_keys=False, allow_unicode=True, width=100)
