"""``shared.transport.split``: one delivery per entry of a message that carries several."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared.transport import Delivery, split


def _parent() -> tuple[Delivery, list[str]]:
    events: list[str] = []
    d = Delivery(
        body=b"whole",
        routing_key="host.h1",
        redelivered=True,
        headers={"h": 1},
        user_id="fedfleet-server",
        _ack=lambda: events.append("ack"),
        _nack=lambda requeue: events.append(f"nack requeue={requeue}"),
    )
    return d, events


def test_the_message_is_acked_once_every_part_is_settled_and_only_once() -> None:
    d, events = _parent()
    a, b, c = split(d, [b"a", b"b", b"c"])
    assert [p.body for p in (a, b, c)] == [b"a", b"b", b"c"]
    # each part is read as the message was delivered: who sent it, where, redelivered or not
    assert all(
        (p.routing_key, p.redelivered, p.user_id, p.headers) == ("host.h1", True, "fedfleet-server", {"h": 1})
        for p in (a, b, c)
    )
    c.ack()
    a.ack()
    a.ack()  # a part settles once: a second ack does not count as another part's
    assert events == [] and not d.settled
    b.nack(requeue=False)  # (settled, as a dead-lettered part is: acked after its dead letter)
    assert events == ["ack"] and d.settled
    c.ack()
    assert events == ["ack"]


def test_a_part_nacked_with_requeue_sends_the_whole_message_back() -> None:
    d, events = _parent()
    a, b = split(d, [b"a", b"b"])
    a.ack()
    b.nack(requeue=True)
    assert events == ["nack requeue=True"]
    b.ack()
    assert events == ["nack requeue=True"]  # the message is settled: nothing more reaches the broker


def test_a_part_rejected_before_a_sibling_sends_the_message_back_is_not_dead_lettered_twice() -> None:
    """An aggregator's turn: one entry of an ``updates`` is rejected (its dead letter waits for the
    turn's end), then a sibling puts the whole message back (its round not announced yet). The
    rejected entry comes back with it and is dead-lettered then: storing the first dead letter too
    would record it twice."""
    from shared.transport.inproc import InprocBroker, InprocTransport

    t = InprocTransport(InprocBroker(), "split")
    q = t.names.updates_queue
    t.declare_queue(q, ["update"])
    t.publish("update", b"bundle")
    got: list[Delivery] = []
    t.consume(q, got.append, prefetch=1)
    t.process(0)
    (bundle,) = got
    bad, early, later = split(bundle, [b"bad", b"early", b"later"])
    bad.doomed = True  # ServiceBase.reject within a turn
    early.nack(requeue=True)
    bad.doomed = False  # the turn's end stores its dead letters
    t.dead_letter_many([(bad, "nonfinite", "device 1: non-finite values")])
    later.ack()  # a part handled after the requeue: reaches the broker no more
    assert t.queue_depth(t.names.dead_letter_queue) == 0
    t.process(0)
    assert len(got) == 2 and got[1].redelivered and got[1].body == b"bundle"


def _aggregator(tmp_path: Path, experiment: str) -> tuple[Any, Any]:
    """An in-process transport (dev mode: no sender checks) and an aggregator on it, FedAvg on
    the tests' small config, a window of 8."""
    from services.aggregator.service import Aggregator
    from shared.config import load_config
    from shared.experiment import Experiment
    from shared.transport.inproc import InprocBroker, InprocTransport
    from tests.conftest import write_config

    exp = Experiment.build(load_config(write_config(tmp_path / "c.yaml")))
    t = InprocTransport(InprocBroker(), experiment)
    agg = Aggregator(
        t,
        exp.aggregation_strategy,
        experiment_id=experiment,
        algorithm="fedavg",
        aggregator_id="a",
        prefetch=8,
        max_bytes=1 << 20,
    )
    return t, agg


def test_a_part_left_unsettled_keeps_the_message_unacked() -> None:
    d, events = _parent()
    parts = split(d, [b"a", b"b", b"c"])
    for p in parts[:2]:
        p.ack()
    assert events == [] and not d.settled  # a crash now redelivers the whole message


def test_a_client_flushes_by_upload_bytes_count_and_age_or_once_the_oldest_answer_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host keeps a turn's answers (``ready``...) and uploads together, but not past
    :data:`UPLOAD_FLUSH_BYTES` or :data:`UPLOAD_FLUSH_COUNT` of uploads, an upload older than
    :data:`UPLOAD_WAIT_S`, a full ``answers``, or :data:`ANSWERS_WAIT_S`: the aggregators get to
    work while a long turn trains on, and the server decides at its deadline with the readies it
    has, so a ready queued after a long training must not wait for the end of the turn."""
    import services.client.service as client_module
    from services.client.service import (
        ANSWERS_WAIT_S,
        UPLOAD_FLUSH_BYTES,
        UPLOAD_FLUSH_COUNT,
        UPLOAD_WAIT_S,
        Client,
    )
    from services.common import PublishItem
    from shared.schemas import Kind
    from shared.topology import KEY_UPDATE

    now = [100.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
    host = object.__new__(Client)  # only the outbox's state matters here
    host.outbox, host._answering, host.outbox_since = [], set(), None
    host._uploads, host._upload_bytes, host.uploads_since = 0, 0, None

    def upload(size: int) -> None:
        host._queue(KEY_UPDATE, Kind.UPDATE, b"u" * size)

    host.outbox = [object()] * 30  # type: ignore[list-item]
    host.outbox_since = now[0]
    assert not host.outbox_full()  # 30 readies of one turn: kept together
    upload(1000)
    assert host.uploads_since == now[0] and not host.outbox_full()
    for _ in range(UPLOAD_FLUSH_COUNT - 2):
        upload(1000)
    assert not host.outbox_full()
    upload(1000)  # the UPLOAD_FLUSH_COUNT-th
    assert host.outbox_full()
    host.outbox = [o for o in host.outbox if not isinstance(o, PublishItem)]
    host._uploads, host._upload_bytes, host.uploads_since = 0, 0, None
    upload(UPLOAD_FLUSH_BYTES - 1)
    assert not host.outbox_full()
    upload(1)  # the bytes reached
    assert host.outbox_full()
    host._uploads, host._upload_bytes, host.uploads_since = 1, 10, now[0]
    now[0] += UPLOAD_WAIT_S  # an upload waited: it goes, whatever else waits
    assert host.outbox_full()
    host._uploads, host._upload_bytes, host.uploads_since = 0, 0, None
    assert not host.outbox_full()  # the readies alone wait longer
    now[0] = host.outbox_since + ANSWERS_WAIT_S
    assert host.outbox_full()


def test_uploads_a_failed_flush_left_in_a_bundle_still_count_towards_the_next() -> None:
    """``flush`` bundles a host's updates before it publishes; if the publish fails, the outbox
    keeps the ``updates`` bundle, and its updates (one answered task each, their bytes) still count
    towards the upload bounds of ``Client.outbox_full`` rather than escaping them."""
    from services.common import PublishItem, ServiceBase
    from shared.schemas import Kind
    from shared.topology import KEY_UPDATE

    svc = object.__new__(ServiceBase)  # only the outbox's state matters here
    (d1, _), (d2, _) = _parent(), _parent()
    bundle = PublishItem(Kind.UPDATES, KEY_UPDATE, b"x" * 40, inner={Kind.UPDATE: 9000}, answers=(d1, d2))

    def publish_fails() -> None:
        svc.outbox = [bundle]  # what ``_bundle`` made of two queued updates, then a lost connection
        raise ConnectionError("gone")

    svc.outbox = []
    svc._flush = publish_fails  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        svc.flush()
    assert (svc._uploads, svc._upload_bytes) == (2, 9000) and svc.uploads_since is not None
    assert svc._answering == {id(d1), id(d2)}


def test_an_aggregator_puts_back_a_bundle_of_an_unannounced_round_once_and_refuses_a_mixed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``updates`` whose entries are all of a round the aggregator has not heard of waits for it:
    put back once, after one pause, before any entry is handled (handled and then put back, its
    entries would come back redelivered until the round opened). One that mixes the open round's
    updates with the next round's (no honest host sends it) has the early ones dead-lettered
    ``unknown-round`` and the others handled."""
    import services.aggregator.service as agg_module
    from shared.schemas import Kind, Update, Updates, decode, encode

    t, agg = _aggregator(tmp_path, "early")
    pauses: list[float] = []
    handled: list[int] = []
    monkeypatch.setattr(agg_module.time, "sleep", pauses.append)
    monkeypatch.setattr(agg, "on_update", lambda env, msg, d: handled.append(msg.device_id))
    agg._entry_handlers[Kind.UPDATE] = agg.on_update

    def bundle(*rounds: int) -> tuple[Any, Any, Delivery, list[bool]]:
        entries = [
            encode(
                Kind.UPDATE, Update(device_id=i, num_samples=1), exp="early", round=r, sender="", inc="abcd"
            )
            for i, r in enumerate(rounds)
        ]
        data = encode(Kind.UPDATES, Updates(messages=entries), exp="early", round=0, sender="")
        env, msg = decode(data, max_bytes=1 << 20, exp="early")
        nacks: list[bool] = []
        d = Delivery(body=data, routing_key="update", redelivered=False, _nack=nacks.append)
        return env, msg, d, nacks

    env, msg, d, nacks = bundle(1, 1, 1)  # before any round_open
    agg.on_updates(env, msg, d)
    assert (nacks, len(pauses), handled) == ([True], 1, [])
    agg.round, agg.inc = 1, "abcd"  # round 1 is open
    env, msg, d, nacks = bundle(1, 2, 1)
    agg.on_updates(env, msg, d)
    assert (nacks, len(pauses), handled) == ([], 1, [0, 2])
    (letter,) = t.broker.queues[t.names.dead_letter_queue]
    assert letter.headers["x-fedfleet-reason"] == "unknown-round" and letter.body == msg.messages[1]


def test_a_dead_letter_is_counted_when_it_is_stored_not_when_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fedfleet_dead_letters_total`` counts what the dead-letter queue holds: an entry refused
    twice in a turn is stored once, and one refused before a sibling puts its bundle back is not
    stored (``split`` settles it) until the bundle comes back and it is refused again. Counted at
    each refusal, this turn made 4 for 1 letter."""
    from shared import metrics
    from shared.schemas import Kind, Update, Updates, decode, encode

    t, agg = _aggregator(tmp_path, "count")
    agg.round, agg.inc = 1, "abcd"
    put_back = [True]

    def handle(env: Any, msg: Any, d: Delivery) -> None:
        if msg.device_id == 0:
            agg.reject(d, "forged", "device 0: refused")
            agg.reject(d, "forged", "device 0: refused again in the same turn")
        elif put_back[0]:
            put_back[0] = False
            d.nack(requeue=True)
        else:
            d.ack()

    monkeypatch.setattr(agg, "on_update", handle)
    agg._entry_handlers[Kind.UPDATE] = agg.on_update
    entries = [
        encode(Kind.UPDATE, Update(device_id=i, num_samples=1), exp="count", round=1, sender="", inc="abcd")
        for i in range(2)
    ]
    t.publish("update", encode(Kind.UPDATES, Updates(messages=entries), exp="count", round=0, sender=""))
    counter = metrics.DEAD_LETTERS.labels("count", agg.service, "forged")
    before = counter._value.get()
    dlq = t.names.dead_letter_queue
    # device 0 refused (twice), device 1 puts the bundle back; it comes back in the same turn:
    # device 0 refused (twice) again, device 1 handled. One dead letter stored, one counted.
    agg.turn(0)
    assert put_back == [False] and len(t.broker.queues.get(dlq, [])) == 1
    assert counter._value.get() - before == 1
    assert decode(t.broker.queues[dlq][0].body, max_bytes=1 << 20, exp="count")[1].device_id == 0
