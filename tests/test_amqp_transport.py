"""The RabbitMQ transport against a real broker: confirms, routing, redelivery, dead-lettering."""

from __future__ import annotations

import time

import pika
import pytest

from shared.transport import Delivery, Unroutable
from shared.transport.amqp import AmqpTransport

pytestmark = pytest.mark.broker


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
        t.consume(f"ff.{experiment_id}.q1", lambda d: (got1.append(d), d.ack()), prefetch=4)
        t.consume(f"ff.{experiment_id}.q2", lambda d: (got2.append(d), d.ack()), prefetch=4)
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
    a = AmqpTransport(broker_url, experiment_id)
    b = AmqpTransport(broker_url, experiment_id)
    try:
        a.declare_queue(q, ["work"])
        held: list[Delivery] = []
        a.consume(q, held.append, prefetch=10)  # never acks, like a process that dies mid-work
        for i in range(3):
            a.publish("work", b"m%d" % i)
        _drain(a, held, 3)
        assert len(held) == 3
        a.close()  # the connection drops: the broker requeues what was unacked
        got: list[Delivery] = []
        b.consume(q, lambda d: (got.append(d), d.ack()), prefetch=10)
        _drain(b, got, 3)
        assert sorted(d.body for d in got) == [b"m0", b"m1", b"m2"]
        assert all(d.redelivered for d in got)
        assert b.queue_depth(q) == 0
    finally:
        b.delete_experiment([q])
        b.close()


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
        t.consume(q, lambda d: (got.append(d), d.ack()), prefetch=4)
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
        got: list[bytes] = []
        t.consume(q, lambda d: (got.append(d.body), d.ack()), prefetch=10)
        for i in range(3):
            other.publish("inbox", b"m%d" % i)
        end = time.time() + 10
        while other.queue_depth(q) and time.time() < end:  # the broker has sent them to t
            time.sleep(0.02)
        assert other.queue_depth(q) == 0
        time.sleep(0.2)  # and they have crossed the socket
        unroutable = t.publish_many([("out", b"task"), ("nobody", b"lost")])
        assert unroutable == {"nobody"}  # the returns are still seen
        assert got == [], "a consumer handler ran inside publish_many"
        t.process(0.05)
        assert got == [b"m0", b"m1", b"m2"]
        for _ in range(10):
            t.process(0.05)
        assert got == [b"m0", b"m1", b"m2"]  # handled once
        assert other.queue_depth(out) == 1
        assert t.queue_depth(q) == 0
    finally:
        other.close()
        t.delete_experiment([q, out])
        t.close()
