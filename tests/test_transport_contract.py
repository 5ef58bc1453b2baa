"""One contract, every transport: the in-process broker and RabbitMQ (classic and quorum queues).

Why one suite: the services are written once against ``shared.transport.Transport``, and a run in
one process must end like a run over RabbitMQ. The semantics they rely on — order within a queue,
redelivery of what a dead consumer held, dead letters that say why, the size limit, and a publish
that returns only once the broker has the message — are tested here with the same code against each
implementation, so an implementation that drifts fails the same test the others pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
from prometheus_client import REGISTRY

from services.common import ServiceBase
from shared.transport import Delivery, Transport, Unroutable
from shared.transport.inproc import InprocBroker, InprocTransport

#: a transport factory: every transport it makes talks to the same broker and experiment
Factory = Callable[[], Transport]

KINDS = ["inproc", "amqp-classic", "amqp-quorum"]


@pytest.fixture(params=KINDS)
def make(request: pytest.FixtureRequest, experiment_id: str) -> Iterator[Factory]:
    made: list[Transport] = []
    if request.param == "inproc":
        broker = InprocBroker()

        def inproc() -> Transport:
            t = InprocTransport(broker, experiment_id)
            made.append(t)
            return t

        yield inproc
        return
    request.applymarker(pytest.mark.broker)
    url: str = request.getfixturevalue("broker_url")
    from shared.transport.amqp import AmqpTransport, BrokerOptions

    options = BrokerOptions(queue_type="quorum" if request.param == "amqp-quorum" else "classic")

    def amqp() -> Transport:
        t = AmqpTransport(url, experiment_id, options=options)
        made.append(t)
        return t

    try:
        yield amqp
    finally:
        queues = [f"ff.{experiment_id}.{name}" for name in ("work", "other")]
        cleaner = AmqpTransport(url, experiment_id, options=options)
        cleaner.delete_experiment(queues)
        cleaner.close()
        for t in made:
            t.close()


def _pump(transports: list[Transport], until: Callable[[], bool], rounds: int = 400) -> None:
    """Process every transport until ``until()`` holds (a bounded number of passes, no clock)."""
    for _ in range(rounds):
        if until():
            return
        for t in transports:
            t.process(0.02)


def _keep(into: list[Delivery]) -> Callable[[Delivery], None]:
    """A handler that keeps and acks every delivery."""

    def handler(d: Delivery) -> None:
        into.append(d)
        d.ack()

    return handler


def _bodies(got: list[Delivery]) -> list[bytes]:
    return [d.body for d in got]


def _queue(t: Transport, name: str = "work") -> str:
    return f"{t.names.exchange}.{name}"


def test_order_within_a_queue_is_the_publish_order(make: Factory) -> None:
    t = make()
    q = _queue(t)
    t.declare_queue(q, ["k"])
    got: list[Delivery] = []
    t.consume(q, _keep(got), prefetch=1)
    sent = [f"m{i}".encode() for i in range(40)]
    for body in sent:
        t.publish("k", body)
    _pump([t], lambda: len(got) == len(sent))
    assert _bodies(got) == sent


def test_batch_keeps_order_and_reports_unroutable(make: Factory) -> None:
    t = make()
    q = _queue(t)
    t.declare_queue(q, ["k"])
    got: list[Delivery] = []
    t.consume(q, _keep(got), prefetch=4)
    unroutable = t.publish_many([("k", b"a"), ("nobody", b"x"), ("k", b"b"), ("k", b"c")])
    assert unroutable == {"nobody"}
    _pump([t], lambda: len(got) == 3)
    assert _bodies(got) == [b"a", b"b", b"c"]


def test_a_dead_consumers_messages_are_redelivered_to_another(make: Factory) -> None:
    a, b = make(), make()
    q = _queue(a)
    a.declare_queue(q, ["k"])
    held: list[Delivery] = []
    a.consume(q, held.append, prefetch=10)  # never acks: a process that dies mid-work
    for i in range(3):
        a.publish("k", f"m{i}".encode())
    _pump([a], lambda: len(held) == 3)
    assert [d.redelivered for d in held] == [False] * 3
    a.close()  # the consumer dies with three unacked messages
    got: list[Delivery] = []
    b.consume(q, _keep(got), prefetch=10)
    _pump([b], lambda: len(got) == 3)
    assert sorted(d.body for d in got) == [b"m0", b"m1", b"m2"]
    assert all(d.redelivered for d in got)


def test_nack_with_requeue_redelivers_and_without_drops(make: Factory) -> None:
    t = make()
    q = _queue(t)
    t.declare_queue(q, ["k"])
    seen: list[tuple[bytes, bool]] = []

    def handler(d: Delivery) -> None:
        seen.append((d.body, d.redelivered))
        if d.body == b"again" and not d.redelivered:
            d.nack(requeue=True)
        elif d.body == b"drop":
            d.nack(requeue=False)
        else:
            d.ack()

    t.consume(q, handler, prefetch=1)
    t.publish("k", b"again")
    t.publish("k", b"drop")
    _pump([t], lambda: len(seen) == 3)
    assert (b"again", False) in seen and (b"again", True) in seen
    assert seen.count((b"drop", False)) == 1
    _pump([t], lambda: False, rounds=5)
    assert len(seen) == 3
    assert t.queue_depth(q) == 0


def _dead_letters(t: Transport, count: int) -> list[Delivery]:
    got: list[Delivery] = []
    t.consume(t.names.dead_letter_queue, _keep(got), prefetch=16)
    _pump([t], lambda: len(got) >= count)
    return got


def test_dead_letters_carry_their_reason_and_leave_the_queue(make: Factory) -> None:
    t, reader = make(), make()
    q = _queue(t)
    t.declare_queue(q, ["k"])
    t.consume(q, lambda d: t.dead_letter(d, "schema", "field 'seq' is missing"), prefetch=4)
    t.publish("k", b"bad message")
    _pump([t], lambda: t.queue_depth(t.names.dead_letter_queue) == 1)
    got = _dead_letters(reader, 1)
    assert [d.body for d in got] == [b"bad message"]
    assert got[0].headers["x-fedfleet-reason"] == "schema"
    assert got[0].headers["x-fedfleet-detail"] == "field 'seq' is missing"
    assert t.queue_depth(q) == 0  # the original was acked, not left to come back


def test_dead_letters_stored_together_each_keep_their_reason_and_leave_the_queue(make: Factory) -> None:
    """``dead_letter_many``: each message is stored with its own reason and sender header, and every
    original is acked (RabbitMQ classic queues: one transaction; quorum: one confirm each)."""
    t, reader = make(), make()
    q = _queue(t)
    t.declare_queue(q, ["k"])
    held: list[Delivery] = []
    t.consume(q, held.append, prefetch=16)
    t.publish_many([("k", f"bad {i}".encode()) for i in range(10)])
    _pump([t], lambda: len(held) == 10)
    t.dead_letter_many([(d, f"reason-{i % 3}", f"detail {i}") for i, d in enumerate(held)])
    assert all(d.settled for d in held)
    got = _dead_letters(reader, 10)
    assert sorted(
        (d.body, d.headers["x-fedfleet-reason"], d.headers["x-fedfleet-detail"]) for d in got
    ) == sorted((f"bad {i}".encode(), f"reason-{i % 3}", f"detail {i}") for i in range(10))
    _pump([t], lambda: False, rounds=3)  # an original left unacked would be back by now
    assert t.queue_depth(q) == 0 and len(held) == 10


def test_a_turns_dead_letters_are_stored_together_after_its_messages(make: Factory) -> None:
    """A service's turn rejects each bad message as before (reason, counter), but stores the turn's
    dead letters with one ``dead_letter_many`` once every message is handled, acking each original
    only then; a message rejected twice (a handler that rejects, then fails) is stored once, and an
    ack or requeue of a rejected message meanwhile does nothing."""
    t, reader = make(), make()
    sink = _Sink(t, max_bytes=64)
    q = _queue(t)
    t.declare_queue(q, ["k"])
    batches: list[int] = []
    store = t.dead_letter_many

    def counted(items: Sequence[tuple[Delivery, str, str]]) -> None:
        batches.append(len(items))
        store(items)

    t.dead_letter_many = counted  # type: ignore[method-assign]
    seen: list[Delivery] = []

    def handler(d: Delivery) -> None:
        seen.append(d)
        sink.dispatch(d, {})  # oversized or undecodable: rejected
        assert not d.settled  # stored, and acked, only at the end of the turn
        sink.reject(d, "again", "a second rejection of the same message")
        d.nack(requeue=True)  # nobody may requeue it (it would come back and be stored twice)
        d.ack()  # or ack it before its dead letter is stored
        assert not d.settled

    t.consume(q, handler, prefetch=16)
    t.publish_many([("k", b"\x00" * 65 if i % 2 else b"not msgpack") for i in range(6)])
    for _ in range(400):
        if len(seen) == 6:
            break
        sink.turn(0.02)
    assert len(seen) == 6 and all(d.settled for d in seen)
    assert sum(batches) == 6 and len(batches) < 6
    got = _dead_letters(reader, 6)
    assert sorted(d.headers["x-fedfleet-reason"] for d in got) == ["malformed"] * 3 + ["oversized"] * 3
    assert t.queue_depth(q) == 0


class _Sink(ServiceBase):
    """The smallest service: only ``dispatch``'s checks, no handlers of its own."""

    service = "server"

    def __init__(self, transport: Transport, max_bytes: int) -> None:
        super().__init__(transport, transport.names.experiment, "fedavg", max_bytes)


def test_a_message_over_the_size_limit_is_dead_lettered_unread(make: Factory) -> None:
    t, reader = make(), make()
    sink = _Sink(t, max_bytes=1024)
    q = _queue(t)
    t.declare_queue(q, ["k"])
    handled: list[Delivery] = []

    def handler(d: Delivery) -> None:
        handled.append(d)
        sink.dispatch(d, {})

    t.consume(q, handler, prefetch=4)
    t.publish("k", b"\x00" * 1025)
    _pump([t], lambda: t.queue_depth(t.names.dead_letter_queue) == 1)
    got = _dead_letters(reader, 1)
    assert [d.headers["x-fedfleet-reason"] for d in got] == ["oversized"]
    assert len(got[0].body) == 1025
    assert len(handled) == 1 and handled[0].settled


def test_publish_returns_once_the_broker_holds_the_message(make: Factory) -> None:
    """Publisher confirms: without any consumer or ``process``, a published message is counted in
    its queue as soon as ``publish`` returns, and one nobody is bound for is an error."""
    t = make()
    q = _queue(t)
    t.declare_queue(q, ["k"])
    for i in range(5):
        t.publish("k", f"m{i}".encode())
        assert t.queue_depth(q) == i + 1
    with pytest.raises(Unroutable):
        t.publish("nobody.listens", b"lost?")
    assert t.queue_depth(q) == 5


def test_every_queue_bound_to_a_key_gets_a_copy(make: Factory) -> None:
    t = make()
    q1, q2 = _queue(t), _queue(t, "other")
    t.declare_queue(q1, ["all", "one"])
    t.declare_queue(q2, ["all"])
    t.publish("all", b"everyone")
    t.publish("one", b"first only")
    assert (t.queue_depth(q1), t.queue_depth(q2)) == (2, 1)


def test_publish_soon_publishes_at_the_flush_in_order_and_says_when_nobody_listens(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """``publish_soon`` holds messages until the turn's ``flush``, which publishes them in one
    batch, in order; with no queue bound the flush logs an error, not raise."""
    from shared.schemas import Kind, Receipt, decode, encode
    from shared.transport.base import KEY_SERVER

    t = make()
    sink = _Sink(t, max_bytes=1 << 20)

    def soon(device: int) -> None:
        receipt = Receipt(device_id=device, aggregator_id="a", update_bytes=1, dense_bytes=1, num_samples=1)
        data = encode(Kind.RECEIPT, receipt, exp=sink.experiment, round=1, sender="aggregator")
        sink.publish_soon(KEY_SERVER, Kind.RECEIPT, data)

    soon(0)
    with caplog.at_level("ERROR"):
        sink.flush()  # nobody is bound for "server" yet
    assert "had no queue to go to" in caplog.text and not sink.outbox
    q = _queue(t)
    t.declare_queue(q, [KEY_SERVER])
    for device in (3, 1, 2):
        soon(device)
    assert t.queue_depth(q) == 0  # nothing before the flush
    sink.flush()
    assert t.queue_depth(q) == 3 and not sink.outbox
    got: list[Delivery] = []
    t.consume(q, got.append, prefetch=8)
    _pump([t], lambda: len(got) == 3)
    bodies = [decode(d.body, max_bytes=1 << 20, exp=t.names.experiment)[1] for d in got]
    assert [b.device_id for b in bodies] == [3, 1, 2]
    assert all(isinstance(b, Receipt) for b in bodies)


def test_a_flushs_updates_go_as_one_updates_message_and_a_lone_one_alone(make: Factory) -> None:
    """A host's flush (``Bundling``): its updates go as one ``updates`` message whose entries are
    the lone messages, in order, published transient; an update that would be a bundle's only entry
    goes alone. The wire-bytes counter of kind ``update`` counts the entries' bytes either way, the
    bundle's framing goes under ``updates``."""
    from prometheus_client import REGISTRY

    from services.common import UPDATES_BUNDLE
    from shared.schemas import Kind, Updates, decode
    from shared.transport.base import KEY_UPDATE

    t = make()
    sink = _Sink(t, max_bytes=1 << 20)
    sink.bundling = (UPDATES_BUNDLE,)
    q = _queue(t, "updates")
    t.declare_queue(q, [KEY_UPDATE])
    labels = {"experiment": sink.experiment, "algorithm": "fedavg", "service": "server", "direction": "up"}

    def wire(kind: str) -> float:
        return REGISTRY.get_sample_value("fedfleet_wire_bytes_total", {**labels, "kind": kind}) or 0.0

    lone = [f"update {i}".encode() * 50 for i in range(4)]  # opaque bodies: only their bytes matter
    sink.publish_soon(KEY_UPDATE, Kind.UPDATE, lone[0])
    sink.flush()
    for data in lone[1:]:
        sink.publish_soon(KEY_UPDATE, Kind.UPDATE, data)
    sink.flush()
    got: list[Delivery] = []
    t.consume(q, got.append, prefetch=8)
    _pump([t], lambda: len(got) == 2)
    assert got[0].body == lone[0]
    env, bundle = decode(got[1].body, max_bytes=1 << 20, exp=t.names.experiment)
    assert env.kind is Kind.UPDATES and isinstance(bundle, Updates) and bundle.messages == lone[1:]
    assert wire("update") == sum(map(len, lone))
    assert wire("updates") == len(got[1].body) - sum(map(len, lone[1:])) > 0


def test_publish_soon_acks_what_it_answers_only_once_published(make: Factory) -> None:
    """``publish_soon`` (a client's uploads in virtual time): the delivery a message answers (its
    task) is acked by the flush that published it, never before; if no queue took the message the
    task is dead-lettered ``unroutable`` instead of acked away; :data:`OUTBOX_LIMIT` waiting
    messages flush without waiting for the turn's end."""
    from services.common import OUTBOX_LIMIT
    from shared.schemas import Kind, Receipt, encode
    from shared.transport.base import KEY_SERVER

    t, reader = make(), make()
    sink = _Sink(t, max_bytes=1 << 20)
    tasks_q = _queue(t, "tasks")
    t.declare_queue(tasks_q, ["tasks"])
    for i in range(OUTBOX_LIMIT + 1):
        t.publish("tasks", f"task {i}".encode())
    tasks: list[Delivery] = []
    t.consume(tasks_q, tasks.append, prefetch=OUTBOX_LIMIT + 1)
    _pump([t], lambda: len(tasks) == OUTBOX_LIMIT + 1)

    def answer(device: int) -> bytes:
        body = Receipt(device_id=device, aggregator_id="a", update_bytes=1, dense_bytes=1, num_samples=1)
        return encode(Kind.RECEIPT, body, exp=t.names.experiment, round=1, sender="server")

    # nobody bound for the key: the task is dead-lettered with the reason, not acked, and the
    # returned message is counted (the one trace of a message without an answered delivery)
    labels = {"experiment": t.names.experiment, "service": "server", "kind": "receipt"}
    before = REGISTRY.get_sample_value("fedfleet_unroutable_messages_total", labels) or 0.0
    sink.publish_soon(KEY_SERVER, Kind.RECEIPT, answer(0), answers=tasks[0])
    assert not tasks[0].settled
    sink.flush()
    assert tasks[0].settled
    got = _dead_letters(reader, 1)
    assert [d.headers["x-fedfleet-reason"] for d in got] == ["unroutable"]
    assert got[0].body == b"task 0"
    assert REGISTRY.get_sample_value("fedfleet_unroutable_messages_total", labels) == before + 1

    q = _queue(t)
    t.declare_queue(q, [KEY_SERVER])
    for i in range(1, OUTBOX_LIMIT):
        sink.publish_soon(KEY_SERVER, Kind.RECEIPT, answer(i), answers=tasks[i])
    assert t.queue_depth(q) == 0 and not any(d.settled for d in tasks[1:])
    sink.publish_soon(KEY_SERVER, Kind.RECEIPT, answer(OUTBOX_LIMIT), answers=tasks[OUTBOX_LIMIT])
    # the limit is reached: published and acked without a flush of the caller's
    assert t.queue_depth(q) == OUTBOX_LIMIT and all(d.settled for d in tasks) and not sink.outbox
    assert t.queue_depth(tasks_q) == 0
