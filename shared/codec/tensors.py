"""In-memory tensor payload kinds: what strategies put into tasks and updates.

The four kinds mirror what the implemented algorithms exchange (see docs/architecture.md): full weights
(:class:`Dense`), per-neuron thresholds (:class:`Threshold`), masked weights (:class:`Sparse`) and
sub-model slices (:class:`Sliced`). They are plain frozen dataclasses holding numpy arrays; the wire
layout lives in :mod:`shared.codec.wire`.

Constructors validate and normalise their inputs (sorted unique ``int64`` indices, shapes as tuples of
Python ints, values shaped consistently) because a malformed tensor built by an algorithm is much
easier to debug at construction than as a rejected message on another service. Violations raise
:class:`~shared.codec.errors.CodecError`, the same type ``decode`` raises for bad payloads.

Equality (``==``) is exact: same kind, same shape, same dtype up to byte order, bit-identical values
(so NaN equals NaN at the same position and ``-0.0 != 0.0``). The dataclass default would compare
arrays element-wise and fail; exact equality is what a round-trip test and a dedup check need. The
kinds are unhashable because the arrays they hold are mutable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from shared.codec.errors import CodecError

# The only dtypes that may travel, keyed by their little-endian ``dtype.str``. decode() looks the wire
# string up in this table and never calls ``np.dtype`` on untrusted text (which would accept object,
# unicode, void and arbitrarily large structured dtypes).
VALUE_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    np.dtype(name).newbyteorder("<").str: np.dtype(name).newbyteorder("<")
    for name in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
}
# Index buffers (COO flat indices, slice indices) are unsigned; the encoder picks the narrowest.
INDEX_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    np.dtype(name).newbyteorder("<").str: np.dtype(name).newbyteorder("<")
    for name in ("uint8", "uint16", "uint32", "uint64")
}

AnyArray = npt.NDArray[Any]
IndexArray = npt.NDArray[np.int64]


def wire_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The little-endian twin of ``dtype`` if it is allowed on the wire, else ``CodecError('dtype')``."""
    found = VALUE_DTYPES.get(dtype.newbyteorder("<").str)
    if found is None:
        raise CodecError(
            "dtype",
            f"dtype {dtype.str!r} cannot be encoded; allowed: float16/32/64, int8..64, uint8..64, bool",
        )
    return found


def index_dtype_for(n: int) -> np.dtype[Any]:
    """Narrowest unsigned dtype that can hold every index in ``range(n)``.

    Index bytes dominate COO and slice payloads, so using uint8/uint16 where the extent allows it is
    the single biggest win after sparsity itself.
    """
    top = max(n - 1, 0)
    for s in ("|u1", "<u2", "<u4", "<u8"):
        if top <= np.iinfo(INDEX_DTYPES[s]).max:
            return INDEX_DTYPES[s]
    raise CodecError("limits", f"extent {n} does not fit a uint64 index")


def numel(shape: Sequence[int]) -> int:
    """Element count with Python ints (never overflows, unlike ``np.prod``)."""
    return math.prod(shape)


def _shape_tuple(shape: Sequence[int] | Any) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise CodecError("shape", f"shape must be a sequence of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise CodecError("shape", f"shape {dims} has a negative dimension")
    return dims


def _as_index_vector(idx: Any, extent: int, what: str) -> IndexArray:
    """Validate a sorted, unique, in-range 1-D index vector and return it as int64."""
    arr = np.asarray(idx)
    if arr.ndim != 1:
        raise CodecError("tensor", f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise CodecError("dtype", f"{what} must be integers, got dtype {arr.dtype.str!r}")
    if np.any(arr[1:] <= arr[:-1]):
        raise CodecError("tensor", f"{what} must be strictly increasing (sorted, unique); use np.unique")
    if int(arr[0]) < 0 or int(arr[-1]) >= extent:
        raise CodecError("tensor", f"{what} must lie in [0, {extent}), got [{int(arr[0])}, {int(arr[-1])}]")
    return arr.astype(np.int64, copy=False)


def same_array(a: AnyArray, b: AnyArray) -> bool:
    """Exact equality: same shape, same dtype up to byte order, bit-identical contents."""
    if a.shape != b.shape or a.dtype.newbyteorder("<") != b.dtype.newbyteorder("<"):
        return False
    le = a.dtype.newbyteorder("<")
    return bool(np.ascontiguousarray(a, dtype=le).tobytes() == np.ascontiguousarray(b, dtype=le).tobytes())


@dataclass(frozen=True, eq=False)
class Dense:
    """A full tensor of any shape (FedAvg weights, EmbracingFL layers, HeteroFL slices sent whole)."""

    KIND: ClassVar[str] = "dense"
    array: AnyArray

    def __post_init__(self) -> None:
        arr = np.asarray(self.array)
        wire_dtype(arr.dtype)
        object.__setattr__(self, "array", arr)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and same_array(self.array, other.array)


@dataclass(frozen=True, eq=False)
class Threshold:
    """SpaFL's trainable thresholds: one float per neuron/filter, so always a 1-D float vector.

    A separate kind (rather than a 1-D Dense) lets a receiver check that it got the kind of payload the
    protocol promised, and lets metrics count threshold traffic separately.
    """

    KIND: ClassVar[str] = "threshold"
    array: AnyArray

    def __post_init__(self) -> None:
        arr = np.asarray(self.array)
        wire_dtype(arr.dtype)
        if arr.dtype.kind != "f":
            raise CodecError("dtype", f"threshold vector must be float16/32/64, got {arr.dtype.str!r}")
        if arr.ndim != 1:
            raise CodecError("shape", f"threshold vector must be 1-D, got shape {arr.shape}")
        object.__setattr__(self, "array", arr)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and same_array(self.array, other.array)


@dataclass(frozen=True, eq=False)
class Sparse:
    """Unstructured sparse tensor: the values at ``flat_indices`` of a tensor of ``shape``.

    ``flat_indices`` are C-order positions into the flattened full tensor, sorted, unique, ``int64``.
    The wire format (bitmask or COO) is chosen at encode time; this in-memory form is the same for both,
    so algorithms never care which one travelled.
    """

    KIND: ClassVar[str] = "sparse"
    shape: tuple[int, ...]
    flat_indices: IndexArray
    values: AnyArray

    def __post_init__(self) -> None:
        shape = _shape_tuple(self.shape)
        idx = _as_index_vector(self.flat_indices, numel(shape), "Sparse.flat_indices")
        vals = np.asarray(self.values)
        wire_dtype(vals.dtype)
        if vals.ndim != 1 or vals.shape[0] != idx.shape[0]:
            raise CodecError(
                "tensor", f"Sparse.values must be 1-D with {idx.shape[0]} entries, got shape {vals.shape}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "flat_indices", idx)
        object.__setattr__(self, "values", vals)

    @classmethod
    def _trusted(cls, shape: tuple[int, ...], flat_indices: IndexArray, values: AnyArray) -> Sparse:
        """Build without re-validating; only for decode(), which has already checked everything."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "shape", shape)
        object.__setattr__(obj, "flat_indices", flat_indices)
        object.__setattr__(obj, "values", values)
        return obj

    @staticmethod
    def from_dense(array: Any, mask: Any) -> Sparse:
        """Keep ``array`` where ``mask`` is truthy (``mask`` must have the same shape)."""
        arr = np.asarray(array)
        m = np.asarray(mask)
        if m.shape != arr.shape:
            raise CodecError("shape", f"mask shape {m.shape} differs from array shape {arr.shape}")
        flat = np.flatnonzero(m).astype(np.int64, copy=False)
        return Sparse(arr.shape, flat, arr.reshape(-1)[flat])

    @property
    def nnz(self) -> int:
        """Number of stored values."""
        return int(self.flat_indices.shape[0])

    def mask(self) -> npt.NDArray[np.bool_]:
        """Boolean tensor of the full shape, True where a value is stored."""
        m = np.zeros(numel(self.shape), dtype=np.bool_)
        m[self.flat_indices] = True
        return m.reshape(self.shape)

    def to_dense(self, fill: Any = 0) -> AnyArray:
        """Full tensor with stored values in place and ``fill`` elsewhere (a fresh, writable array)."""
        out = np.full(numel(self.shape), fill, dtype=self.values.dtype)
        out[self.flat_indices] = self.values
        return out.reshape(self.shape)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sparse)
            and self.shape == other.shape
            and same_array(self.flat_indices, other.flat_indices)
            and same_array(self.values, other.values)
        )


@dataclass(frozen=True, eq=False)
class Sliced:
    """A sub-tensor that keeps whole index sets per axis (HeteroFL/FedRolex widths, FedDSE, Hermes).

    ``shape`` is the *full* shape; ``indices[axis]`` are the kept, sorted, unique positions along that
    axis or ``None`` for the whole axis; ``values`` is the cross-product block, shaped by the kept
    lengths. Per-axis indices cost sum(kept) index entries instead of prod(kept) for COO, which is why
    structured sub-models get their own kind.
    """

    KIND: ClassVar[str] = "sliced"
    shape: tuple[int, ...]
    indices: tuple[IndexArray | None, ...]
    values: AnyArray

    def __post_init__(self) -> None:
        shape = _shape_tuple(self.shape)
        if len(self.indices) != len(shape):
            raise CodecError(
                "tensor", f"Sliced needs one index entry per axis: {len(shape)} axes, {len(self.indices)}"
            )
        idx = tuple(
            None if ix is None else _as_index_vector(ix, dim, f"Sliced.indices[{axis}]")
            for axis, (ix, dim) in enumerate(zip(self.indices, shape, strict=True))
        )
        vals = np.asarray(self.values)
        wire_dtype(vals.dtype)
        kept = _kept_shape(shape, idx)
        if vals.shape != kept:
            raise CodecError("tensor", f"Sliced.values must have the kept shape {kept}, got {vals.shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "indices", idx)
        object.__setattr__(self, "values", vals)

    @classmethod
    def _trusted(
        cls, shape: tuple[int, ...], indices: tuple[IndexArray | None, ...], values: AnyArray
    ) -> Sliced:
        """Build without re-validating; only for decode(), which has already checked everything."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "shape", shape)
        object.__setattr__(obj, "indices", indices)
        object.__setattr__(obj, "values", values)
        return obj

    @staticmethod
    def from_dense(array: Any, indices: Sequence[Any | None]) -> Sliced:
        """Cut the block ``array[np.ix_(*indices)]`` (``None`` keeps an axis whole)."""
        arr = np.asarray(array)
        if len(indices) != arr.ndim:
            raise CodecError("tensor", f"need one index entry per axis: {arr.ndim} axes, {len(indices)}")
        idx = tuple(
            None if ix is None else _as_index_vector(ix, dim, f"indices[{axis}]")
            for axis, (ix, dim) in enumerate(zip(indices, arr.shape, strict=True))
        )
        vals = arr
        for axis, ix in enumerate(idx):
            if ix is not None:
                vals = np.take(vals, ix, axis=axis)
        return Sliced(arr.shape, idx, vals)

    def _open_mesh(self) -> tuple[IndexArray, ...]:
        full = tuple(
            np.arange(dim, dtype=np.int64) if ix is None else ix
            for ix, dim in zip(self.indices, self.shape, strict=True)
        )
        return np.ix_(*full) if full else ()

    def mask(self) -> npt.NDArray[np.bool_]:
        """Boolean tensor of the full shape, True on the kept block."""
        m = np.zeros(self.shape, dtype=np.bool_)
        m[self._open_mesh()] = True
        return m

    def to_dense(self, fill: Any = 0) -> AnyArray:
        """Full tensor with the kept block in place and ``fill`` elsewhere (a fresh, writable array)."""
        out = np.full(self.shape, fill, dtype=self.values.dtype)
        out[self._open_mesh()] = self.values
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sliced) or self.shape != other.shape:
            return False
        for a, b in zip(self.indices, other.indices, strict=True):
            if (a is None) != (b is None):
                return False
            if a is not None and b is not None and not same_array(a, b):
                return False
        return same_array(self.values, other.values)


def _kept_shape(shape: tuple[int, ...], indices: tuple[IndexArray | None, ...]) -> tuple[int, ...]:
    return tuple(dim if ix is None else int(ix.shape[0]) for ix, dim in zip(indices, shape, strict=True))


Tensor = Dense | Threshold | Sparse | Sliced


def to_array(t: Tensor, fill: Any = 0) -> AnyArray:
    """The full (dense) values of any tensor kind; positions a sparse or sliced tensor does not
    hold are ``fill``."""
    if isinstance(t, Dense | Threshold):
        return np.asarray(t.array)
    return t.to_dense(fill)


def dense_bytes(t: Tensor) -> int:
    """Dense-equivalent size: numel(full shape) * itemsize(values dtype).

    This is the denominator of every compression ratio fedfleet reports, so it is defined once here.
    """
    if isinstance(t, Dense | Threshold):
        return int(t.array.size) * t.array.dtype.itemsize
    if isinstance(t, Sparse | Sliced):
        return numel(t.shape) * t.values.dtype.itemsize
    raise CodecError("kind", f"not a codec tensor: {type(t).__name__}")
