"""The RabbitMQ transport against a real broker: confirms, routing, redelivery, dead-lettering."""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pika
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pika.adapters.blocking_connection import BlockingChannel
from prometheus_client import REGISTRY

from shared.transport import BrokerUnavailable, Delivery, Unroutable
from shared.transport.amqp import RECV_BYTES, AmqpTransport, BrokerOptions, queue_arguments
from shared.transport.urls import redact
from tests.conftest import write_config

pytestmark = pytest.mark.broker


def _keep(into: list[Delivery]) -> Callable[[Delivery], None]:
    """A handler that keeps and acks every delivery."""

    def handler(d: Delivery) -> None:
        into.append(d)
        d.ack()

    return handler


@contextmanager
def _crash_pair(broker_url: str, experiment_id: str, q: str) -> Iterator[tuple[AmqpTransport, AmqpTransport]]:
    """Two connections to queue ``q`` (bound to ``work``): ``a`` consumes three messages and then
    closes (as a process that goes away does), ``b`` sees what the broker does about it; ``q`` and
    the experiment are deleted afterwards."""
    a = AmqpTransport(broker_url, experiment_id)
    b = AmqpTransport(broker_url, experiment_id)
    try:
        a.declare_queue(q, ["work"])
        yield a, b
    finally:
        b.delete_experiment([q])
        b.close()


def _drain(t: AmqpTransport, got: list[Delivery], n: int, timeout: float = 5.0) -> None:
    end = time.time() + timeout
    while len(got) < n and time.time() < end:
        t.process(0.05)


def test_publish_consume_ack_and_multicast(broker_url: str, experiment_id: str) -> None:
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(f"ff.{experiment_id}.q1", ["k", "both"])
        t.declare_queue(f"ff.{experiment_id}.q2", ["both"])
        got1: list[Delivery] = []
        got2: list[Delivery] = []
        t.consume(f"ff.{experiment_id}.q1", _keep(got1), prefetch=4)
        t.consume(f"ff.{experiment_id}.q2", _keep(got2), prefetch=4)
        t.publish("k", b"one")
        t.publish("both", b"two")
        _drain(t, got1, 2)
        _drain(t, got2, 1)
        assert sorted(d.body for d in got1) == [b"one", b"two"]
        assert [d.body for d in got2] == [b"two"]
        assert not any(d.redelivered for d in got1 + got2)
    finally:
        t.delete_experiment([f"ff.{experiment_id}.q1", f"ff.{experiment_id}.q2"])
        t.close()


def test_large_messages_arrive_whole_read_in_large_chunks(broker_url: str, experiment_id: str) -> None:
    """pika reads the socket up to ``RECV_BYTES`` at a time (``_read_in_large_chunks``): messages
    larger than a frame and than one read, and small ones between them, arrive byte for byte."""
    import pika.adapters.utils.io_services_utils as io

    assert io._AsyncTransportBase._MAX_RECV_BYTES == RECV_BYTES > 4096
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(f"ff.{experiment_id}.big", ["k"])
        got: list[Delivery] = []
        t.consume(f"ff.{experiment_id}.big", _keep(got), prefetch=8)
        bodies = [os.urandom(n) for n in (3 * RECV_BYTES // 2, 17, 438_000, 131_072, 1)]
        assert t.publish_many([("k", b) for b in bodies]) == set()
        _drain(t, got, len(bodies), timeout=15.0)
        assert [d.body for d in got] == bodies
    finally:
        t.delete_experiment([f"ff.{experiment_id}.big"])
        t.close()


def test_unroutable_is_an_error_not_a_silent_drop(broker_url: str, experiment_id: str) -> None:
    t = AmqpTransport(broker_url, experiment_id)
    try:
        with pytest.raises(Unroutable):
            t.publish("task.12345", b"nobody listens")
    finally:
        t.delete_experiment()
        t.close()


def test_unacked_messages_are_redelivered_to_another_consumer(broker_url: str, experiment_id: str) -> None:
    q = f"ff.{experiment_id}.work"
    with _crash_pair(broker_url, experiment_id, q) as (a, b):
        held: list[Delivery] = []
        a.consume(q, held.append, prefetch=10)  # never acks, like a process that dies mid-work
        for i in range(3):
            a.publish("work", b"m%d" % i)
        _drain(a, held, 3)
        assert len(held) == 3
        a.close()  # the connection drops: the broker requeues what was unacked
        got: list[Delivery] = []
        b.consume(q, _keep(got), prefetch=10)
        _drain(b, got, 3)
        assert sorted(d.body for d in got) == [b"m0", b"m1", b"m2"]
        assert all(d.redelivered for d in got)
        assert b.queue_depth(q) == 0


def test_acks_left_unflushed_still_reach_the_broker_before_close(broker_url: str, experiment_id: str) -> None:
    """An ack is queued, not flushed (``_ack_unflushed``); closing right after the handlers acked
    must still deliver the acks first, or the broker would hand the messages out again."""
    q = f"ff.{experiment_id}.acked"
    with _crash_pair(broker_url, experiment_id, q) as (a, b):
        done: list[Delivery] = []
        a.consume(q, _keep(done), prefetch=10)
        for i in range(3):
            a.publish("work", b"m%d" % i)
        _drain(a, done, 3)
        assert len(done) == 3
        a.close()  # no process after the last ack
        again: list[Delivery] = []
        b.consume(q, _keep(again), prefetch=10)
        _drain(b, again, 1, timeout=1.5)
        assert again == [] and b.queue_depth(q) == 0


def test_prefetch_bounds_what_one_consumer_holds(broker_url: str, experiment_id: str) -> None:
    q = f"ff.{experiment_id}.bounded"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["b"])
        held: list[Delivery] = []
        t.consume(q, held.append, prefetch=2)
        for i in range(5):
            t.publish("b", b"%d" % i)
        _drain(t, held, 5, timeout=1.5)
        assert len(held) == 2  # the other three wait in the broker
        assert t.queue_depth(q) == 3
        for d in held:
            d.ack()
        _drain(t, held, 4, timeout=3)
        assert len(held) == 4
    finally:
        t.delete_experiment([q])
        t.close()


def test_dead_letter_carries_the_reason(broker_url: str, experiment_id: str) -> None:
    q = f"ff.{experiment_id}.in"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["in"])
        t.consume(q, lambda d: t.dead_letter(d, "malformed", "not msgpack"), prefetch=1)
        t.publish("in", b"\xc1bad")
        end = time.time() + 5
        while t.queue_depth(t.names.dead_letter_queue) < 1 and time.time() < end:
            t.process(0.05)
        conn = pika.BlockingConnection(pika.URLParameters(broker_url))
        ch = conn.channel()
        _method, props, body = ch.basic_get(t.names.dead_letter_queue, auto_ack=True)
        conn.close()
        assert body == b"\xc1bad"
        assert props.headers["x-fedfleet-reason"] == "malformed"
        assert props.headers["x-original-key"] == "in"
        assert t.queue_depth(q) == 0
    finally:
        t.delete_experiment([q])
        t.close()


def test_reconnects_after_the_connection_is_killed(broker_url: str, experiment_id: str) -> None:
    q = f"ff.{experiment_id}.rc"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["rc"])
        got: list[Delivery] = []
        t.consume(q, _keep(got), prefetch=4)
        assert t._conn is not None
        import socket

        sock = t._conn._impl._transport._sock  # simulate a dropped TCP connection
        sock.shutdown(socket.SHUT_RDWR)
        t.publish("rc", b"after")  # reconnects, re-declares and re-consumes
        _drain(t, got, 1)
        assert [d.body for d in got] == [b"after"]
    finally:
        t.delete_experiment([q])
        t.close()


def test_no_handler_runs_inside_a_publish(broker_url: str, experiment_id: str) -> None:
    """Deliveries that arrive while ``publish_many`` pumps the connection wait for ``process``.

    The server draws a round's devices, then publishes the tasks with ``publish_many``; a ``register``
    handler that ran inside that publish changed the registry mid-round-open. Here three messages
    are already on the consumer's socket when a batch is published: none may be handled before the
    next ``process``, and then all of them, in order, each once.
    """
    q, out = f"ff.{experiment_id}.inbox", f"ff.{experiment_id}.out"
    t = AmqpTransport(broker_url, experiment_id)
    other = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["inbox"])
        t.declare_queue(out, ["out"])
        kept: list[Delivery] = []
        t.consume(q, _keep(kept), prefetch=10)
        for i in range(3):
            other.publish("inbox", b"m%d" % i)
        end = time.time() + 10
        while other.queue_depth(q) and time.time() < end:  # the broker has sent them to t
            time.sleep(0.02)
        assert other.queue_depth(q) == 0
        time.sleep(0.2)  # and they have crossed the socket
        unroutable = t.publish_many([("out", b"task"), ("nobody", b"lost")])
        assert unroutable == {"nobody"}  # the returns are still seen
        assert kept == [], "a consumer handler ran inside publish_many"
        t.process(0.05)
        assert [d.body for d in kept] == [b"m0", b"m1", b"m2"]
        for _ in range(10):
            t.process(0.05)
        assert [d.body for d in kept] == [b"m0", b"m1", b"m2"]  # handled once
        assert other.queue_depth(out) == 1
        assert t.queue_depth(q) == 0
    finally:
        other.close()
        t.delete_experiment([q, out])
        t.close()


def test_a_batch_published_inside_a_handler_sees_its_own_returns(broker_url: str, experiment_id: str) -> None:
    """Services publish most batches from inside a consumer's handler (an aggregator's partial and
    receipts, a host's updates), where pika dispatches no channel event (a nested dispatch). The
    broker's returns of that batch must still be its own result, not left for the next batch to
    report under its keys."""
    q, out = f"ff.{experiment_id}.inbox", f"ff.{experiment_id}.out"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["inbox"])
        t.declare_queue(out, ["out"])
        results: list[set[str]] = []

        def handler(d: Delivery) -> None:
            results.append(t.publish_many([("out", b"task"), ("nobody", b"lost")]))
            d.ack()

        t.consume(q, handler, prefetch=1)
        t.publish("inbox", b"go")
        end = time.time() + 10
        while not results and time.time() < end:
            t.process(0.05)
        assert results == [{"nobody"}]
        assert t.publish_many([("out", b"next")]) == set()  # nothing of the first batch left over
        assert t.queue_depth(out) == 2
    finally:
        t.delete_experiment([q, out])
        t.close()


def test_a_batch_larger_than_the_write_buffer_is_stored_whole_with_its_returns(
    broker_url: str, experiment_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``TX_BUFFER_BYTES`` waiting, a transaction's messages go to the socket before the commit
    (a fan-out of one large payload to many hosts): the batch is still stored whole and in order,
    and its returns are still its own."""
    from shared.transport import amqp

    monkeypatch.setattr(amqp, "TX_BUFFER_BYTES", 4096)
    flushes = [0]
    flush = BlockingChannel._flush_output

    def counted(self: BlockingChannel, *waiters: Any) -> None:
        flushes[0] += 1
        flush(self, *waiters)

    monkeypatch.setattr(BlockingChannel, "_flush_output", counted)
    q = f"ff.{experiment_id}.out"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["out"])
        bodies = [bytes([i]) * 3000 for i in range(12)]
        items = [("out", b) for b in bodies[:6]] + [("nobody", b"lost")] + [("out", b) for b in bodies[6:]]
        flushes[0] = 0
        assert t.publish_many(items) == {"nobody"}
        assert flushes[0] >= 6  # every second message, or so, went ahead of the commit
        got: list[Delivery] = []
        t.consume(q, _keep(got), prefetch=20)
        _drain(t, got, 12)
        assert [d.body for d in got] == bodies
    finally:
        t.delete_experiment([q])
        t.close()


@given(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 100), st.none() | st.integers(1, 6))
@settings(max_examples=300, deadline=None)
def test_transaction_chunks_keep_order_and_stay_under_the_limits(
    sizes: list[int], limit: int, max_count: int | None
) -> None:
    """``_tx_chunks`` (a batch's publishes, a turn's dead letters): every message once, in order;
    a chunk passes ``limit`` bytes only when it is one message larger than the limit alone, and
    never holds more than ``max_count``; no chunk is empty, and one is cut only when it is full."""
    from shared.transport.amqp import _tx_chunks

    items = [(f"k{i}", b"x" * n) for i, n in enumerate(sizes)]
    chunks = _tx_chunks(items, limit, size=lambda item: len(item[1]), max_count=max_count)
    assert [item for chunk in chunks for item in chunk] == items
    for chunk in chunks:
        assert chunk
        assert len(chunk) == 1 or sum(len(b) for _, b in chunk) <= limit
        assert max_count is None or len(chunk) <= max_count
    for a, b in itertools.pairwise(chunks):  # cut only when the next message would pass a limit
        assert sum(len(x) for _, x in a) + len(b[0][1]) > limit or len(a) == max_count


def test_a_batch_past_the_transaction_limit_goes_as_several_in_order(
    broker_url: str, experiment_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``TX_MAX_BYTES`` a batch is cut into several transactions (the broker holds a
    transaction's messages in memory until its commit): every message is stored once, in order, the
    returns of every transaction are reported, and a transaction whose connection is lost is
    retried alone (the ones committed before it are not published again)."""
    from shared.transport import amqp

    monkeypatch.setattr(amqp, "TX_MAX_BYTES", 7000)
    commits: list[int] = []
    commit = AmqpTransport._commit_batch

    def counted(self: AmqpTransport, items: Any) -> set[str]:
        commits.append(len(items))
        if len(commits) == 3:  # the third transaction's connection is lost before it commits
            raise pika.exceptions.StreamLostError("test: connection lost")
        return commit(self, items)

    monkeypatch.setattr(AmqpTransport, "_commit_batch", counted)
    q = f"ff.{experiment_id}.out"
    t = AmqpTransport(broker_url, experiment_id, options=BrokerOptions(queue_type="classic"))
    try:
        t.declare_queue(q, ["out"])
        bodies = [bytes([i]) * 3000 for i in range(7)]
        out = [("out", b) for b in bodies]
        items = [out[0], ("nowhere", b"lost"), *out[1:5], ("nobody", b"lost"), *out[5:]]
        assert t.publish_many(items) == {"nowhere", "nobody"}  # returns of the first and the third
        # at most 7,000 bytes each: a small "lost" fits beside two; the third is tried twice
        assert commits == [3, 2, 3, 3, 1]
        got: list[Delivery] = []
        t.consume(q, _keep(got), prefetch=20)
        _drain(t, got, 7)
        t.process(0.2)
        assert [d.body for d in got] == bodies  # each once, in order
    finally:
        t.delete_experiment([q])
        t.close()


# -- a replicated broker's needs (issue: queue type, several addresses, NACKs, cancels) ----------------
def _management_queue(broker_url: str, queue: str) -> dict[str, Any]:
    """The queue as RabbitMQ's management API describes it (its type among other things)."""
    params = pika.URLParameters(broker_url)
    vhost = urllib.parse.quote(params.virtual_host, safe="")
    req = urllib.request.Request(
        f"http://{params.host}:15672/api/queues/{vhost}/{urllib.parse.quote(queue, safe='')}"
    )
    creds = base64.b64encode(f"{params.credentials.username}:{params.credentials.password}".encode())
    req.add_header("Authorization", f"Basic {creds.decode()}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


@pytest.mark.parametrize(
    ("transient", "option", "expected"), [(True, True, 1), (True, False, 2), (False, True, 2)]
)
def test_only_what_the_sender_may_lose_is_published_transient(
    broker_url: str, experiment_id: str, transient: bool, option: bool, expected: int
) -> None:
    """``transient`` (a device's update) is published with ``delivery_mode`` 1, so the broker does
    not store it, unless ``RABBITMQ_UPDATE_DELIVERY=persistent``; everything else is persistent (2).
    Read back with a plain consumer, as the broker delivers it: one by ``publish``, one by
    ``publish_many``."""
    q = f"ff.{experiment_id}.modes"
    t = AmqpTransport(broker_url, experiment_id, options=BrokerOptions(transient_updates=option))
    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        t.declare_queue(q, ["m"])
        t.publish("m", b"one", transient=transient)
        assert t.publish_many([("m", b"two")], transient=transient) == set()
        ch = conn.channel()
        modes = []
        for _ in range(2):
            method, props, body = ch.basic_get(q, auto_ack=True)
            assert method is not None, "a published message did not arrive"
            modes.append((body, props.delivery_mode))
        assert modes == [(b"one", expected), (b"two", expected)]
    finally:
        conn.close()
        t.delete_experiment([q])
        t.close()


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_every_queue_takes_the_configured_type(broker_url: str, experiment_id: str, queue_type: str) -> None:
    """The dead-letter queue included, and a session queue with an expiry (quorum queues take it)."""
    q, session = f"ff.{experiment_id}.typed", f"ff.{experiment_id}.session"
    opts = BrokerOptions(queue_type="quorum" if queue_type == "quorum" else "classic")
    t = AmqpTransport(broker_url, experiment_id, options=opts)
    try:
        t.declare_queue(q, ["typed"])
        t.declare_queue(session, ["session"], expires_s=600)
        for name in (q, session, t.names.dead_letter_queue):
            assert _management_queue(broker_url, name)["type"] == queue_type, name
        t.publish("typed", b"x")
        assert t.queue_depth(q) == 1
    finally:
        t.delete_experiment([q, session])
        t.close()


@pytest.mark.parametrize("mode", ["lazy", "default"])
def test_classic_queues_take_the_configured_mode(broker_url: str, experiment_id: str, mode: str) -> None:
    """Lazy (the default): every classic queue, session queues included, is declared
    ``x-queue-mode: lazy``: RabbitMQ then holds its message bodies on disk, not in RAM (a
    10,000-device round kept ~364 MiB of updates in the broker's memory before; docs/broker.md).
    The dead-letter queue never is: the Kubernetes broker's definitions declare it at boot without
    the argument, and a server declaring it lazy was refused (406; tests/test_k8s_process.py)."""
    q, session = f"ff.{experiment_id}.moded", f"ff.{experiment_id}.session"
    t = AmqpTransport(
        broker_url, experiment_id, options=BrokerOptions(queue_mode="lazy" if mode == "lazy" else "default")
    )
    try:
        t.declare_queue(q, ["moded"])
        t.declare_queue(session, ["session"], expires_s=600)
        for name in (q, session):
            args = _management_queue(broker_url, name)["arguments"]
            assert args.get("x-queue-mode") == ("lazy" if mode == "lazy" else None), (name, args)
        dead = _management_queue(broker_url, t.names.dead_letter_queue)["arguments"]
        assert "x-queue-mode" not in dead, dead
        assert BrokerOptions().queue_mode == "lazy"
    finally:
        t.delete_experiment([q, session])
        t.close()


@pytest.mark.parametrize("transient", [True, False])
def test_the_updates_queue_is_lazy_only_while_updates_are_persistent(
    broker_url: str, experiment_id: str, transient: bool
) -> None:
    """A lazy queue would write transient updates to disk all the same, so the updates queue is
    declared without the mode while updates are transient; with persistent updates it is lazy like
    every other classic queue."""
    t = AmqpTransport(
        broker_url, experiment_id, options=BrokerOptions(queue_mode="lazy", transient_updates=transient)
    )
    other = f"ff.{experiment_id}.other"
    try:
        t.declare_queue(t.names.updates_queue, ["update"])
        t.declare_queue(other, ["other"])
        updates = _management_queue(broker_url, t.names.updates_queue)["arguments"]
        assert updates.get("x-queue-mode") == (None if transient else "lazy"), updates
        assert _management_queue(broker_url, other)["arguments"].get("x-queue-mode") == "lazy"
    finally:
        t.delete_experiment([t.names.updates_queue, other])
        t.close()


def test_quorum_queues_take_no_mode() -> None:
    """RabbitMQ refuses ``x-queue-mode`` on a quorum queue (406), so lazy must leave it out."""
    args = queue_arguments("quorum", "dlx", None, "lazy")
    assert "x-queue-mode" not in args and args["x-queue-type"] == "quorum"


def test_several_addresses_the_first_that_answers_is_used(broker_url: str, experiment_id: str) -> None:
    dead = "amqp://guest:secret-pw@127.0.0.1:1/%2F"  # nothing listens on port 1
    t = AmqpTransport(f"{dead};{broker_url}", experiment_id)
    try:
        assert t.address == redact(broker_url)
        t.declare_queue(f"ff.{experiment_id}.multi", ["m"])
        t.publish("m", b"x")
        assert t.queue_depth(f"ff.{experiment_id}.multi") == 1
    finally:
        t.delete_experiment([f"ff.{experiment_id}.multi"])
        t.close()


def test_an_exhausted_budget_is_one_line_naming_the_addresses(experiment_id: str) -> None:
    urls = "amqp://guest:secret-pw@127.0.0.1:1/%2F;amqp://host-user:other-pw@127.0.0.1:2/v"
    opts = BrokerOptions(reconnect_budget_s=0.5, backoff_s=0.1, backoff_max_s=0.2)
    with pytest.raises(BrokerUnavailable) as err:
        AmqpTransport(urls, experiment_id, options=opts)
    text = str(err.value)
    assert "\n" not in text
    assert "127.0.0.1:1" in text and "127.0.0.1:2" in text
    assert "secret-pw" not in text and "other-pw" not in text


def test_the_cli_exits_non_zero_with_one_line_when_no_address_answers(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        RABBITMQ_URL="amqp://guest:secret-pw@127.0.0.1:1/%2F",
        FEDFLEET_RECONNECT_BUDGET_S="0.5",
        FEDFLEET_RECONNECT_BACKOFF_S="0.1",
    )
    config = write_config(tmp_path / "c.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "aggregator", "--config", str(config), "--metrics-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("fedfleet aggregator: cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:1/")
    for line in lines[:-1]:  # before it, only the transport's own retry records
        assert json.loads(line)["event"] == "amqp_retry", line
    assert "secret-pw" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_nacked_publish_is_retried_on_a_fresh_channel(broker_url: str, experiment_id: str) -> None:
    """A full queue with ``reject-publish`` makes the broker NACK, as a quorum leader election does:
    the publish is retried (counted) until a consumer on another connection makes room."""
    q = f"ff.{experiment_id}.full"
    t = AmqpTransport(broker_url, experiment_id, options=BrokerOptions(reconnect_budget_s=20))
    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
        ch.queue_bind(q, t.names.exchange, routing_key="full")
        t.publish("full", b"first")
        before = _sample("fedfleet_broker_publish_retries_total", experiment_id, "nack")

        def make_room() -> None:  # its own connection: pika connections are not shared by threads
            while _sample("fedfleet_broker_publish_retries_total", experiment_id, "nack") == before:
                time.sleep(0.01)
            taker = pika.BlockingConnection(pika.URLParameters(broker_url))
            taker.channel().basic_get(q, auto_ack=True)
            taker.close()

        helper = threading.Thread(target=make_room)
        helper.start()
        t.publish("full", b"second")  # NACKed until the helper takes "first"
        helper.join()
        assert _sample("fedfleet_broker_publish_retries_total", experiment_id, "nack") > before
        assert t.queue_depth(q) == 1
    finally:
        conn.close()
        t.delete_experiment([q])
        t.close()


def test_a_publish_refused_for_good_ends_in_broker_unavailable(broker_url: str, experiment_id: str) -> None:
    q = f"ff.{experiment_id}.stuck"
    opts = BrokerOptions(publish_retries=2, reconnect_budget_s=1.0, backoff_s=0.1)
    t = AmqpTransport(broker_url, experiment_id, options=opts)
    try:
        t.declare_queue(q, ["stuck"])
        t.channel.queue_declare(
            q + ".full", durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )
        t.channel.queue_bind(q + ".full", t.names.exchange, routing_key="stuck")
        before = _sample("fedfleet_broker_publish_retries_total", experiment_id, "nack")
        with pytest.raises(BrokerUnavailable):
            t.publish("stuck", b"never")
        assert _sample("fedfleet_broker_publish_retries_total", experiment_id, "nack") >= before + 2
    finally:
        cleaner = AmqpTransport(broker_url, experiment_id)
        cleaner.delete_experiment([q, q + ".full"])
        cleaner.close()
        t.close()


def test_a_consumer_the_broker_cancels_subscribes_again(broker_url: str, experiment_id: str) -> None:
    """Deleting a consumed queue makes the broker send ``basic.cancel`` (as losing a classic queue's
    node, or a quorum queue's leader, does); the transport declares it again and consumes on."""
    q = f"ff.{experiment_id}.cancelled"
    t = AmqpTransport(broker_url, experiment_id)
    other = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["c"])
        got: list[Delivery] = []
        t.consume(q, _keep(got), prefetch=4)
        before = _sample("fedfleet_broker_consumer_cancels_total", experiment_id)
        other.delete_queue(q)
        for _ in range(100):
            t.process(0.02)
            if _sample("fedfleet_broker_consumer_cancels_total", experiment_id) > before:
                break
        assert _sample("fedfleet_broker_consumer_cancels_total", experiment_id) == before + 1
        other.publish("c", b"after the cancel")  # routed: the queue and its binding are back
        _drain(t, got, 1)
        assert [d.body for d in got] == [b"after the cancel"]
    finally:
        other.close()
        t.delete_experiment([q])
        t.close()


def test_deleting_its_own_queue_is_no_cancel_to_recover_from(broker_url: str, experiment_id: str) -> None:
    """An aggregator deletes its queue when the run stops: the broker's cancel that follows must not
    send the transport re-subscribing to a queue that is gone (it retried until its budget ran out)."""
    q = f"ff.{experiment_id}.mine"
    t = AmqpTransport(broker_url, experiment_id, options=BrokerOptions(reconnect_budget_s=5))
    try:
        t.declare_queue(q, ["mine"])
        t.consume(q, _keep([]), prefetch=1)
        before = _sample("fedfleet_broker_reconnects_total", experiment_id)
        t.delete_queue(q)
        for _ in range(20):
            t.process(0.02)
        assert _sample("fedfleet_broker_reconnects_total", experiment_id) == before
        assert _sample("fedfleet_broker_consumer_cancels_total", experiment_id) == 0
    finally:
        t.delete_experiment()
        t.close()


def test_a_dead_letter_survives_a_deleted_dead_letter_queue(broker_url: str, experiment_id: str) -> None:
    q = f"ff.{experiment_id}.dl"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        t.declare_queue(q, ["dl"])
        t.channel.queue_delete(t.names.dead_letter_queue)
        t.consume(q, lambda d: t.dead_letter(d, "schema", "bad"), prefetch=1)
        t.publish("dl", b"keep me")
        for _ in range(100):
            t.process(0.02)
            if t.queue_depth(t.names.dead_letter_queue) == 1:
                break
        assert t.queue_depth(t.names.dead_letter_queue) == 1
        assert t.queue_depth(q) == 0
    finally:
        t.delete_experiment([q])
        t.close()


def _held(t: AmqpTransport, q: str, key: str, bodies: list[bytes]) -> list[Delivery]:
    """``bodies`` published to a new queue ``q`` on ``key`` and delivered, left unacknowledged (the
    list keeps growing with whatever else arrives)."""
    t.declare_queue(q, [key])
    got: list[Delivery] = []
    t.consume(q, got.append, prefetch=8)
    t.publish_many([(key, body) for body in bodies])
    _drain(t, got, len(bodies))
    return got


def test_dead_letters_of_a_lost_connection_are_stored_once_when_they_come_back(
    broker_url: str, experiment_id: str
) -> None:
    """Messages rejected on a connection that is then lost (a reconnect inside one turn) are not
    dead-lettered from the old deliveries: the broker delivers them again, and those are stored,
    once each. Before, each was stored twice (once stale, once redelivered)."""
    q = f"ff.{experiment_id}.gen"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        got = _held(t, q, "gen", [f"bad {i}".encode() for i in range(3)])
        assert t._conn is not None
        import socket

        t._conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)  # a dropped TCP connection
        t.publish("gen", b"bad 3")  # reconnects; the three unacked ones come back
        stale = got[:3]
        t.dead_letter_many([(d, "malformed", "stale") for d in stale])
        assert t.queue_depth(t.names.dead_letter_queue) == 0 and not any(d.settled for d in stale)
        _drain(t, got, 7)
        again = got[3:]
        assert sorted(d.body for d in again) == [f"bad {i}".encode() for i in range(4)]
        t.dead_letter_many([(d, "malformed", "current") for d in again])
        assert t.queue_depth(t.names.dead_letter_queue) == 4 and all(d.settled for d in again)
    finally:
        t.delete_experiment([q])
        t.close()


def test_dead_letters_stored_together_survive_a_deleted_dead_letter_queue(
    broker_url: str, experiment_id: str
) -> None:
    """The batch's mandatory publishes come back when nobody holds the dead-letter queue; the lone
    path then declares it again, so each is stored and its original acked."""
    q = f"ff.{experiment_id}.dlm"
    t = AmqpTransport(broker_url, experiment_id)
    try:
        got = _held(t, q, "dlm", [f"keep {i}".encode() for i in range(5)])
        t.channel.queue_delete(t.names.dead_letter_queue)
        t.dead_letter_many([(d, "schema", "bad") for d in got])
        assert t.queue_depth(t.names.dead_letter_queue) == 5 and all(d.settled for d in got)
    finally:
        t.delete_experiment([q])
        t.close()


def _sample(name: str, experiment: str, reason: str | None = None) -> float:
    labels = {"experiment": experiment} | ({"reason": reason} if reason else {})
    return REGISTRY.get_sample_value(name, labels) or 0.0


@functools.cache
def _frames_stream() -> bytes:
    """Marshalled AMQP frames of the kinds a consumer reads: methods, content headers, body frames
    of several sizes (128 KiB ones, as a large message's), heartbeats."""
    import pika.frame
    import pika.spec

    out = [pika.frame.ProtocolHeader().marshal()]
    for i, size in enumerate((0, 17, 131_064, 300_000)):
        deliver = pika.spec.Basic.Deliver("ctag", i + 1, False, "ff.x", "update")
        out.append(pika.frame.Method(1, deliver).marshal())
        out.append(pika.frame.Header(1, size, pika.spec.BasicProperties(user_id="u")).marshal())
        body = (bytes(range(251)) * (size // 251 + 1))[i : i + size]
        out += [pika.frame.Body(1, body[k : k + 131_064]).marshal() for k in range(0, size, 131_064)]
        out.append(pika.frame.Heartbeat().marshal())
    return b"".join(out)


class _Conn:
    """What ``_on_data_available`` touches of a pika ``Connection``."""

    def __init__(self) -> None:
        self._frame_buffer = b""
        self.bytes_received = 0
        self.seen: list[tuple[str, Any]] = []
        self.on_frame: Any = None

    def _read_frame(self) -> Any:  # what pika's own version calls
        import pika.frame

        return pika.frame.decode_frame(self._frame_buffer)

    def _trim_frame_buffer(self, n: int) -> None:
        self._frame_buffer = self._frame_buffer[n:]
        self.bytes_received += n

    def _process_frame(self, f: Any) -> None:
        import pika.frame

        key = f.fragment if isinstance(f, pika.frame.Body) else f.marshal()
        self.seen.append((type(f).__name__, bytes(key)))
        if self.on_frame is not None:
            self.on_frame(self)


@given(st.lists(st.integers(1, 400_000), max_size=12), st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_frames_parsed_in_place_are_pikas_frames(cuts: list[int], reenter_at: int) -> None:
    """The same reads, cut anywhere (mid-header, mid-body, several frames per read), give the same
    frames in the same order, the same ``bytes_received`` and the same partial frame left over with
    fedfleet's ``_on_data_available`` as with pika's own; a read handed in while a frame is
    processed (re-entry) is parsed after the frames before it, in order."""
    from shared.transport import amqp

    stream = _frames_stream()
    stream += stream[:5]  # a partial frame header at the end
    bounds = sorted({min(c, len(stream)) for c in cuts} | {len(stream)})
    reads = [stream[a:b] for a, b in zip([0, *bounds[:-1]], bounds, strict=True) if b > a]
    ours, pikas = _Conn(), _Conn()
    for r in reads:
        amqp.PIKA_ON_DATA_AVAILABLE(pikas, r)
    following = iter(reads)

    def hand_in(conn: _Conn) -> None:  # the next read arrives while the reenter_at-th frame is processed
        if reenter_at and len(conn.seen) == reenter_at and (nxt := next(following, None)) is not None:
            amqp._on_data_available(conn, nxt)

    ours.on_frame = hand_in
    for r in following:
        amqp._on_data_available(ours, r)
    assert ours.seen == pikas.seen
    assert ours.bytes_received == pikas.bytes_received == len(stream) - 5
    assert ours._frame_buffer == pikas._frame_buffer == stream[-5:]


def test_pika_connections_parse_frames_in_place() -> None:
    import pika.connection

    from shared.transport import amqp

    assert pika.connection.Connection._on_data_available is amqp._on_data_available
    assert amqp.PIKA_ON_DATA_AVAILABLE is not amqp._on_data_available


class _Writer:
    """What ``_produce`` touches of a pika transport: its socket and its queue of frames."""

    def __init__(self, sock: Any, frames: list[bytes]) -> None:
        from collections import deque

        self._sock = sock
        self._tx_buffers = deque(frames)
        self._tx_buffered_byte_count = sum(map(len, frames))


@given(st.lists(st.integers(1, 131_072), min_size=1, max_size=40), st.sampled_from([4096, 65536]))
@settings(max_examples=40, deadline=None)
def test_frames_sent_together_arrive_whole_and_in_order(sizes: list[int], sndbuf: int) -> None:
    """Frames written with one ``sendmsg`` a turn arrive as pika's one ``send`` a frame wrote them:
    every byte, in order (frames up to pika's 128 KiB ``frame_max``; at most 3 a call here, so that
    the queue takes several calls). A socket that takes part of them (a small send buffer) leaves
    the rest queued and counted, and ``BlockingIOError`` (the socket full) leaves the queue as it
    was, for pika's writer to try again when the socket is writable."""
    import socket
    from unittest import mock

    from shared.transport import amqp

    frames = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    ours.setblocking(False)
    peer.setblocking(False)
    writer, received = _Writer(ours, frames), bytearray()

    def drain() -> None:
        nonlocal received
        with contextlib.suppress(BlockingIOError):
            while chunk := peer.recv(1 << 20):
                received += chunk

    try:
        with mock.patch.object(amqp, "SEND_BUFFERS", 3):
            while writer._tx_buffers:
                with contextlib.suppress(BlockingIOError):  # the socket is full: drain it, try again
                    amqp._produce(writer)
                assert writer._tx_buffered_byte_count == sum(map(len, writer._tx_buffers))
                drain()
        drain()
    finally:
        ours.close()
        peer.close()
    assert bytes(received) == b"".join(frames)


def test_pika_plain_sockets_send_frames_together() -> None:
    from pika.adapters.utils import io_services_utils as io

    from shared.transport import amqp

    assert io._AsyncPlaintextTransport._produce is amqp._produce
    # (``ssl.SSLSocket.sendmsg`` raises NotImplementedError: TLS keeps pika's one send a frame)
    assert io._AsyncSSLTransport._produce is not amqp._produce
