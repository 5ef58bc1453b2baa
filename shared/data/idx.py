"""A strict reader for the IDX format (MNIST, Fashion-MNIST).

Layout: two zero bytes, one dtype code, one byte with the number of dimensions, then that many
big-endian uint32 sizes, then the data in big-endian order. We validate every part and insist the
payload is exactly as long as the header says, because a silently truncated download otherwise
turns into a dataset with garbage in its last rows.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from shared.data.errors import DatasetFormatError

#: IDX type code -> big-endian numpy dtype
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode one IDX blob into a native-endian array; ``source`` names the file in errors."""
    if len(data) < 4:
        raise DatasetFormatError(f"{source}: {len(data)} bytes is too short for an IDX header (need 4)")
    zero0, zero1, code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0:
        raise DatasetFormatError(
            f"{source}: bad IDX magic {data[:4].hex()} (the first two bytes must be zero); "
            "is this really an IDX file?"
        )
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DatasetFormatError(f"{source}: unknown IDX dtype code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise DatasetFormatError(f"{source}: IDX header declares 0 dimensions")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DatasetFormatError(
            f"{source}: truncated IDX header: {ndim} dimensions need {header_len} bytes, file has {len(data)}"
        )
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise DatasetFormatError(
            f"{source}: IDX payload {what}: shape {tuple(dims)} of {dtype.name} needs {expected} bytes, "
            f"found {actual}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    # Native byte order and a private, writable copy: callers may normalise in place.
    return arr.astype(dtype.newbyteorder("="))


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file, gzip-compressed or not (decided by content, not by the file name)."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DatasetFormatError(f"{p}: corrupt gzip stream: {exc}") from exc
    return parse_idx(raw, source=str(p))


def encode_idx(arr: np.ndarray) -> bytes:
    """Encode an array as IDX (used by tests and tools that write small fixtures)."""
    for code, dtype in IDX_DTYPES.items():
        if arr.dtype.kind == dtype.kind and arr.dtype.itemsize == dtype.itemsize:
            if arr.ndim == 0 or arr.ndim > 255:
                raise ValueError(f"IDX needs 1..255 dimensions, got {arr.ndim}")
            header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
            return header + np.ascontiguousarray(arr, dtype=dtype).tobytes()
    raise ValueError(f"dtype {arr.dtype} has no IDX type code")
