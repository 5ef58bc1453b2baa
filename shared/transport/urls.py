"""Broker addresses: several AMQP URLs in one setting, and the same URLs with passwords removed.

Why a list: a RabbitMQ cluster has one address per node, and a service that knows only one of them
loses the broker with that node. ``RABBITMQ_URL`` therefore takes several full URLs separated by
``;`` (the convention Celery and kombu use); a single URL is the one-element case.

Why redaction lives here: every message the transport logs or raises names addresses, and the URLs
carry passwords (a host's own broker user among them). One function renders every address a person
or a log shipper may see.
"""

from __future__ import annotations

import urllib.parse

SEPARATOR = ";"


def split_urls(value: str) -> list[str]:
    """The URLs of a ``;``-separated ``RABBITMQ_URL`` (blank entries ignored); raises on none."""
    urls = [part.strip() for part in value.split(SEPARATOR) if part.strip()]
    if not urls:
        raise ValueError("RABBITMQ_URL names no broker address")
    return urls


def redact(url: str) -> str:
    """``url`` without its password (``amqp://user:***@host:port/vhost``); the user stays, since it
    says which role a process logged in as."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # an unparsable address is shown as nothing rather than leaked
        return "<unparsable address>"
    user = f"{urllib.parse.unquote(parts.username)}:***@" if parts.username else ""
    return urllib.parse.urlunsplit((parts.scheme, f"{user}{host}{port}", parts.path, "", ""))


def redact_all(value: str) -> str:
    """Every address of a ``;``-separated ``RABBITMQ_URL``, redacted, joined with ``;``."""
    return SEPARATOR.join(redact(u) for u in split_urls(value))


def scrub(text: str, urls: list[str]) -> str:
    """``text`` (an error from pika, say) with any password of ``urls`` replaced by ``***``."""
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            continue
        password = parts.password
        # a password equal to the user name is no secret from anyone who reads the user name
        if password and password != parts.username:
            text = text.replace(password, "***").replace(urllib.parse.unquote(password), "***")
    return text
