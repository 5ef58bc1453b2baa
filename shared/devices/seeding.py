"""Deterministic randomness keyed by *what* is being decided, not by call order.

Why not one shared generator: services decide things in different processes and in different orders
(the server asks "is device 7 online in round 3?", a client hosting device 7 asks "does it drop out?").
A stream consumed in call order would give different answers depending on who asked first. Hashing the
key (purpose, seed, round, device, ...) gives every decision its own reproducible coin, identical in
every process, on every platform and across numpy versions.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["rng_for", "uniform01"]

_MASK64 = (1 << 64) - 1


def _key_bytes(purpose: str, keys: tuple[int | str, ...]) -> bytes:
    return ":".join([purpose, *(str(k) for k in keys)]).encode()


def uniform01(purpose: str, *keys: int | str) -> float:
    """A number in [0, 1) that depends only on ``purpose`` and ``keys`` (blake2b, 53 bits)."""
    digest = hashlib.blake2b(_key_bytes(purpose, keys), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def rng_for(purpose: str, *keys: int | str) -> np.random.Generator:
    """A numpy generator seeded from ``purpose`` and ``keys`` (for permutations and bulk draws)."""
    digest = hashlib.blake2b(_key_bytes(purpose, keys), digest_size=16).digest()
    words = [int.from_bytes(digest[i : i + 8], "little") & _MASK64 for i in (0, 8)]
    return np.random.default_rng(np.random.SeedSequence(words))
