"""The wire contract: every message round-trips; anything malformed is a DecodeError with a reason."""

from __future__ import annotations

import contextlib

import blake3
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import codec
from shared.codec import tensorset
from shared.schemas import (
    ACCEPTED_VERSIONS,
    BODY_MODELS,
    KIND_CODES,
    KIND_SINCE,
    MAC_KEY_CONTEXT,
    PREVIOUS_VERSION,
    SCHEMA_VERSION,
    DecodeError,
    Envelope,
    Flush,
    Heartbeat,
    Kind,
    Partial,
    Reject,
    Update,
    _mac,
    decode,
    device_bytes,
    encode,
    exp_tag,
    message_parts,
    new_incarnation,
    task_key,
    transcode,
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
            Kind.PAYLOAD: {"digest": b"\x01" * 8, "tensors": {"w": t}},
            Kind.FETCH: {"digest": b"\x01" * 8},
            Kind.RECEIPT: {
                "device_id": 1,
                "aggregator_id": "a",
                "update_bytes": 1,
                "dense_bytes": 1,
                "num_samples": 1,
            },
            Kind.RECEIPTS: {
                "receipts": [
                    {
                        "device_id": 1,
                        "aggregator_id": "a",
                        "update_bytes": 1,
                        "dense_bytes": 1,
                        "num_samples": 1,
                    },
                    {
                        "device_id": 2,
                        "aggregator_id": "a",
                        "update_bytes": 9,
                        "dense_bytes": 4,
                        "num_samples": 3,
                        "metrics": {"train_loss": 0.25},
                        "timings": {"download_s": 0.5, "compute_s": 1.5, "upload_s": 0.25},
                    },
                ]
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
            Kind.ANSWERS: {"messages": [b"\x97\x07\x10", b"\x97\x07\x0e"]},
            Kind.UPDATES: {"messages": [b"\x97\x07\x09", b"\x97\x07\x09"]},
            Kind.TASKS: {
                "tasks": [
                    {"device_id": 1, "payload": b"\x01" * 8, "payload_bytes": 70, "key": b"k" * 16},
                    {"device_id": 4, "config": {"epochs": 2}, "key": b"j" * 16},
                ]
            },
            Kind.GOS: {
                "goes": [
                    {"device_id": 1, "upload": True},
                    {"device_id": 4, "upload": False, "reason": "surplus"},
                ]
            },
            Kind.EVALUATE: {"device_id": 1},
            Kind.EVAL_RESULT: {"device_id": 1, "metrics": {"eval_accuracy": 0.5}},
        }[kind]
    )


@pytest.mark.parametrize("kind", list(Kind))
def test_every_message_round_trips(kind: Kind) -> None:
    body = _sample(kind)
    data = encode(kind, body, exp="e1", round=4, sender="s", inc="abcd")  # type: ignore[arg-type]
    env, back = decode(data, max_bytes=LIMIT, exp="e1")
    assert (env.kind, env.exp, env.round, env.sender, env.inc) == (kind, "e1", 4, "s", "abcd")
    assert back.model_dump() == body.model_dump()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", list(Kind))
def test_every_message_round_trips_in_the_previous_version(kind: Kind) -> None:
    """What this build writes for a peer of the previous version (directly, or rewritten from a
    message of its own as a service does on the way out) reads back as the same message."""
    body = _sample(kind)
    assert isinstance(body, BODY_MODELS[kind])
    if KIND_SINCE.get(kind, 0) > PREVIOUS_VERSION:  # a kind the previous version does not have
        mine = encode(kind, body, exp="e1", round=4, sender="s", inc="abcd")
        with pytest.raises(ValueError, match="has no"):
            encode(kind, body, exp="e1", round=4, sender="s", inc="abcd", version=PREVIOUS_VERSION)
        with pytest.raises(ValueError, match="has no"):
            transcode(mine, PREVIOUS_VERSION, exp="e1")
        raw = codec.unpackb(mine, max_bytes=LIMIT)
        with pytest.raises(DecodeError) as err:  # nor is it read in an envelope of that version
            decode(codec.packb([PREVIOUS_VERSION, *raw[1:]]), max_bytes=LIMIT, exp="e1")
        assert err.value.reason == "schema"
        return
    for inc in ("abcd", "0a0b0c0d"):  # a 4-byte incarnation is an int, any other a bin
        data = encode(kind, body, exp="e1", round=4, sender="s", inc=inc, version=PREVIOUS_VERSION)
        mine = encode(kind, body, exp="e1", round=4, sender="s", inc=inc)
        for wire in (data, transcode(mine, PREVIOUS_VERSION, exp="e1")):
            raw = codec.unpackb(wire, max_bytes=LIMIT)
            assert raw[0] == PREVIOUS_VERSION and isinstance(raw[3], int if len(inc) == 8 else bytes)
            assert raw[1:] == codec.unpackb(mine, max_bytes=LIMIT)[1:]  # versions 5 and 6: one layout
            env, back = decode(wire, max_bytes=LIMIT, exp="e1")
            want = (PREVIOUS_VERSION, kind, "e1", 4, "s", inc)
            assert (env.v, env.kind, env.exp, env.round, env.sender, env.inc) == want
            assert back.model_dump() == body.model_dump()
        assert decode(mine, max_bytes=LIMIT)[0].inc == inc


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


@pytest.mark.parametrize("version", ACCEPTED_VERSIONS)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 50), st.binary(max_size=64))
def test_a_devices_mac_binds_device_round_and_every_byte(
    version: int, a: int, b: int, rnd: int, junk: bytes
) -> None:
    """A message MAC'd with device a's task key verifies under that key only: not under another
    device's, another round's or another round key's, and not once a single byte of it changed —
    in each version this build reads (each its own algorithm)."""
    round_key, other_round_key = "ab" * 16, "cd" * 16
    key = task_key(round_key, rnd, a)
    assert len(key) == 32 and task_key("", rnd, a) == ""
    upd = Update(device_id=a, num_samples=3, metrics={"train_loss": 0.5})
    data = encode(Kind.UPDATE, upd, exp="e", round=rnd, sender="d", inc="0a", key=key, version=version)
    env, _ = decode(data, max_bytes=LIMIT, exp="e")
    assert verify(env, key)
    assert env.telemetry, "an update's metrics travel as telemetry"
    tampered = env.model_copy(update={"telemetry": env.telemetry[:-1] + bytes([env.telemetry[-1] ^ 1])})
    assert not verify(tampered, key)  # the MAC covers the telemetry too
    assert not verify(env.model_copy(update={"exp": "f"}), key)  # the full experiment id is MAC'd
    assert verify(env, task_key(round_key, rnd, b)) == (a == b)
    assert not verify(env, task_key(round_key, rnd + 1, a))
    assert not verify(env, task_key(other_round_key, rnd, a))
    assert not verify(env, "")
    altered = env.model_copy(update={"body": env.body[:-1] + bytes([env.body[-1] ^ 1])})
    assert not verify(altered, key)
    assert not verify(env.model_copy(update={"round": rnd + 1}), key)  # replayed into another round
    assert not verify(env.model_copy(update={"kind": Kind.READY}), key)  # passed off as another kind
    assert not verify(env.model_copy(update={"inc": "0b"}), key)  # or as another server start's
    # a copy without the MAC, or with a MAC of other bytes, never verifies
    assert not verify(env.model_copy(update={"mac": b""}), key)
    other = (
        encode(Kind.UPDATE, upd, exp="e", round=rnd, sender="d", inc="0a", key=key, version=version) + junk
    )
    assert decode(other[: len(data)], max_bytes=LIMIT, exp="e")[0].mac == env.mac


@pytest.mark.parametrize(
    ("version", "tag"), [(6, "077402ff6e6789e4df7c12ea0a093edb"), (7, "d809e461253aa54897d0187e2fe1a9ae")]
)
def test_each_versions_mac_is_what_its_deployed_builds_make(version: int, tag: str) -> None:
    """Known answers, written down once from the build that introduced the version (6: 2026-11-29,
    the same value before and after version 7 arrived; 7: 2026-11-29): a change of a version's
    algorithm, key derivation, context string, input or truncation would leave every other test
    here passing and every deployed peer of that version unable to talk to this build. Version 5
    (HMAC-SHA-256) is retired: no MAC algorithm."""
    mac = _mac(
        "00112233445566778899aabbccddeeff",
        version,
        Kind.UPDATE,
        "exp-1",
        7,
        "0a0b0c0d",
        b"body bytes",
        b"tel",
    )
    assert mac.hex() == tag
    for retired in (4, 5):
        with pytest.raises(ValueError, match="no MAC algorithm"):
            _mac("00" * 16, retired, Kind.UPDATE, "e", 1, "", b"", b"")


# -- the lean wire form, its tensor sets, and the previous version -------------------------------
def _mac_by_hand(v: int, key: str, env: Envelope) -> bytes:
    """A message's MAC computed here from its parts, apart from ``shared.schemas._mac``."""
    head = f"{v}|{env.kind.value}|{env.exp}|{env.round}|{env.inc}|{len(env.body)}|".encode()
    k = blake3.blake3(bytes.fromhex(key), derive_key_context=MAC_KEY_CONTEXT).digest()
    return blake3.blake3(head + env.body + env.telemetry, key=k).digest(16)


def test_the_previous_version_is_read_and_each_version_has_its_own_mac() -> None:
    """Rolling upgrade: a build reads its own version and the one before (ACCEPTED_VERSIONS). Both
    MAC with keyed BLAKE3, but the version is part of what the MAC covers: each verifies under its
    own version only, so a MAC cannot be carried across."""
    assert ACCEPTED_VERSIONS == (6, SCHEMA_VERSION) and SCHEMA_VERSION == 7
    key = task_key("ab" * 16, 2, 5)
    w = codec.encode(codec.Dense(np.arange(6, dtype=np.float32).reshape(2, 3)))
    upd = Update(device_id=5, num_samples=10, tensors={"w": w}, metrics={"train_loss": 0.5})
    envs = {}
    for v in ACCEPTED_VERSIONS:
        data = encode(Kind.UPDATE, upd, exp="e", round=2, sender="", inc="0a0b0c0d", key=key, version=v)
        env, body = decode(data, max_bytes=LIMIT, exp="e")
        assert (env.v, body.device_id, body.num_samples) == (v, 5, 10)
        assert codec.decode(body.tensors["w"]) == codec.decode(w)
        assert verify(env, key) and env.mac == _mac_by_hand(v, key, env)
        envs[v] = env
    assert envs[6].body == envs[7].body and envs[6].mac != envs[7].mac
    for v, other in ((6, 7), (7, 6)):  # a MAC relabelled with the other version fails
        assert not verify(envs[v].model_copy(update={"v": other}), key)


@pytest.mark.parametrize("old", [4, 5])
def test_retired_versions_are_no_longer_read(old: int) -> None:
    """A build reads two versions: version 4 (the tensor set a bin inside the body's bin) and
    version 5 (HMAC-SHA-256 MACs) are dead-lettered as ``schema``, and say they are older, not newer."""
    data = codec.packb([old, KIND_CODES[Kind.UPDATE], exp_tag("e"), b"\x0a", 2, "", codec.packb([5, 10])])
    with pytest.raises(DecodeError) as err:
        decode(data, max_bytes=LIMIT, exp="e")
    assert err.value.reason == "schema" and "upgrade" not in str(err.value)


def test_bytes_after_a_body_that_no_tensor_set_takes_are_refused() -> None:
    """Version 5 puts a tensor set's blob raw after the body's fields: anything there when the
    body has no tensors is refused, not ignored (a MAC'd body must be exactly what is used)."""

    def reject(body: bytes) -> bytes:
        return codec.packb([SCHEMA_VERSION, KIND_CODES[Kind.REJECT], exp_tag("e"), b"", 1, "", body])

    fields = codec.packb([1, "memory"])
    assert decode(reject(fields), max_bytes=LIMIT)[1] == Reject(device_id=1, reason="memory")
    with pytest.raises(DecodeError) as err:
        decode(reject(fields + b"x"), max_bytes=LIMIT)
    assert err.value.reason == "malformed"
    # and a tensor set's blob is exactly what its layout says, not a byte more
    upd = encode(Kind.UPDATE, _sample(Kind.UPDATE), exp="e", round=1, sender="")  # type: ignore[arg-type]
    raw = codec.unpackb(upd, max_bytes=LIMIT)
    for body in (raw[6] + b"\0", raw[6][:-1]):
        with pytest.raises(DecodeError) as err:
            decode(codec.packb([*raw[:6], body, *raw[7:]]), max_bytes=LIMIT)
        assert err.value.reason == "tensor"


def test_every_incarnation_of_a_server_packs_in_the_same_bytes() -> None:
    """Version 5 sends a 4-byte incarnation as an int; the server's always have their top bit set, so
    a message's size does not depend on which start of the server sent it (a resumed run, or the
    same run in one process and over RabbitMQ, count the same bytes)."""
    sizes = set()
    for _ in range(200):
        inc = new_incarnation()
        data = encode(Kind.FLUSH, Flush(), exp="e", round=1, sender="", inc=inc)
        assert decode(data, max_bytes=LIMIT)[0].inc == inc
        sizes.add(len(data))
    assert len(sizes) == 1
    small = encode(Kind.FLUSH, Flush(), exp="e", round=1, sender="", inc="00000001")
    assert len(small) < min(sizes)  # what the top bit is there for: a small int packs shorter


def test_a_newer_version_is_refused_with_a_reason() -> None:
    data = codec.packb([SCHEMA_VERSION + 1, 0, 0, b"", 1, "", codec.packb([])])
    with pytest.raises(DecodeError) as err:
        decode(data, max_bytes=LIMIT)
    assert err.value.reason == "schema" and "upgrade" in str(err.value)


@pytest.mark.parametrize(
    "raw",
    [
        [SCHEMA_VERSION, 999, 0, b"", 1, "", b""],  # unknown kind code
        [SCHEMA_VERSION, 0, 0, "not-bin", 1, "", b""],  # incarnation must be bin or a 32-bit int
        [SCHEMA_VERSION, 0, 0, 1 << 32, 1, "", b""],  # an int wider than 32 bits
        [4, 0, 0, b"", 1, "", b""],  # version 4: no longer read
        [SCHEMA_VERSION, 0, 0, b""],  # too short
        [SCHEMA_VERSION, 0, 0, b"", -1, "", b""],  # negative round
    ],
)
def test_bad_envelopes_have_reasons(raw: list[object]) -> None:
    with pytest.raises(DecodeError) as err:
        decode(codec.packb(raw), max_bytes=LIMIT)
    assert err.value.reason == "schema"


def test_a_message_of_another_experiment_is_refused() -> None:
    data = encode(Kind.FLUSH, Flush(), exp="mine", round=1, sender="s")
    assert decode(data, max_bytes=LIMIT, exp="mine")[0].exp == "mine"
    with pytest.raises(DecodeError) as err:
        decode(data, max_bytes=LIMIT, exp="theirs")
    assert err.value.reason == "unknown-experiment"


def test_telemetry_is_not_a_devices_bytes() -> None:
    upd = Update(device_id=3, num_samples=10, metrics={"train_loss": 0.5, "steps": 4.0}, task_bytes=99)
    key = task_key("ab" * 16, 1, 3)
    data = encode(Kind.UPDATE, upd, exp="e", round=1, sender="", key=key)
    env = message_parts(data)
    assert env.telemetry and device_bytes(data) == len(data) - env.telemetry_bytes
    # without telemetry the same update is exactly device_bytes long
    bare = encode(Kind.UPDATE, Update(device_id=3, num_samples=10), exp="e", round=1, sender="", key=key)
    assert len(bare) == device_bytes(data)


@given(
    n=st.sampled_from([0, 1, 40, 70, 16_000, 17_000]),
    inc=st.sampled_from(["", "deadbeef", "80000001"]),
    rnd=st.integers(0, 70_000),
    version=st.sampled_from(sorted(ACCEPTED_VERSIONS)),
)
def test_a_devices_size_is_known_before_its_telemetry(n: int, inc: str, rnd: int, version: int) -> None:
    """``device_size`` of a packed body is ``device_bytes`` of the message it becomes, whatever its
    telemetry (the client computes it before the upload's duration, without a MAC): body sizes
    across every msgpack bin width, every incarnation form and schema version."""
    from shared.schemas import Timings, device_size, pack_body

    tensors = {"w": codec.encode(codec.Dense(np.arange(n, dtype=np.float32)))} if n else {}
    key = task_key("ab" * 16, rnd, 3)
    plain = Update(device_id=3, num_samples=10, tensors=tensors, task_bytes=12_345)
    packed = pack_body(Kind.UPDATE, plain, version=version)
    size = device_size(Kind.UPDATE, packed, exp="e", round=rnd, sender="", inc=inc, version=version)
    for upload_s in (0.0, 1e-3, 123.456):
        upd = plain.model_copy(update={"timings": Timings(upload_s=upload_s), "metrics": {"loss": upload_s}})
        data = encode(
            Kind.UPDATE, upd, exp="e", round=rnd, sender="", inc=inc, key=key, version=version, packed=packed
        )
        assert device_bytes(data) == size


def _tensors() -> dict[str, dict[str, object]]:
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    mask = (np.arange(24) % 3 == 0).reshape(4, 6)
    return {
        "dense": codec.encode(codec.Dense(w)),
        "thr": codec.encode(codec.Threshold(np.ones(6, dtype=np.float32))),
        "bitmask": codec.encode(codec.Sparse.from_dense(w, mask), sparse_format="bitmask"),
        "coo": codec.encode(codec.Sparse.from_dense(w, mask), sparse_format="coo"),
        "sliced": codec.encode(codec.Sliced.from_dense(w, [np.array([0, 2]), None])),
        "sliced2": codec.encode(codec.Sliced.from_dense(w, [np.array([1]), np.array([0, 5])])),
    }


def _same(a: dict[str, dict[str, object]], b: dict[str, dict[str, object]]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert codec.decode(a[k]) == codec.decode(b[k]), k


def test_a_tensor_set_round_trips_inline_by_digest_and_by_reference() -> None:
    ts = _tensors()
    wire = tensorset.to_wire(ts)
    back, inline = tensorset.unpack(codec.unpackb(codec.packb(wire), max_bytes=LIMIT), {})
    _same(ts, back)
    assert inline is not None
    d = tensorset.digest(inline)
    # the receiver knows the layout: a digest in place of it
    short = tensorset.to_wire(ts, {d: inline})
    assert isinstance(short[0], bytes) and len(codec.packb(short)) < len(codec.packb(wire))
    _same(ts, tensorset.unpack(codec.unpackb(codec.packb(short), max_bytes=LIMIT), {d: inline})[0])
    # a sparse copy of two dense tensors, one reshaped: references into the known layout
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    other = {
        "dense": codec.encode(codec.Sparse.from_dense(w, w > 10)),
        "thr": codec.encode(codec.Dense(np.ones(3, dtype=np.float32))),
        "new": codec.encode(codec.Dense(np.zeros(2, dtype=np.float32))),
    }
    ref = tensorset.to_wire(other, {d: inline})
    assert isinstance(ref[0], list) and ref[0][0] == d
    _same(other, tensorset.unpack(codec.unpackb(codec.packb(ref), max_bytes=LIMIT), {d: inline})[0])
    with pytest.raises(tensorset.UnknownLayout):
        tensorset.unpack(short, {})


def test_references_into_a_known_layout() -> None:
    """A device's update of a dense model: entries skipped, sliced on one or both axes, reshaped to
    a vector or to a matrix, and one out of order — each round-trips, and a ref is one byte (the
    index implied by the order, a slice's axes inside the ref)."""
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    known_t = {n: codec.encode(codec.Dense(w)) for n in ("a", "b", "c", "d", "e")}
    layout = tensorset.to_wire(known_t)[0]
    d = tensorset.digest(layout)
    update = {
        "b": codec.encode(codec.Sliced.from_dense(w, [np.array([1, 3]), None])),  # skips "a"
        "c": codec.encode(codec.Sliced.from_dense(w, [np.array([0]), np.array([2, 5])])),
        "d": codec.encode(codec.Dense(w[w > 20])),  # the kept values, as a vector
        "e": codec.encode(codec.Dense(w[:2].reshape(2, 2, 3))),  # reshaped, not to a vector
        "a": codec.encode(codec.Sparse.from_dense(w, w > 10), sparse_format="coo"),  # out of order
    }
    wire = tensorset.to_wire(update, {d: layout})
    assert isinstance(wire[0], list) and wire[0][0] == d
    back, inline = tensorset.unpack(codec.unpackb(codec.packb(wire), max_bytes=LIMIT), {d: layout})
    _same(update, back)
    assert inline is None
    sliced, skip = 4, 16
    assert wire[0][1:] == [
        1 << 5 | skip | 4, 1,  # "b": skip one entry, sliced on axis 0
        3 << 5 | sliced,  # "c": sliced on both axes
        8 | 0, 3,  # "d": a vector of 3
        8 | 0, [2, 2, 3],  # "e"
        ["a", 3, 1, [4, 6]],  # "a" comes before the entries already named: in full
    ]  # fmt: skip


@given(st.lists(st.one_of(st.integers(-2, 300), st.lists(st.integers(0, 9), max_size=3)), max_size=8))
def test_hostile_references_raise_codec_errors_only(items: list[object]) -> None:
    layout = tensorset.to_wire({"w": codec.encode(codec.Dense(np.zeros((2, 3), np.float32)))})[0]
    d = tensorset.digest(layout)
    with contextlib.suppress(codec.CodecError):
        out, _ = tensorset.unpack([[d, *items], bytes(64), [1, 1, 1]], {d: layout})
        for t in out.values():
            with contextlib.suppress(codec.CodecError):
                codec.decode(t)


@pytest.mark.parametrize("cut", [1, 4])
def test_a_tensor_set_whose_buffer_disagrees_with_its_layout_is_refused(cut: int) -> None:
    wire = tensorset.to_wire(_tensors())
    with pytest.raises(codec.CodecError):
        tensorset.unpack([wire[0], wire[1][:-cut], *wire[2:]], {})
    with pytest.raises(codec.CodecError):
        tensorset.unpack([wire[0], wire[1] + b"\0" * cut, *wire[2:]], {})


@given(st.lists(st.integers(-5, 2**40), max_size=6), st.binary(max_size=64))
def test_hostile_tensor_sets_raise_codec_errors_only(shape: list[int], blob: bytes) -> None:
    """Whatever a sender claims, unpacking ends in tensor dicts or a CodecError, nothing else."""
    for code in range(6):
        entry: list[object] = ["t", code, 1, shape] + ([1] if code == 4 else [])
        try:
            out, inline = tensorset.unpack([[entry], blob, [3, 1]], {})
        except codec.CodecError:
            continue
        # what splits cleanly is the layout it claimed, and the codec's own checks take it from there
        assert list(out) == ["t"] and inline == [entry]
        with contextlib.suppress(codec.CodecError):
            codec.decode(out["t"])
