"""msgpack with the settings fedfleet trusts: plain types out, bounded parsing in.

Why wrap msgpack at all: its defaults are permissive in ways that matter for a service reading from a
shared queue. ``packb`` here refuses anything that is not a plain msgpack type (a numpy scalar, an enum
or a custom object silently packed as something else would decode differently on the other side);
``unpackb`` checks the byte budget before parsing, refuses every extension type (including msgpack's
built-in timestamp), bounds container and string sizes by the message size, and turns every parser
failure into ``CodecError`` so one ``except`` clause guards a consumer.
"""

from __future__ import annotations

from typing import Any, NoReturn

import msgpack

from shared.codec.errors import CodecError


def _default(obj: Any) -> Any:
    # strict_types=True sends tuples here (so a tuple subclass such as a NamedTuple is not silently
    # flattened); plain tuples are just lists on the wire.
    if type(obj) is tuple:
        return list(obj)
    raise CodecError(
        "type", f"refusing to pack {type(obj).__module__}.{type(obj).__qualname__}: not a plain type"
    )


def packb(obj: Any) -> bytes:
    """Pack plain data (dict with str keys, list/tuple, str, bytes/bytearray/memoryview, int, float,
    bool, None) with ``use_bin_type=True``; anything else, including subclasses such as numpy scalars
    or str enums, raises ``CodecError('type')``."""
    try:
        out = msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError("type", f"cannot pack value: {exc}") from exc
    assert isinstance(out, bytes)
    return out


def _no_ext(code: int, data: bytes) -> NoReturn:
    raise CodecError("malformed", f"msgpack extension type {code} is not accepted")


def unpackb(data: bytes | bytearray | memoryview, *, max_bytes: int) -> Any:
    """Parse one msgpack object from ``data`` after checking ``len(data) <= max_bytes``.

    Maps must have str keys, strings must be valid UTF-8, bins come back as ``bytes``, arrays as lists.
    Any failure -- oversize, truncation, trailing bytes, bad UTF-8, extension types, nesting too deep,
    non-bytes input -- raises ``CodecError`` ('oversized' or 'malformed') and nothing else.
    """
    obj, rest = unpackb_head(data, max_bytes=max_bytes)
    if rest:
        raise CodecError("malformed", f"not a valid msgpack message: {len(rest)} bytes after its end")
    return obj


def unpackb_head(data: bytes | bytearray | memoryview, *, max_bytes: int) -> tuple[Any, bytes]:
    """Like :func:`unpackb`, but the bytes after the first object are returned (as ``bytes``), not
    refused: a body (schema versions 5 and 6) is its packed fields followed by its tensors' raw blob.

    Why not a bin for the blob: the body is a bin already, and a second frame around most of it
    costs 2–5 bytes of every device message for nothing (issue 16's 64-byte envelope).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError("malformed", f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise CodecError("oversized", f"message is {size} bytes; the limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
            # Every element costs at least one byte of input, so no declared length above the input
            # size can be honest; this caps what a forged length prefix can make msgpack allocate.
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,  # also blocks the built-in timestamp type, which bypasses ext_hook
        )
        return obj, b""
    except msgpack.ExtraData as extra:  # a complete object, then bytes of the caller's own
        return extra.unpacked, extra.extra
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises ValueError subclasses, TypeError, UnicodeDecodeError...
        raise CodecError("malformed", f"not a valid msgpack message: {type(exc).__name__}: {exc}") from exc
