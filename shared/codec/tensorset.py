"""A message's named tensors as one compact unit: a layout (or its digest), counts, one buffer.

Why: encoded one by one (layout v1, :mod:`shared.codec.wire`), every tensor carries its own map of
field names, its kind, dtype and shape — 30–60 bytes each, for every tensor of every message, although
the receiver knows the model's architecture as well as the sender. A SpaFL update is a few hundred
bytes of thresholds; a FedAvg update of a small MLP is four tensors. Here the *layout* (names, kinds,
dtypes, full shapes, which axes a slice keeps) travels once, from the server, and what a device sends
back names it by an 8-byte digest; what varies per message (the number of COO indices, a slice's
kept lengths) are a few small integers; every raw buffer sits back to back in one ``bin``.

Wire form (a msgpack array; :mod:`shared.schemas` versions 5 and 6 place it in a body as
``[head, *counts]`` followed by the blob, raw, after the body's fields — see ``schemas.encode``)::

    [head, blob, counts]       head: layout | digest | [digest, ref, ...]; counts omitted when empty

* ``layout`` — a list of entries ``[name, code, dtype, shape]`` (``+ [sliced-axes bitmask]`` for a
  sliced tensor), ``code`` one of :data:`CODES`, ``dtype`` an index into the codec's allow-list;
* ``digest`` — ``sha256(packb(layout))[:8]``, for a layout the receiver already knows;
* ``[digest, ref, ...]`` — a layout built from a known one, entry by entry: each ``ref`` names an
  entry of the known layout (same name and dtype) with this tensor's code (a device sends back a
  sparse update of a dense model, SpaFL its thresholds out of a model-and-thresholds payload); an
  entry that has no match travels in full. Schema versions 5 and 6 write a ref as
  ``axes << 5 | skipped << 4 | reshaped << 3 | code``: it names the entry after the one the previous
  ref named (the first, at the start) — followed by how many entries it skips when ``skipped`` — and
  ``axes`` is the sliced-axes mask of a sliced tensor (0 for any other code). Then the shape when
  ``reshaped`` (FedTiny sends the kept values of each layer as a vector): a list, or for a vector
  its bare length. So a ref is one byte for any model (the index is implied) and a sliced one needs
  no mask of its own (schema version 4's wider references, ``index << 4 | reshaped << 3 | code``,
  are no longer read or written since version 6);
* ``blob`` — per tensor, in layout order: dense/threshold ``data``; bitmask ``mask`` then ``values``;
  COO ``indices`` then ``values``; sliced: the index buffer of every sliced axis, then ``values``.
  Index buffers use the narrowest unsigned dtype for their extent, as layout v1 does;
* ``counts`` — per COO tensor its number of indices; per sliced axis its kept length.

:func:`unpack` rebuilds the layout-v1 dicts (zero-copy views into the blob) and leaves every check of
their contents to :func:`shared.codec.decode`, so there is one validator for hostile input, not two.
What this module checks is what it needs to split the blob: well-formed entries, known codes, and
that the buffer lengths the layout and counts imply add up exactly to the blob.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from shared.codec.errors import CodecError
from shared.codec.pack import packb
from shared.codec.tensors import INDEX_DTYPES, VALUE_DTYPES, index_dtype_for

#: tensor codes in a layout entry
DENSE, THRESHOLD, BITMASK, COO, SLICED = 0, 1, 2, 3, 4
CODES: Final = {DENSE: "dense", THRESHOLD: "threshold", BITMASK: "bitmask", COO: "coo", SLICED: "sliced"}
#: the value dtypes, in a fixed order: a layout names a dtype by its index here
DTYPES: Final[tuple[str, ...]] = tuple(VALUE_DTYPES)
DIGEST_BYTES: Final = 8
#: most tensors in one set, and most dims per tensor (what a receiver will parse at all)
MAX_TENSORS: Final = 4096
MAX_NDIM: Final = 8

Layout = list[list[Any]]


def digest(layout: Layout) -> bytes:
    return hashlib.sha256(packb(layout)).digest()[:DIGEST_BYTES]


def _bytes(v: Any) -> bytes | memoryview:
    if isinstance(v, memoryview):
        return v.cast("B") if v.format != "B" or v.ndim != 1 else v
    if isinstance(v, bytes):
        return v
    if isinstance(v, bytearray):
        return bytes(v)
    raise CodecError("malformed", f"expected a byte buffer, got {type(v).__name__}")


def _index(entry: Any, extent: int) -> bytes | memoryview:
    """An index buffer in the narrowest dtype for ``extent`` (what v1's encoder writes anyway)."""
    data = _bytes(entry["data"])
    want = index_dtype_for(extent)
    if entry["dtype"] == want.str:
        return data
    have = INDEX_DTYPES[entry["dtype"]]
    return np.frombuffer(data, dtype=have).astype(want).tobytes()


def pack(tensors: Mapping[str, Mapping[str, Any]]) -> tuple[Layout, list[int], list[bytes | memoryview]]:
    """Layout-v1 tensor dicts (``codec.encode``'s output) → layout, counts and buffers in order."""
    layout: Layout = []
    counts: list[int] = []
    parts: list[bytes | memoryview] = []
    for name, t in tensors.items():
        shape = [int(d) for d in t["shape"]]
        dt = DTYPES.index(t["dtype"])
        kind = t["kind"]
        if kind in ("dense", "threshold"):
            layout.append([name, DENSE if kind == "dense" else THRESHOLD, dt, shape])
            parts.append(_bytes(t["data"]))
        elif kind == "sparse" and t["format"] == "bitmask":
            layout.append([name, BITMASK, dt, shape])
            parts += [_bytes(t["mask"]), _bytes(t["values"])]
        elif kind == "sparse":
            n = int(np.prod(shape, dtype=object))
            idx = _index(t["indices"], n)
            layout.append([name, COO, dt, shape])
            counts.append(len(idx) // index_dtype_for(n).itemsize)
            parts += [idx, _bytes(t["values"])]
        elif kind == "sliced":
            axes = 0
            for a, (entry, dim) in enumerate(zip(t["indices"], shape, strict=True)):
                if entry is not None:
                    axes |= 1 << a
                    idx = _index(entry, dim)
                    counts.append(len(idx) // index_dtype_for(dim).itemsize)
                    parts.append(idx)
            layout.append([name, SLICED, dt, shape, axes])
            parts.append(_bytes(t["values"]))
        else:
            raise CodecError("kind", f"cannot pack a {kind!r} tensor")
    return layout, counts, parts


def to_wire(
    tensors: Mapping[str, Mapping[str, Any]], known: Mapping[bytes, Layout] | None = None
) -> list[Any]:
    """The wire form. ``known``: layouts the receiver has, by digest — the layout then goes as a
    digest (the same layout) or as references into one of them (see the module docstring)."""
    layout, counts, parts = pack(tensors)
    out: list[Any] = [_head(layout, known or {}), b"".join(parts)]
    if counts:
        out.append(counts)
    return out


def _refs(layout: Layout, ref: Layout, ref_digest: bytes) -> list[Any]:
    """References into ``ref``: the index implied by the order (see the module docstring)."""
    where = {(e[0], e[2]): i for i, e in enumerate(ref)}
    head: list[Any] = [ref_digest]
    expected = 0
    for e in layout:
        i = where.get((e[0], e[2]))
        if i is None or i < expected:
            head.append(e)  # no match, or one the order cannot name: the entry in full
            continue
        reshaped = ref[i][3] != e[3]
        item = (e[4] if e[1] == SLICED else 0) << 5 | (i > expected) << 4 | reshaped << 3 | e[1]
        head.append(item)
        if i > expected:
            head.append(i - expected)
        if reshaped:
            head.append(e[3][0] if len(e[3]) == 1 else e[3])
        expected = i + 1
    return head


def _head(layout: Layout, known: Mapping[bytes, Layout]) -> Any:
    d = digest(layout)
    if d in known:
        return d
    best: list[Any] = layout
    for ref_digest, ref in known.items():
        head = _refs(layout, ref, ref_digest)
        if len(packb(head)) < len(packb(best)):
            best = head
    return best


def digest_only_size(wire: list[Any]) -> int:
    """Bytes of ``wire`` as a body of schema versions 5 and 6 carries it to a receiver that knows its
    layout: ``[digest, *counts]`` and the raw blob. What an emulated device is charged (a real
    device knows its model's architecture)."""
    layout = wire[0]
    slim = [layout if isinstance(layout, bytes) else digest(layout), *(wire[2] if len(wire) == 3 else [])]
    return len(packb(slim)) + len(wire[1])


def _int(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise CodecError("malformed", f"tensor set: {what} must be a non-negative int")
    return v


def check_layout(layout: Any) -> Layout:
    """A layout's structure (not its sizes against any buffer), or ``CodecError``."""
    if not isinstance(layout, list) or len(layout) > MAX_TENSORS:
        raise CodecError("malformed", "tensor set: the layout must be a list of at most 4096 entries")
    names = set()
    for e in layout:
        if not isinstance(e, list) or len(e) not in (4, 5) or not isinstance(e[0], str):
            raise CodecError("malformed", "tensor set: a layout entry is [name, code, dtype, shape(, axes)]")
        code, dt, shape = e[1], e[2], e[3]
        if type(code) is not int or code not in CODES or (len(e) == 5) != (code == SLICED):
            raise CodecError("kind", f"tensor set: unknown tensor code {code!r}")
        if type(dt) is not int or not 0 <= dt < len(DTYPES):
            raise CodecError("dtype", f"tensor set: unknown dtype index {dt!r}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise CodecError("shape", "tensor set: a shape is a list of at most 8 dims")
        for d in shape:
            _int(d, "a dimension")
        if code == SLICED and (type(e[4]) is not int or e[4] >> len(shape)):
            raise CodecError("malformed", "tensor set: bad sliced-axes mask")
        if e[0] in names:
            raise CodecError("malformed", f"tensor set: tensor {e[0]!r} appears twice")
        names.add(e[0])
    return layout


def _known(d: bytes, layouts: Mapping[bytes, Layout]) -> Layout:
    found = layouts.get(d)
    if found is None:
        raise UnknownLayout(d)
    return found


def _resolve(ref: Layout, items: list[Any]) -> Layout:
    """``[ref, ...]`` items against a known layout → full entries (checked by the caller,
    :func:`check_layout`: a code, shape or mask that makes no sense is refused there)."""
    if len(items) > 3 * MAX_TENSORS:
        raise CodecError("malformed", "tensor set: too many references")
    out: Layout = []
    expected = 0
    it = iter(items)
    for item in it:
        if isinstance(item, list):
            out.append(item)
            continue
        if type(item) is not int or item < 0:
            raise CodecError("malformed", f"tensor set: bad reference {item!r}")
        code, axes = item & 7, item >> 5
        i = expected
        if item >> 4 & 1:
            skip = next(it, None)
            if type(skip) is not int or skip < 1:
                raise CodecError("malformed", f"tensor set: bad skip {skip!r}")
            i += skip
        if i >= len(ref) or (axes and code != SLICED):
            raise CodecError("malformed", f"tensor set: bad reference {item!r}")
        base = ref[i]
        shape = base[3]
        if item & 8:
            shape = next(it, None)
            shape = [shape] if type(shape) is int else shape
        entry = [base[0], code, base[2], shape]
        if code == SLICED:
            entry.append(axes)
        out.append(entry)
        expected = i + 1
    return out


class _Cursor:
    def __init__(self, blob: memoryview, counts: list[Any]) -> None:
        self.blob, self.pos, self.counts, self.ci = blob, 0, counts, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.blob):
            raise CodecError("tensor", "tensor set: the buffer is shorter than its layout says")
        out = self.blob[self.pos : self.pos + n]
        self.pos += n
        return out

    def count(self) -> int:
        if self.ci >= len(self.counts):
            raise CodecError("malformed", "tensor set: fewer counts than the layout needs")
        self.ci += 1
        return _int(self.counts[self.ci - 1], "a count")


def unpack(wire: Any, layouts: Mapping[bytes, Layout]) -> tuple[dict[str, dict[str, Any]], Layout | None]:
    """The wire form → layout-v1 tensor dicts, and the layout when it came inline (else None).

    A digest nobody told this receiver about raises ``UnknownLayout``.
    """
    if not isinstance(wire, list) or len(wire) not in (2, 3):
        raise CodecError("malformed", "tensor set: expected [layout or digest, blob(, counts)]")
    head, blob = wire[0], wire[1]
    counts = wire[2] if len(wire) == 3 else []
    if not isinstance(blob, bytes | bytearray | memoryview) or not isinstance(counts, list):
        raise CodecError("malformed", "tensor set: the blob must be bin and the counts a list")
    inline: Layout | None = None
    if isinstance(head, bytes):
        layout = _known(head, layouts)
    elif isinstance(head, list) and head and isinstance(head[0], bytes):
        layout = check_layout(_resolve(_known(head[0], layouts), head[1:]))
    else:
        layout = inline = check_layout(head)
    cur = _Cursor(memoryview(blob).cast("B"), counts)
    out = {e[0]: _entry(e, cur) for e in layout}
    if cur.pos != len(cur.blob) or cur.ci != len(counts):
        raise CodecError("tensor", "tensor set: the buffer or counts are longer than the layout says")
    return out, inline


def _entry(e: list[Any], cur: _Cursor) -> dict[str, Any]:
    code, dtype, shape = e[1], DTYPES[e[2]], e[3]
    size = VALUE_DTYPES[dtype].itemsize
    n = 1
    for d in shape:
        n *= d
    base: dict[str, Any] = {"v": 1, "dtype": dtype, "shape": list(shape)}
    if code in (DENSE, THRESHOLD):
        return {**base, "kind": CODES[code], "data": cur.take(n * size)}
    if code == BITMASK:
        mask = cur.take((n + 7) // 8)
        nnz = int.from_bytes(mask, "little").bit_count()
        return {**base, "kind": "sparse", "format": "bitmask", "mask": mask, "values": cur.take(nnz * size)}
    if code == COO:
        idt = index_dtype_for(n)
        k = cur.count()
        idx = {"dtype": idt.str, "data": cur.take(k * idt.itemsize)}
        return {**base, "kind": "sparse", "format": "coo", "indices": idx, "values": cur.take(k * size)}
    indices: list[Any] = []
    kept = 1
    for a, dim in enumerate(shape):
        if e[4] >> a & 1:
            idt = index_dtype_for(dim)
            k = cur.count()
            indices.append({"dtype": idt.str, "data": cur.take(k * idt.itemsize)})
            kept *= k
        else:
            indices.append(None)
            kept *= dim
    return {**base, "kind": "sliced", "indices": indices, "values": cur.take(kept * size)}


class UnknownLayout(CodecError):
    """A tensor set named its layout by a digest this receiver has not been told."""

    def __init__(self, d: bytes) -> None:
        super().__init__("malformed", f"tensor set: unknown layout {d.hex()}")
        self.reason = "unknown-layout"
        self.digest = d


class LayoutCache(OrderedDict[bytes, Layout]):
    """The layouts a service has learned from the server (bounded: least recently used go first).

    Only layouts the server sent are learned (see ``services.common``): a layout a device made up
    is used for its own message and forgotten, so nobody can crowd the server's out.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        super().__init__()
        self.maxsize = maxsize

    def learn(self, layout: Layout) -> bytes:
        d = digest(layout)
        self[d] = layout
        self.move_to_end(d)
        while len(self) > self.maxsize:
            self.popitem(last=False)
        return d
