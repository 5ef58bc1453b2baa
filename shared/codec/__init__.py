"""Tensor payload codec: dense, threshold, sparse (bitmask or COO) and sliced tensors on msgpack.

No pickle, no ``eval``, no numpy dtype parsing of untrusted text: a payload is a msgpack map of plain
values, and decoding only ever builds numpy arrays of allow-listed dtypes over checked byte buffers.

Typical use::

    wire = packb(encode(Sparse.from_dense(w, mask)))          # sender
    t = decode(unpackb(wire, max_bytes=budget), limits)        # receiver; CodecError on anything bad

Encoded layout (version 1)
--------------------------
Every tensor is one msgpack map with string keys. Common fields:

======== ============ =====================================================================
key      msgpack type meaning
======== ============ =====================================================================
``v``    int          layout version, ``1``
``kind`` str          ``"dense"``, ``"threshold"``, ``"sparse"`` or ``"sliced"``
``dtype`` str         dtype of the *values*, little-endian numpy ``dtype.str`` from the allow-list:
                      ``<f2 <f4 <f8 |i1 <i2 <i4 <i8 |u1 <u2 <u4 <u8 |b1``
``shape`` [int]       the *full* (dense) shape, C order
======== ============ =====================================================================

All raw buffers (msgpack ``bin``) are C-order little-endian. An *index buffer* is always the map
``{"dtype": "|u1" | "<u2" | "<u4" | "<u8", "data": bin}``; the encoder uses the narrowest unsigned
dtype that can hold ``extent - 1`` (uint8 up to 256, uint16 up to 65536, ...), the decoder accepts any
of the four as long as the values are in range.

- **dense** -- ``data``: bin of ``prod(shape) * itemsize`` bytes.
- **threshold** -- as dense, but ``shape`` must be 1-D and ``dtype`` a float (one threshold per
  neuron/filter, SpaFL).
- **sparse**, ``format: "bitmask"`` -- ``mask``: bin of ``ceil(n/8)`` bytes, ``n = prod(shape)``, bit
  ``i % 8`` (LSB first) of byte ``i // 8`` set iff flat C-order position ``i`` is stored; padding bits
  past ``n`` are zero. ``values``: bin of ``popcount(mask) * itemsize`` bytes, in flat order.
- **sparse**, ``format: "coo"`` -- ``indices``: index buffer of strictly increasing flat positions
  ``< n``; ``values``: bin with one value per index.
- **sliced** -- ``indices``: list with one entry per axis, ``nil`` (whole axis kept) or an index buffer
  of strictly increasing positions ``< shape[axis]``; ``values``: bin holding the kept block
  (shape = kept lengths per axis) in C order.

``encode(..., sparse_format="auto")`` computes the exact packed size of both sparse formats (msgpack
framing included) and emits the smaller one, bitmask on a tie, so auto is never larger than either.

Header bound
------------
:data:`HEADER_BYTES` = 174 bounds ``len(packb(encode(t)))`` minus the information size (raw buffer
bytes: data; mask + values; indices + values; per-axis indices + values) for any tensor with at most 4
dims. Worst case in msgpack bytes, every int a uint64 (9 bytes) and every bin framed as bin32 (5 bytes):

- all kinds: map header 1 + ``"v":1`` 3 + ``"dtype":"<f4"`` 10 + ``"shape":[4 dims]`` 6+1+4*9 = 43 -> 57
- dense: ``"kind":"dense"`` 11 + ``"data"`` 5+5 -> 78; threshold: ``"kind":"threshold"`` 15 -> 82
- bitmask: ``"kind":"sparse"`` 12 + ``"format":"bitmask"`` 15 + ``"mask"`` 5+5 + ``"values"`` 7+5 -> 106
- coo: 12 + ``"format":"coo"`` 11 + ``"indices"`` 8 + index map 1+10+5+5 + ``"values"`` 12 -> 121
- sliced: ``"kind":"sliced"`` 12 + ``"indices"`` 8 + list 1 + 4 index maps of 1+10+5+5 = 21 +
  ``"values"`` 7+5 -> **174**, the maximum (``tests/test_codec.py`` re-derives it by packing these
  worst-case headers)

Real tensors sit far below it (a 1-D float32 vector of 10 elements costs ~40 bytes of header).

Decoding and memory
-------------------
``decode`` validates every field -- types, known kind, allow-listed dtype, rank and element count
against :class:`Limits` (computed with Python ints), buffer lengths against the declared shape, index
order and range, mask length, padding and popcount, bool bytes in {0, 1}, NaN/Inf -- before building
anything sized by the declared shape. Value arrays it returns are **zero-copy, read-only views of the
input buffers**; index arrays are fresh ``int64`` copies (also read-only). ``.copy()`` before mutating.
Every failure is a :class:`CodecError` with a ``reason`` token (see :data:`REASONS`).
"""

from shared.codec.errors import REASONS, CodecError, Reason
from shared.codec.pack import packb, unpackb, unpackb_head
from shared.codec.tensors import (
    INDEX_DTYPES,
    VALUE_DTYPES,
    Dense,
    Sliced,
    Sparse,
    Tensor,
    Threshold,
    dense_bytes,
    index_dtype_for,
    to_array,
)
from shared.codec.wire import (
    CODEC_VERSION,
    DEFAULT_LIMITS,
    HEADER_BYTES,
    Limits,
    SparseFormat,
    decode,
    encode,
)

__all__ = [
    "CODEC_VERSION",
    "DEFAULT_LIMITS",
    "HEADER_BYTES",
    "INDEX_DTYPES",
    "REASONS",
    "VALUE_DTYPES",
    "CodecError",
    "Dense",
    "Limits",
    "Reason",
    "Sliced",
    "Sparse",
    "SparseFormat",
    "Tensor",
    "Threshold",
    "decode",
    "dense_bytes",
    "encode",
    "index_dtype_for",
    "packb",
    "to_array",
    "unpackb",
    "unpackb_head",
]
