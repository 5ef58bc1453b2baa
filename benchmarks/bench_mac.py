"""The MAC of a device's message: each schema version's algorithm, per message size.

Usage: ``python benchmarks/bench_mac.py [--repeats N] [--out FILE]``; ``run()`` returns the markdown
table for ``results.md`` (``make bench`` includes it).

Why: every update's MAC is computed twice over its whole body (the device makes it, an aggregator
checks it), so at 10,000 devices, with 438 KB updates, it was a quarter of an aggregator's CPU under
HMAC-SHA-256 (schema version 5). Versions 6 and 7 use keyed BLAKE3. This measures the current
MAC through ``shared.schemas.verify`` on real encoded updates (the quickstart MLP's 70 KB,
Fashion-MNIST's 438 KB, and a 4 MB model), as a service calls it, so the numbers include the
envelope's small part; and, as the reference, version 5's HMAC-SHA-256 (retired with version 5, so
no longer in ``shared.schemas``) computed here over the same input, as version 5's ``verify`` did.
Each cell is the median over ``repeats`` timings of enough back-to-back calls to last ~20 ms.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from shared import codec  # noqa: E402
from shared.schemas import (  # noqa: E402
    MAC_BYTES,
    SCHEMA_VERSION,
    Envelope,
    Kind,
    Update,
    decode,
    encode,
    task_key,
    verify,
)

#: float32 parameters of the models measured: the digits MLP, Fashion-MNIST's phone MLP, a 4 MB one
SIZES = {
    "digits MLP 64-128-64-10": 17_226,
    "Fashion-MNIST MLP (bench-scale)": 109_386,
    "1M parameters": 1 << 20,
}
MIN_SECONDS = 0.02


def _per_call(fn: Callable[[], object]) -> float:
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < MIN_SECONDS or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def _hmac_sha256(env: Envelope, key: str) -> bool:
    """Version 5's check, as its ``shared.schemas.verify`` made it: HMAC-SHA-256 over the same
    head, body and telemetry, truncated to the same 16 bytes (5 stands in the head, as it did)."""
    head = f"5|{env.kind.value}|{env.exp}|{env.round}|{env.inc}|{len(env.body)}|".encode()
    h = hmac.new(bytes.fromhex(key), head, hashlib.sha256)
    h.update(env.body)
    h.update(env.telemetry)
    return hmac.compare_digest(h.digest()[:MAC_BYTES], env.mac)


def run(repeats: int = 5) -> str:
    key = task_key("ab" * 16, 3, 7)
    rows = [
        "Checking one update's MAC, as an aggregator does, median of "
        f"{repeats} timings; µs per message. Keyed BLAKE3 is `shared.schemas.verify` (schema "
        f"version {SCHEMA_VERSION}); HMAC-SHA-256 is version 5's check (retired), computed here over "
        "the same bytes.",
        "",
        f"| update | bytes | v5: HMAC-SHA-256 | v{SCHEMA_VERSION}: keyed BLAKE3 | speed-up |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, n in SIZES.items():
        w = codec.encode(codec.Dense(np.random.default_rng(0).standard_normal(n).astype(np.float32)))
        upd = Update(device_id=7, num_samples=30, tensors={"w": w}, metrics={"train_loss": 0.5})
        data = encode(Kind.UPDATE, upd, exp="e", round=3, sender="", inc="0a0b0c0d", key=key)
        env, _ = decode(data, max_bytes=len(data) + 1, exp="e")
        assert verify(env, key)
        micros = [
            statistics.median(_per_call(functools.partial(check, env, key)) for _ in range(repeats)) * 1e6
            for check in (_hmac_sha256, verify)
        ]
        cells = " | ".join(f"{m:,.1f}" for m in micros)
        rows.append(f"| {name} | {len(data):,} | {cells} | {micros[0] / micros[-1]:.1f}x |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    text = run(args.repeats)
    if args.out:
        args.out.write_text(f"Command: `python benchmarks/bench_mac.py {' '.join(sys.argv[1:])}`\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
