"""Stable seeds derived from names: one function every layer of the stack can import.

Why its own module: data (feature noise), devices, algorithms and services all derive seeds from
``(experiment seed, what, which)``; keeping the derivation below all of them means ``shared.data``
need not import the algorithm registry to get it.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from parts (not Python's salted ``hash``)."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF
