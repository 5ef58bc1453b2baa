"""Which schema version to write to whom: the sender's half of the version-skew policy.

Why: during a rolling upgrade of the client image (docs/wire.md, "Versions on the wire") hosts of
the previous image still run. They read only their own version, so whatever is addressed to them —
leases, device state, payloads, tasks, ``go`` — must be written in it. A service learns each host's
version from what the host itself sends (the envelope's ``v`` of its heartbeats and other messages)
and rewrites a message for that host's routing key on its way out (:func:`shared.schemas.transcode`):
one place, after the code that built the message, so no handler needs a version of its own.

A broadcast reaches every host bound to its key, so it goes in the *lowest* version among the hosts
heard from lately; this build also reads that version, so one copy serves everyone. The other way —
one copy per version on the same key — would have every host dead-letter the copies it cannot read,
and a copy per host on its own key would turn one message into as many as there are hosts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.schemas import ACCEPTED_VERSIONS, SCHEMA_VERSION, transcode
from shared.transport import KEY_CLIENTS, key_host

#: routing keys every client host is bound to (``shared.transport``): written in the lowest version
BROADCAST_TO_HOSTS = frozenset({KEY_CLIENTS})
#: how long a host counts towards the broadcast version after its last message. Generous on purpose:
#: a host heard from longer ago than its lease timeout (10 s by default) is gone, and counting a gone
#: host only costs the broadcast the newer format — never a reader.
LIVE_S = 300.0


@dataclass
class PeerVersions:
    """The schema version of each host, by the routing key its messages reach it on."""

    live_s: float = LIVE_S
    clock: Callable[[], float] = time.time
    #: routing key → (version, when last heard)
    _by_key: dict[str, tuple[int, float]] = field(default_factory=dict)

    def learn(self, host_id: str, version: int) -> None:
        """``host_id`` just sent a message of ``version`` (one this build reads)."""
        if version in ACCEPTED_VERSIONS:
            self._by_key[key_host(host_id)] = (version, self.clock())

    def version_for(self, key: str) -> int:
        """The version to write a message published with routing key ``key`` in."""
        if key in BROADCAST_TO_HOSTS:
            now = self.clock()
            live = [v for v, seen in self._by_key.values() if now - seen <= self.live_s]
            return min(live, default=SCHEMA_VERSION)
        known = self._by_key.get(key)
        return SCHEMA_VERSION if known is None else known[0]

    def outgoing(
        self, key: str, data: bytes, *, exp: str, layouts: Mapping[bytes, Any] | None = None
    ) -> bytes:
        """``data`` as the readers of ``key`` can read it (unchanged when they speak this version)."""
        version = self.version_for(key)
        if version == SCHEMA_VERSION:
            return data
        return transcode(data, version, exp=exp, layouts=layouts)

    def versions(self) -> dict[str, int]:
        """Every host's version, by routing key (for logs and tests)."""
        return {key: v for key, (v, _) in self._by_key.items()}
