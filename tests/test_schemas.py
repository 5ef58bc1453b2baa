"""The wire contract: every message round-trips; anything malformed is a DecodeError with a reason."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import codec
from shared.schemas import (
    BODY_MODELS,
    DecodeError,
    Heartbeat,
    Kind,
    Partial,
    Update,
    decode,
    encode,
    task_key,
    verify,
)

LIMIT = 1 << 20


def _sample(kind: Kind) -> object:
    t = codec.encode(codec.Dense(np.arange(6, dtype=np.float32).reshape(2, 3)))
    samples = {
        Kind.HEARTBEAT: Heartbeat(host_id="c0", capacity=4, holding=[3], epoch=2),
        Kind.UPDATE: Update(device_id=3, num_samples=10, tensors={"w": t}, metrics={"train_loss": 0.5}),
        Kind.PARTIAL: Partial(
            aggregator_id="a", seq=1, devices=[1, 2], tensors={"w": t}, scalars={"weight": 2}
        ),
    }
    return samples.get(kind) or BODY_MODELS[kind].model_validate(
        {
            Kind.LEASE: {"host_id": "c", "epoch": 1, "devices": [1, 2]},
            Kind.DEVICE_STATE: {"device_id": 1, "files": {"spafl-1.npz": b"\x00\x01"}},
            Kind.ROUND_OPEN: {"selected": [1, 2], "deadline_unix": 1.0},
            Kind.TASK: {"device_id": 1, "tensors": {"w": t}},
            Kind.PAYLOAD: {"digest": b"\x01" * 16, "tensors": {"w": t}},
            Kind.FETCH: {"digest": b"\x01" * 16},
            Kind.RECEIPT: {
                "device_id": 1,
                "aggregator_id": "a",
                "update_bytes": 1,
                "dense_bytes": 1,
                "num_samples": 1,
            },
            Kind.REJECT: {"device_id": 1, "reason": "memory"},
            Kind.FLUSH: {},
            Kind.DECISION: {"seq": 1, "accepted": True},
            Kind.ROUND_SUMMARY: {"outcome": "completed"},
            Kind.STOP: {},
            Kind.JOIN: {"hint": "pod-7"},
            Kind.JOIN_REPLY: {"host_id": "h1", "user": "fedfleet-host-h1", "password": "x"},
            Kind.READY: {"device_id": 1, "finish_s": 2.5, "update_bytes": 100},
            Kind.GO: {"device_id": 1, "upload": False, "reason": "deadline"},
            Kind.EVALUATE: {"device_id": 1},
            Kind.EVAL_RESULT: {"device_id": 1, "metrics": {"eval_accuracy": 0.5}},
        }[kind]
    )


@pytest.mark.parametrize("kind", list(Kind))
def test_every_message_round_trips(kind: Kind) -> None:
    body = _sample(kind)
    data = encode(kind, body, exp="e1", round=4, sender="s", inc="abc")  # type: ignore[arg-type]
    env, back = decode(data, max_bytes=LIMIT)
    assert (env.kind, env.exp, env.round, env.sender, env.inc) == (kind, "e1", 4, "s", "abc")
    assert back.model_dump() == body.model_dump()  # type: ignore[attr-defined]


def test_tensors_survive_the_envelope() -> None:
    sample = _sample(Kind.UPDATE)
    assert isinstance(sample, Update)
    _env, body = decode(encode(Kind.UPDATE, sample, exp="e", round=1, sender="d"), max_bytes=LIMIT)
    t = codec.decode(body.tensors["w"])
    assert isinstance(t, codec.Dense)
    np.testing.assert_array_equal(t.array, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_wrong_body_type_is_refused_when_sending() -> None:
    with pytest.raises(TypeError):
        encode(Kind.TASK, _sample(Kind.HEARTBEAT), exp="e", round=1, sender="s")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xc1\xc1garbage", "malformed"),
        (codec.packb({"v": 1, "kind": "update"}), "schema"),
        (codec.packb([1, 2, 3]), "schema"),
        (
            codec.packb(
                {"v": 1, "kind": "teleport", "exp": "e", "round": 1, "sender": "s", "id": "x", "body": {}}
            ),
            "schema",
        ),
        (
            codec.packb(
                {"v": 99, "kind": "flush", "exp": "e", "round": 1, "sender": "s", "id": "x", "body": {}}
            ),
            "schema",
        ),
        (
            codec.packb(
                {
                    "v": 1,
                    "kind": "update",
                    "exp": "e",
                    "round": 1,
                    "sender": "s",
                    "id": "x",
                    "body": {"device_id": -1, "num_samples": 1},
                }
            ),
            "schema",
        ),
        (
            codec.packb(
                {
                    "v": 1,
                    "kind": "flush",
                    "exp": "e",
                    "round": 1,
                    "sender": "s",
                    "id": "x",
                    "body": {"surprise": 1},
                }
            ),
            "schema",
        ),
        (b"\x00" * (LIMIT + 1), "oversized"),
    ],
)
def test_bad_messages_have_reasons(data: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode(data, max_bytes=LIMIT)
    assert err.value.reason == reason


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 50), st.binary(max_size=64))
def test_a_devices_mac_binds_device_round_and_every_byte(a: int, b: int, rnd: int, junk: bytes) -> None:
    """A message MAC'd with device a's task key verifies under that key only: not under another
    device's, another round's or another round key's, and not once a single byte of it changed."""
    round_key, other_round_key = "ab" * 16, "cd" * 16
    key = task_key(round_key, rnd, a)
    assert len(key) == 32 and task_key("", rnd, a) == ""
    upd = Update(device_id=a, num_samples=3, metrics={"train_loss": 0.5})
    data = encode(Kind.UPDATE, upd, exp="e", round=rnd, sender="d", inc="i", key=key)
    env, _ = decode(data, max_bytes=LIMIT)
    assert verify(env, key)
    assert verify(env, task_key(round_key, rnd, b)) == (a == b)
    assert not verify(env, task_key(round_key, rnd + 1, a))
    assert not verify(env, task_key(other_round_key, rnd, a))
    assert not verify(env, "")
    altered = env.model_copy(update={"body": env.body[:-1] + bytes([env.body[-1] ^ 1])})
    assert not verify(altered, key)
    assert not verify(env.model_copy(update={"round": rnd + 1}), key)  # replayed into another round
    # a copy without the MAC, or with a MAC of other bytes, never verifies
    assert not verify(env.model_copy(update={"mac": b""}), key)
    other = encode(Kind.UPDATE, upd, exp="e", round=rnd, sender="d", inc="i", key=key) + junk
    assert decode(other[: len(data)], max_bytes=LIMIT)[0].mac == env.mac
