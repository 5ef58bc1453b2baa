"""The MAC of a device's message: each schema version's algorithm, per message size.

Usage: ``python benchmarks/bench_mac.py [--repeats N] [--out FILE]``; ``run()`` returns the markdown
table for ``results.md`` (``make bench`` includes it).

Why: every update's MAC is computed twice over its whole body (the device makes it, an aggregator
checks it), so at 10,000 devices, with 438 KB updates, it was a quarter of an aggregator's CPU under
HMAC-SHA-256 (schema version 5). Version 6 uses keyed BLAKE3. This measures both through
``shared.schemas.verify`` on real encoded updates (the quickstart MLP's 70 KB, Fashion-MNIST's
438 KB, and a 4 MB model), as a service calls it, so the numbers include the envelope's small part.
Each cell is the median over ``repeats`` timings of enough back-to-back calls to last ~20 ms.
"""

from __future__ import annotations

import argparse
import functools
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
from shared.schemas import ACCEPTED_VERSIONS, Kind, Update, decode, encode, task_key, verify  # noqa: E402

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


def run(repeats: int = 5) -> str:
    key = task_key("ab" * 16, 3, 7)
    rows = [
        "Verifying one update's MAC (`shared.schemas.verify`, as an aggregator does), median of "
        f"{repeats} timings; the version's algorithm is in the header. µs per message.",
        "",
        "| update | bytes | "
        + " | ".join(f"v{v}: {_algorithm(v)}" for v in ACCEPTED_VERSIONS)
        + " | speed-up |",
        "|---|---:|" + "---:|" * len(ACCEPTED_VERSIONS) + "---:|",
    ]
    for name, n in SIZES.items():
        w = codec.encode(codec.Dense(np.random.default_rng(0).standard_normal(n).astype(np.float32)))
        upd = Update(device_id=7, num_samples=30, tensors={"w": w}, metrics={"train_loss": 0.5})
        micros = []
        size = 0
        for v in ACCEPTED_VERSIONS:
            data = encode(Kind.UPDATE, upd, exp="e", round=3, sender="", inc="0a0b0c0d", key=key, version=v)
            env, _ = decode(data, max_bytes=len(data) + 1, exp="e")
            assert verify(env, key)
            size = len(data)
            check = functools.partial(verify, env, key)
            micros.append(statistics.median(_per_call(check) for _ in range(repeats)) * 1e6)
        cells = " | ".join(f"{m:,.1f}" for m in micros)
        rows.append(f"| {name} | {size:,} | {cells} | {micros[0] / micros[-1]:.1f}x |")
    return "\n".join(rows)


def _algorithm(v: int) -> str:
    return "HMAC-SHA-256" if v == 5 else "keyed BLAKE3"


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
