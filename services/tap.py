"""``fedfleet tap EXPERIMENT``: watch an experiment's messages go by, one readable line each.

How it sees them without disturbing anything: RabbitMQ's **firehose tracer**. With tracing on for
the vhost, the broker publishes a copy of every message that enters an exchange to
``amq.rabbitmq.trace`` (routing key ``publish.<exchange>``); the tap binds a queue of its own to
``publish.ff.<experiment>`` and reads the copies. Why not simply bind a queue to the experiment's
own exchange with ``#``: fedfleet publishes with ``mandatory`` and treats "nobody is bound" as news
(no aggregator yet → the round waits; a host gone → its devices are unreachable). A catch-all queue
would make every key routable and change what the run does. The tracer's copies leave routing,
delivery and acks of the experiment exactly as they were.

Costs and permissions: while tracing is on, the broker copies every publish in the vhost (about
doubling its message work). The tap turns tracing on when it has a management URL
(``--admin-url`` / ``FEDFLEET_BROKER_ADMIN_URL``) and it was off, and off again when it leaves and no
other tap is listening. Its broker user needs no access to the experiment at all
(``shared.provision.tap_permissions``): its own server-named queue and the tracer's exchange.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from services.common import ANSWERS_BUNDLE, UPDATES_BUNDLE
from shared import codec
from shared.codec.tensorset import LayoutCache
from shared.provision import TRACE_EXCHANGE, BrokerAdmin, ProvisionError
from shared.schemas import DecodeError, Kind, RoundOpen, decode
from shared.transport import KEY_CLIENTS, names

#: after the run ends (or SIGTERM), the tap reads on until nothing has come for this long
QUIET_S = 2.0
#: kinds that carry whole messages, shown entry by entry too (``Tap.describe_all``)
BUNDLES = frozenset(b.kind.value for b in (ANSWERS_BUNDLE, UPDATES_BUNDLE))


@dataclass
class Line:
    """One message as the tap shows it."""

    ts: float
    kind: str
    user: str
    routing_key: str
    round: int | None
    device: int | None
    bytes: int
    tensors: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    #: the bundle (``answers``, ``updates``) this message came in, as one of its entries ("": alone)
    entry_of: str = ""

    def text(self) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(self.ts)) + f".{int(self.ts * 1000) % 1000:03d}"
        dev = "" if self.device is None else f" device {self.device}"
        rnd = "" if self.round is None else f" r{self.round}"
        summary = ", ".join(
            f"{t['name']} {t['dtype']}{list(t['shape'])} d={t['density']:.3f}" for t in self.tensors
        )
        tail = f"  [{summary}]" if summary else ""
        err = f"  ({self.error})" if self.error else ""
        kind = f"└ {self.kind}" if self.entry_of else self.kind  # under its bundle's line
        return f"{clock} {kind:<13} {self.user:<28}{rnd}{dev} {self.bytes} B{tail}{err}"


def _tensor_summary(name: str, enc: dict[str, Any]) -> dict[str, Any]:
    t = codec.decode(enc)
    full = [int(d) for d in enc["shape"]]
    n = 1
    for d in full:
        n *= d
    if isinstance(t, codec.Sparse):
        kept = t.nnz
    elif isinstance(t, codec.Sliced):
        kept = int(t.values.size)
    else:
        kept = n
    return {"name": name, "shape": full, "dtype": enc["dtype"], "density": kept / n if n else 1.0}


class Tap:
    """Reads the tracer's copies of one experiment's messages and describes each one."""

    def __init__(self, experiment: str, *, kinds: Iterable[str] = (), devices: Iterable[int] = ()) -> None:
        self.experiment = experiment
        self.kinds = set(kinds)
        self.devices = set(devices)
        #: layouts the server sent (so an update that names one can be summarised too)
        self.layouts = LayoutCache()
        self.seen: dict[str, int] = {}

    def describe_all(self, body: bytes, headers: dict[str, Any]) -> list[Line]:
        """The message's line, then, for a bundle of whole messages (a host's ``answers`` or
        ``updates``), one line per entry: each is the message its device sent (its device, its
        tensors), which a bundle's own line would hide."""
        line, msg = self._describe(body, headers)
        lines = [line]
        if line.kind in BUNDLES and not line.error:
            for entry in getattr(msg, "messages", []):
                inner, _ = self._describe(entry, headers)
                inner.entry_of = line.kind
                lines.append(inner)
        return lines

    def _describe(self, body: bytes, headers: dict[str, Any]) -> tuple[Line, Any]:
        """One message's line, and its body (None if it does not decode)."""
        props = headers.get("properties") or {}
        user = _text(props.get("user_id")) or "?"
        keys = headers.get("routing_keys") or [""]
        line = Line(time.time(), "?", user, _text(keys[0]), None, None, len(body))
        try:
            env, msg = decode(body, max_bytes=len(body) + 1, exp=self.experiment, layouts=self.layouts)
        except DecodeError as err:
            line.error = f"{err.reason}: {err}"
            if err.env is not None:
                line.kind, line.round = err.env.kind.value, err.env.round
            return line, None
        for layout in env.layouts:
            self.layouts.learn(layout)
        if isinstance(msg, RoundOpen):
            for layout in msg.layouts:
                self.layouts.learn(layout)
        line.kind, line.round = env.kind.value, env.round
        line.device = getattr(msg, "device_id", None)
        for name, enc in (getattr(msg, "tensors", None) or {}).items():
            try:
                line.tensors.append(_tensor_summary(name, enc))
            except codec.CodecError as err:
                line.error = f"tensor {name}: {err.reason}"
        return line, msg

    def wanted(self, line: Line) -> bool:
        if self.kinds and line.kind not in self.kinds:
            return False
        return not self.devices or line.device in self.devices


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else "" if v is None else str(v)


def run(
    url: str,
    experiment: str,
    *,
    kinds: Iterable[str] = (),
    devices: Iterable[int] = (),
    as_json: bool = False,
    seconds: float | None = None,
    count: int | None = None,
    admin_url: str | None = None,
    until_stop: bool = False,
    out: IO[str] = sys.stdout,
) -> int:
    """Attach, print until ``seconds`` pass, ``count`` lines are printed, the server ends the run
    (``until_stop``), or SIGINT/SIGTERM; returns the exit code."""
    import pika

    unknown = set(kinds) - {k.value for k in Kind}
    if unknown:
        print(f"unknown message kind(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    admin = BrokerAdmin(admin_url, vhost=pika.URLParameters(url).virtual_host) if admin_url else None
    turned_on = False
    if admin is not None:
        try:
            if not admin.tracing():
                admin.set_tracing(True)
                turned_on = True
        except ProvisionError as err:
            print(f"cannot switch the broker's tracer on: {err}", file=sys.stderr)
            return 2
    else:
        print(
            "note: no --admin-url; the vhost's tracer must be on (rabbitmqctl trace_on -p VHOST)",
            file=sys.stderr,
        )
    tap = Tap(experiment, kinds=kinds, devices=devices)
    stop = {"now": False}

    def on_signal(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    printed = 0
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
        ch.queue_bind(q, TRACE_EXCHANGE, routing_key=f"publish.{names(experiment).exchange}")
        print(f"tapping {names(experiment).exchange} (queue {q})", file=sys.stderr)
        deadline = None if seconds is None else time.monotonic() + seconds

        last = [time.monotonic()]

        def on_message(_ch: Any, _m: Any, props: Any, body: bytes) -> None:
            nonlocal printed
            last[0] = time.monotonic()
            for line in tap.describe_all(body, props.headers or {}):
                seen = f"{line.kind} in {line.entry_of}" if line.entry_of else line.kind
                tap.seen[seen] = tap.seen.get(seen, 0) + 1
                if tap.wanted(line):
                    out.write((json.dumps(line.__dict__) if as_json else line.text()) + "\n")
                    out.flush()
                    printed += 1
                if until_stop and line.kind == Kind.STOP.value and line.routing_key == KEY_CLIENTS:
                    stop["now"] = True  # the server ended the run

        ch.basic_consume(q, on_message, auto_ack=True)
        while not stop["now"]:
            conn.process_data_events(time_limit=0.2)
            if deadline is not None and time.monotonic() >= deadline:
                break
            if count is not None and printed >= count:
                break
        # the run's last messages (the stop to the aggregators, the hosts' goodbyes) and whatever
        # the tracer still holds: read on until the queue has been quiet for QUIET_S
        while stop["now"] and time.monotonic() - last[0] < QUIET_S:
            conn.process_data_events(time_limit=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(Exception):  # a connection the broker already dropped
            conn.close()
        if admin is not None and turned_on:
            try:
                if admin.trace_listeners() == 0:
                    admin.set_tracing(False)
            except ProvisionError as err:
                print(f"could not switch the tracer off again: {err}", file=sys.stderr)
    print(
        "seen: " + ", ".join(f"{k} {n}" for k, n in sorted(tap.seen.items()))
        if tap.seen
        else "seen: nothing",
        file=sys.stderr,
    )
    return 0


def admin_url_from_env() -> str | None:
    return os.environ.get("FEDFLEET_BROKER_ADMIN_URL") or None
