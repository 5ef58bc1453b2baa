"""Tests for shared.codec: exact round trips, size bounds, and rejection of every malformed payload.

Values are drawn from a numpy RNG seeded by hypothesis (rather than element-by-element hypothesis
arrays) so that thousands of examples with up to a few thousand elements fit in seconds; hypothesis
still controls and shrinks shape, dtype, byte order, density and the seed.
"""

from __future__ import annotations

import contextlib
import enum
import math
import pickle
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.codec import (
    DEFAULT_LIMITS,
    HEADER_BYTES,
    REASONS,
    CodecError,
    Dense,
    Limits,
    Sliced,
    Sparse,
    SparseFormat,
    Tensor,
    Threshold,
    decode,
    dense_bytes,
    encode,
    index_dtype_for,
    packb,
    unpackb,
)

ALLOW_NAN = Limits(allow_nonfinite=True)
MAX_BYTES = 1 << 26

DTYPES = ["<f2", "<f4", "<f8", ">f4", ">f8", "|i1", "<i2", ">i4", "<i8", "|u1", "<u2", "<u4", ">u8", "|b1"]
FLOAT_DTYPES = ["<f2", "<f4", "<f8", ">f4", ">f8"]
DENSITIES: list[float | str] = [0.0, "tiny", 0.5, 1.0]
SPARSE_FORMATS: list[SparseFormat] = ["auto", "bitmask", "coo"]

HYPO = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------- helpers


def random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values covering the dtype's range, with NaN/Inf/-0.0 sprinkled into floats."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        arr = (rng.standard_normal(shape) * 100).astype(dt)
        flat = arr.reshape(-1)
        if flat.size:
            specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], dtype=dt)
            picks = rng.random(flat.size) < 0.1
            flat[picks] = rng.choice(specials, size=int(picks.sum()))
        return arr
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, dtype=dt.newbyteorder("="), endpoint=True).astype(dt)


def random_mask(rng: np.random.Generator, shape: tuple[int, ...], density: float | str) -> np.ndarray:
    n = math.prod(shape)
    if density == "tiny":
        mask = np.zeros(n, dtype=bool)
        if n:
            mask[rng.integers(n)] = True
        return mask.reshape(shape)
    assert isinstance(density, float)
    return rng.random(shape) < density if 0.0 < density < 1.0 else np.full(shape, density == 1.0)


def random_axis_indices(
    rng: np.random.Generator, shape: tuple[int, ...], density: float | str
) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    for dim in shape:
        if rng.random() < 0.3:
            out.append(None)
        else:
            out.append(np.flatnonzero(random_mask(rng, (dim,), density)))
    return out


@st.composite
def tensors(draw: st.DrawFn, kind: str) -> Tensor:
    dtype = draw(st.sampled_from(FLOAT_DTYPES if kind == "threshold" else DTYPES))
    if kind == "threshold":
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=300))
    else:
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = random_values(rng, shape, dtype)
    if kind == "dense":
        return Dense(values)
    if kind == "threshold":
        return Threshold(values)
    density = draw(st.sampled_from(DENSITIES))
    if kind == "sparse":
        return Sparse.from_dense(values, random_mask(rng, shape, density))
    return Sliced.from_dense(values, random_axis_indices(rng, shape, density))


any_tensor = st.one_of(*(tensors(k) for k in ("dense", "threshold", "sparse", "sliced")))


def roundtrip(t: Tensor, sparse_format: Any = "auto", limits: Limits = ALLOW_NAN) -> Tensor:
    return decode(unpackb(packb(encode(t, sparse_format=sparse_format)), max_bytes=MAX_BYTES), limits)


def information_size(t: Tensor, fmt: str) -> int:
    if isinstance(t, Dense | Threshold):
        return t.array.nbytes
    if isinstance(t, Sparse):
        n, nnz, isz = math.prod(t.shape), t.nnz, t.values.dtype.itemsize
        if fmt == "bitmask":
            return (n + 7) // 8 + nnz * isz
        return nnz * (index_dtype_for(n).itemsize + isz)
    assert isinstance(t, Sliced)
    idx = sum(
        ix.size * index_dtype_for(dim).itemsize
        for ix, dim in zip(t.indices, t.shape, strict=True)
        if ix is not None
    )
    return idx + t.values.nbytes


def le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")


# ------------------------------------------------------------------------------------------- round trips


@HYPO
@given(t=tensors("dense"))
def test_dense_roundtrip(t: Dense) -> None:
    d = roundtrip(t)
    assert isinstance(d, Dense)
    assert d == t
    assert d.array.shape == t.array.shape and d.array.dtype == le(t.array.dtype)
    assert not d.array.flags.writeable


@HYPO
@given(t=tensors("threshold"))
def test_threshold_roundtrip(t: Threshold) -> None:
    d = roundtrip(t)
    assert isinstance(d, Threshold)
    assert d == t and d.array.dtype == le(t.array.dtype)


@HYPO
@given(t=tensors("sparse"), fmt=st.sampled_from(SPARSE_FORMATS))
def test_sparse_roundtrip(t: Sparse, fmt: str) -> None:
    d = roundtrip(t, fmt)
    assert isinstance(d, Sparse)
    assert d == t
    assert d.shape == t.shape and d.values.dtype == le(t.values.dtype)
    assert d.flat_indices.dtype == np.int64
    np.testing.assert_array_equal(d.flat_indices, t.flat_indices)
    np.testing.assert_array_equal(d.mask(), t.mask())
    assert Dense(d.to_dense()) == Dense(t.to_dense())


@HYPO
@given(t=tensors("sliced"))
def test_sliced_roundtrip(t: Sliced) -> None:
    d = roundtrip(t)
    assert isinstance(d, Sliced)
    assert d == t
    assert d.shape == t.shape and d.values.shape == t.values.shape and d.values.dtype == le(t.values.dtype)
    for a, b in zip(d.indices, t.indices, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(d.mask(), t.mask())
    assert Dense(d.to_dense()) == Dense(t.to_dense())


@HYPO
@given(t=any_tensor)
def test_decode_without_msgpack(t: Tensor) -> None:
    """In-process transports may hand the encoded dict (memoryviews) straight to decode."""
    assert decode(encode(t), ALLOW_NAN) == t


# ------------------------------------------------------------------------------------------------- sizes


@HYPO
@given(t=st.one_of(tensors("dense"), tensors("threshold"), tensors("sliced")))
def test_size_bound_plain(t: Tensor) -> None:
    assert len(packb(encode(t))) <= information_size(t, "") + HEADER_BYTES


@HYPO
@given(t=tensors("sparse"))
def test_size_bound_sparse_and_auto_is_smallest(t: Sparse) -> None:
    sizes = {fmt: len(packb(encode(t, sparse_format=fmt))) for fmt in SPARSE_FORMATS}
    assert sizes["bitmask"] <= information_size(t, "bitmask") + HEADER_BYTES
    assert sizes["coo"] <= information_size(t, "coo") + HEADER_BYTES
    assert sizes["auto"] == min(sizes["bitmask"], sizes["coo"])


def _framing(n: int) -> int:
    return 2 if n < 256 else 3 if n < 65536 else 5


def test_header_bytes_is_the_worst_case_for_four_dims() -> None:
    """Re-derive HEADER_BYTES: pack worst-case headers (uint64 dims, bin32-framed buffers)."""
    common = {"v": 1, "dtype": "<f4", "shape": [2**64 - 1] * 4}
    ix = {"dtype": "<u8", "data": b""}
    headers: list[tuple[dict[str, Any], int]] = [
        ({**common, "kind": "dense", "data": b""}, 1),
        ({**common, "kind": "threshold", "data": b""}, 1),
        ({**common, "kind": "sparse", "format": "bitmask", "mask": b"", "values": b""}, 2),
        ({**common, "kind": "sparse", "format": "coo", "indices": ix, "values": b""}, 2),
        ({**common, "kind": "sliced", "indices": [ix] * 4, "values": b""}, 5),
    ]
    worst = max(len(packb(h)) + n_bins * (_framing(1 << 20) - _framing(0)) for h, n_bins in headers)
    assert worst == HEADER_BYTES


def test_big_tensors_use_wider_index_dtypes_and_stay_within_bound() -> None:
    rng = np.random.default_rng(1)
    values = rng.standard_normal((300, 300)).astype(np.float32)  # 90_000 elements: uint32 flat indices
    sp = Sparse.from_dense(values, rng.random(values.shape) < 0.01)
    payload = encode(sp, sparse_format="coo")
    assert payload["indices"]["dtype"] == "<u4"
    assert len(packb(payload)) <= information_size(sp, "coo") + HEADER_BYTES
    sl = Sliced.from_dense(values, [np.arange(0, 300, 2), None])
    assert encode(sl)["indices"][0]["dtype"] == "<u2"
    assert roundtrip(sp, "coo") == sp and roundtrip(sp, "bitmask") == sp and roundtrip(sl) == sl


@pytest.mark.parametrize(
    ("extent", "dtype"),
    [(0, "|u1"), (1, "|u1"), (256, "|u1"), (257, "<u2"), (65536, "<u2"), (65537, "<u4"), (2**32 + 1, "<u8")],
)
def test_index_dtype_is_the_smallest_sufficient(extent: int, dtype: str) -> None:
    assert index_dtype_for(extent).str == dtype


def test_auto_picks_bitmask_when_dense_and_coo_when_very_sparse() -> None:
    values = np.ones(10_000, dtype=np.float32)
    assert encode(Sparse.from_dense(values, np.arange(10_000) % 2 == 0))["format"] == "bitmask"
    assert encode(Sparse.from_dense(values, np.arange(10_000) == 7))["format"] == "coo"


def test_dense_bytes() -> None:
    a = np.zeros((10, 20), dtype=np.float32)
    assert dense_bytes(Dense(a)) == 800
    assert dense_bytes(Sparse.from_dense(a, a > 1)) == 800
    assert dense_bytes(Sliced.from_dense(a.astype(np.float16), [[1], None])) == 400
    assert dense_bytes(Threshold(np.zeros(7, dtype=np.float64))) == 56


# ------------------------------------------------------------------------------- encoding specifics


def test_big_endian_input_is_encoded_little_endian() -> None:
    a = np.arange(12, dtype=">f4").reshape(3, 4) / 3
    payload = encode(Dense(a))
    assert payload["dtype"] == "<f4"
    assert bytes(payload["data"]) == a.astype("<f4").tobytes()
    d = decode(unpackb(packb(payload), max_bytes=MAX_BYTES))
    assert isinstance(d, Dense)
    np.testing.assert_array_equal(d.array, a)
    s = Sparse.from_dense(np.arange(6, dtype=">i8"), np.arange(6) > 2)
    assert bytes(encode(s)["values"]) == np.array([3, 4, 5], dtype="<i8").tobytes()


def test_non_contiguous_input_is_encoded() -> None:
    a = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]
    assert roundtrip(Dense(a)) == Dense(a)


def test_contiguous_little_endian_encode_is_zero_copy_and_decode_is_a_view() -> None:
    a = np.arange(1000, dtype="<f4")
    payload = encode(Dense(a))
    assert np.shares_memory(np.frombuffer(payload["data"], dtype=np.uint8), a)
    obj = unpackb(packb(payload), max_bytes=MAX_BYTES)
    d = decode(obj)
    assert isinstance(d, Dense)
    assert np.shares_memory(d.array, np.frombuffer(obj["data"], dtype=np.uint8))
    assert not d.array.flags.writeable
    with pytest.raises(ValueError):
        d.array[0] = 1.0


def test_bitmask_layout_is_lsb_first() -> None:
    s = Sparse((10,), np.array([0, 3, 9]), np.array([1, 2, 3], dtype=np.uint8))
    payload = encode(s, sparse_format="bitmask")
    assert bytes(payload["mask"]) == bytes([0b00001001, 0b00000010])
    assert bytes(payload["values"]) == b"\x01\x02\x03"


def test_encode_rejects_bad_tensors() -> None:
    with pytest.raises(CodecError) as e:
        Dense(np.array(["a", "b"]))
    assert e.value.reason == "dtype"
    with pytest.raises(CodecError) as e:
        Dense(np.array([object()]))
    assert e.value.reason == "dtype"
    with pytest.raises(CodecError) as e:
        Threshold(np.zeros((2, 2), dtype=np.float32))
    assert e.value.reason == "shape"
    with pytest.raises(CodecError) as e:
        Threshold(np.zeros(3, dtype=np.int32))
    assert e.value.reason == "dtype"
    with pytest.raises(CodecError) as e:
        Sparse((4,), np.array([2, 1]), np.zeros(2))
    assert e.value.reason == "tensor"
    with pytest.raises(CodecError) as e:
        Sparse((4,), np.array([1, 4]), np.zeros(2))
    assert e.value.reason == "tensor"
    with pytest.raises(CodecError) as e:
        Sparse((4,), np.array([1]), np.zeros(2))
    assert e.value.reason == "tensor"
    with pytest.raises(CodecError) as e:
        Sliced.from_dense(np.zeros((3, 3)), [[2, 0], None])
    assert e.value.reason == "tensor"
    with pytest.raises(CodecError) as e:
        Sliced((3, 3), (None, None), np.zeros((3, 2)))
    assert e.value.reason == "tensor"
    with pytest.raises(CodecError) as e:
        encode(Sparse.from_dense(np.zeros(2), [True, False]), sparse_format="zip")  # type: ignore[arg-type]
    assert e.value.reason == "kind"
    with pytest.raises(CodecError) as e:
        encode(np.zeros(3))  # type: ignore[arg-type]
    assert e.value.reason == "kind"


def test_equality_is_exact() -> None:
    a = np.array([0.0, np.nan], dtype=np.float32)
    assert Dense(a) == Dense(a.copy())
    assert Dense(a) == Dense(a.astype(">f4"))
    assert Dense(a) != Dense(a.astype(np.float64))
    assert Dense(np.array([0.0])) != Dense(np.array([-0.0]))
    assert Dense(a) != Threshold(a)
    with pytest.raises(TypeError):
        hash(Dense(a))


def test_codec_error_is_a_picklable_value_error() -> None:
    err = CodecError("tensor", "bad")
    assert isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert back.reason == "tensor" and str(back) == str(err)


# --------------------------------------------------------------------------------- malformed payloads


def _wire(t: Tensor, fmt: Any = "auto") -> dict[str, Any]:
    """A valid payload as the receiver sees it (after msgpack: bytes, lists)."""
    out = unpackb(packb(encode(t, sparse_format=fmt)), max_bytes=MAX_BYTES)
    assert isinstance(out, dict)
    return out


F32 = np.arange(1, 13, dtype=np.float32).reshape(3, 4)


def dense_p() -> dict[str, Any]:
    return _wire(Dense(F32))


def coo_p() -> dict[str, Any]:
    # 12 elements -> uint8 indices [1, 5, 6, 10]
    return _wire(Sparse.from_dense(F32, np.isin(np.arange(12), [1, 5, 6, 10]).reshape(3, 4)), "coo")


def bitmask_p() -> dict[str, Any]:
    return _wire(Sparse.from_dense(F32, np.isin(np.arange(12), [1, 5, 6, 10]).reshape(3, 4)), "bitmask")


def sliced_p() -> dict[str, Any]:
    return _wire(Sliced.from_dense(F32, [[0, 2], None]))


def threshold_p() -> dict[str, Any]:
    return _wire(Threshold(np.ones(5, dtype=np.float32)))


def _set(base: Callable[[], dict[str, Any]], **changes: Any) -> Callable[[], Any]:
    return lambda: {**base(), **changes}


def _drop(base: Callable[[], dict[str, Any]], key: str) -> Callable[[], Any]:
    return lambda: {k: v for k, v in base().items() if k != key}


def _idx(base: Callable[[], dict[str, Any]], data: bytes, dtype: str = "|u1") -> Callable[[], Any]:
    return _set(base, indices={"dtype": dtype, "data": data})


def _nan(base: Callable[[], dict[str, Any]], key: str, value: float = np.nan) -> Callable[[], Any]:
    def make() -> dict[str, Any]:
        p = base()
        arr = np.frombuffer(p[key], dtype="<f4").copy()
        arr[-1] = value
        p[key] = arr.tobytes()
        return p

    return make


MALFORMED: list[tuple[str, Callable[[], Any], str]] = [
    # structure
    ("not a map", lambda: [1, 2, 3], "malformed"),
    ("missing field", _drop(dense_p, "shape"), "malformed"),
    ("unknown field", _set(dense_p, extra=1), "malformed"),
    ("no version", _drop(dense_p, "v"), "malformed"),
    ("future version", _set(dense_p, v=2), "version"),
    ("non-str key", lambda: {**dense_p(), 1: 2}, "malformed"),
    ("data not binary", _set(dense_p, data="abc"), "malformed"),
    ("dtype not str", _set(dense_p, dtype=5), "malformed"),
    ("shape not list", _set(dense_p, shape="3,4"), "malformed"),
    ("shape entry float", _set(dense_p, shape=[3.0, 4]), "malformed"),
    ("shape entry bool", _set(dense_p, shape=[True, 12]), "malformed"),
    ("unknown kind", _set(dense_p, kind="quantized"), "kind"),
    ("unknown sparse format", _set(coo_p, format="csr"), "kind"),
    ("sparse without format", _drop(coo_p, "format"), "malformed"),
    ("coo fields under bitmask format", _set(coo_p, format="bitmask"), "malformed"),
    # dtype
    ("object dtype", _set(dense_p, dtype="|O"), "dtype"),
    ("unicode dtype", _set(dense_p, dtype="<U4"), "dtype"),
    ("void dtype", _set(dense_p, dtype="V8"), "dtype"),
    ("big-endian on the wire", _set(dense_p, dtype=">f4"), "dtype"),
    ("structured dtype text", _set(dense_p, dtype="[('a', '<f4')]"), "dtype"),
    ("datetime dtype", _set(dense_p, dtype="<M8[ns]"), "dtype"),
    ("signed index dtype", _idx(coo_p, b"\x01\x05\x06\x0a", "<i1"), "dtype"),
    ("int threshold", _set(threshold_p, dtype="<i4"), "dtype"),
    # shape and limits
    ("negative dim", _set(dense_p, shape=[-3, -4]), "shape"),
    ("huge shape", _set(dense_p, shape=[2**40, 2**40]), "limits"),
    ("huge shape with a zero", _set(dense_p, shape=[0, 2**63]), "limits"),
    ("too many dims", _set(dense_p, shape=[1] * 9), "limits"),
    ("huge sparse shape", _set(bitmask_p, shape=[2**62, 2**62]), "limits"),
    ("2-D threshold", _set(threshold_p, shape=[1, 5]), "shape"),
    # buffer lengths
    ("truncated buffer", lambda: {**dense_p(), "data": dense_p()["data"][:-1]}, "tensor"),
    ("truncated by one item", lambda: {**dense_p(), "data": dense_p()["data"][:-4]}, "tensor"),
    ("buffer longer than shape", lambda: {**dense_p(), "data": dense_p()["data"] + b"\0" * 4}, "tensor"),
    (
        "bool byte not 0/1",
        lambda: {**_wire(Dense(np.ones(3, dtype=bool))), "data": b"\x01\x02\x00"},
        "tensor",
    ),
    # COO
    ("coo index out of range", _idx(coo_p, b"\x01\x05\x06\x0c"), "tensor"),
    ("coo unsorted", _idx(coo_p, b"\x05\x01\x06\x0a"), "tensor"),
    ("coo duplicate", _idx(coo_p, b"\x01\x05\x05\x0a"), "tensor"),
    ("coo count mismatch", _idx(coo_p, b"\x01\x05\x06"), "tensor"),
    ("coo ragged index buffer", _idx(coo_p, b"\x01\x00\x05", "<u2"), "tensor"),
    ("coo index map field", _set(coo_p, indices={"dtype": "|u1"}), "malformed"),
    ("coo index not a map", _set(coo_p, indices=b"\x01\x05\x06\x0a"), "malformed"),
    ("coo more values than elements", _set(coo_p, shape=[1, 2]), "tensor"),
    # bitmask
    ("bitmask popcount too high", _set(bitmask_p, mask=bytes([0b01100011, 0b00000100])), "tensor"),
    ("bitmask popcount too low", _set(bitmask_p, mask=bytes([0b01100010, 0b00000000])), "tensor"),
    # same popcount as the valid mask: only the padding check can catch it
    ("bitmask nonzero padding", _set(bitmask_p, mask=bytes([0b01100010, 0b00010000])), "tensor"),
    ("bitmask too short", _set(bitmask_p, mask=bytes([0b01100010])), "tensor"),
    ("bitmask too long", _set(bitmask_p, mask=bytes([0b01100010, 0b00000100, 0])), "tensor"),
    # sliced
    (
        "slice index out of range",
        _set(sliced_p, indices=[{"dtype": "|u1", "data": b"\x00\x03"}, None]),
        "tensor",
    ),
    ("slice unsorted", _set(sliced_p, indices=[{"dtype": "|u1", "data": b"\x02\x00"}, None]), "tensor"),
    ("slice duplicate", _set(sliced_p, indices=[{"dtype": "|u1", "data": b"\x02\x02"}, None]), "tensor"),
    (
        "slice too many kept",
        _set(sliced_p, indices=[{"dtype": "|u1", "data": b"\x00\x01\x02\x03"}, None]),
        "tensor",
    ),
    ("slice wrong axis count", _set(sliced_p, indices=[None]), "tensor"),
    ("slice indices not a list", _set(sliced_p, indices=b"\x00"), "malformed"),
    ("slice values mismatch", _set(sliced_p, indices=[{"dtype": "|u1", "data": b"\x00"}, None]), "tensor"),
    # non-finite values
    ("nan dense", _nan(dense_p, "data"), "nonfinite"),
    ("inf dense", _nan(dense_p, "data", np.inf), "nonfinite"),
    ("-inf threshold", _nan(threshold_p, "data", -np.inf), "nonfinite"),
    ("nan sparse", _nan(coo_p, "values"), "nonfinite"),
    ("nan bitmask", _nan(bitmask_p, "values"), "nonfinite"),
    ("nan sliced", _nan(sliced_p, "values"), "nonfinite"),
]


def test_malformed_cases_are_valid_before_mutation() -> None:
    for base in (dense_p, coo_p, bitmask_p, sliced_p, threshold_p):
        decode(base())


@pytest.mark.parametrize(
    ("payload", "reason"), [(f, r) for _, f, r in MALFORMED], ids=[n for n, _, _ in MALFORMED]
)
def test_malformed_payload_is_rejected(payload: Callable[[], Any], reason: str) -> None:
    obj = payload()
    with pytest.raises(CodecError) as e:
        decode(obj)
    assert e.value.reason == reason, str(e.value)
    assert reason in REASONS
    assert len(str(e.value)) > len(reason) + 10  # a message a person can act on
    # Same verdict after a real msgpack trip (where the payload is packable at all).
    try:
        wire = packb(obj)
    except CodecError:
        return
    with pytest.raises(CodecError) as e2:
        decode(unpackb(wire, max_bytes=MAX_BYTES))
    assert e2.value.reason == reason


def test_error_messages_do_not_echo_huge_hostile_values() -> None:
    for payload in ({**dense_p(), "kind": "x" * 100_000}, {**dense_p(), "dtype": "y" * 100_000}):
        with pytest.raises(CodecError) as e:
            decode(payload)
        assert len(str(e.value)) < 300


def test_nonfinite_accepted_when_allowed() -> None:
    d = decode(_nan(dense_p, "data")(), ALLOW_NAN)
    assert isinstance(d, Dense) and np.isnan(d.array[-1, -1])


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**32, 2**32, 2**32], [50_000_001]])
def test_huge_shapes_are_rejected_without_allocating(shape: list[int]) -> None:
    wire = packb({**dense_p(), "shape": shape})
    tracemalloc.start()
    try:
        with pytest.raises(CodecError) as e:
            decode(unpackb(wire, max_bytes=MAX_BYTES))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.reason == "limits"
    assert peak < 64 * 1024


def test_limits_are_configurable() -> None:
    p = dense_p()
    with pytest.raises(CodecError, match="max_elements") as e:
        decode(p, Limits(max_elements=11))
    assert e.value.reason == "limits"
    with pytest.raises(CodecError) as e:
        decode(p, Limits(max_ndim=1))
    assert e.value.reason == "limits"
    assert decode(p, Limits(max_elements=12, max_ndim=2)) == Dense(F32)
    assert Limits() == DEFAULT_LIMITS


# --------------------------------------------------------------------------------------- packb/unpackb


def _ext(code: int, data: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, data))


class Color(enum.StrEnum):
    RED = "red"


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_ext(5, b"abc"), id="ext"),
        pytest.param(_ext(5, b""), id="empty-ext"),
        pytest.param(msgpack.packb(msgpack.Timestamp(1, 0)), id="timestamp"),
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"", id="empty"),
        pytest.param(b"\x92\x01", id="truncated"),
        pytest.param(b"\x01\x02", id="trailing-data"),
        pytest.param(b"\xa2\xff\xfe", id="bad-utf8"),
        pytest.param(msgpack.packb({1: 2}), id="int-key"),
        pytest.param(b"\xdb\xff\xff\xff\xff", id="huge-str-length"),
        pytest.param(b"\xdd\xff\xff\xff\xff", id="huge-array-length"),
        pytest.param(b"\x91" * 100_000, id="deep-nesting"),
        pytest.param(b"\x93garbage-bytes\xff\xff", id="garbage"),
    ],
)
def test_unpackb_rejects_bad_input(data: bytes) -> None:
    with pytest.raises(CodecError) as e:
        unpackb(data, max_bytes=1 << 20)
    assert e.value.reason == "malformed"


def test_ext_bytes_inside_a_bin_are_just_bytes() -> None:
    data = msgpack.packb({"a": [1, _ext(1, b"x")]})
    assert unpackb(data, max_bytes=1000) == {"a": [1, _ext(1, b"x")]}


def test_unpackb_oversized_is_rejected_before_parsing() -> None:
    with pytest.raises(CodecError) as e:
        unpackb(b"\xc1" * 101, max_bytes=100)  # would be malformed, but size is checked first
    assert e.value.reason == "oversized"
    assert unpackb(packb({"a": b"x" * 90}), max_bytes=100) == {"a": b"x" * 90}


def test_unpackb_rejects_non_bytes() -> None:
    with pytest.raises(CodecError) as e:
        unpackb("abc", max_bytes=100)  # type: ignore[arg-type]
    assert e.value.reason == "malformed"


@pytest.mark.parametrize(
    "value",
    [np.float32(1.0), np.float64(1.0), np.int64(3), object(), Color.RED, {1, 2}, 2**64, {"k": [np.int8(1)]}],
)
def test_packb_refuses_non_plain_types(value: Any) -> None:
    with pytest.raises(CodecError) as e:
        packb(value)
    assert e.value.reason == "type"


def test_packb_plain_types() -> None:
    obj = {"a": (1, 2), "b": b"x", "c": memoryview(b"yz"), "d": None, "e": 1.5, "f": True, "g": "s"}
    assert unpackb(packb(obj), max_bytes=100) == {
        "a": [1, 2],
        "b": b"x",
        "c": b"yz",
        "d": None,
        "e": 1.5,
        "f": True,
        "g": "s",
    }


# -------------------------------------------------------------------------------------------- fuzzing


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes_only_ever_raise_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode(unpackb(data, max_bytes=1000))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=any_tensor, pos=st.integers(0, 10_000), byte=st.integers(0, 255), cut=st.booleans())
def test_corrupted_messages_decode_or_raise_codec_error(t: Tensor, pos: int, byte: int, cut: bool) -> None:
    wire = bytearray(packb(encode(t)))
    pos %= len(wire)
    if cut:
        del wire[pos:]
    else:
        wire[pos] = byte
    try:
        decode(unpackb(bytes(wire), max_bytes=MAX_BYTES), ALLOW_NAN)
    except CodecError as e:
        assert e.reason in REASONS
