"""Codec throughput: encode+packb and unpackb+decode, in MB/s of dense-equivalent bytes.

Usage: ``python benchmarks/bench_codec.py [--repeats N] [--out FILE]``; ``run()`` returns the markdown
table so it can be pasted into ``benchmarks/results.md``.

Throughput is measured against *dense-equivalent* bytes (numel * itemsize of the full tensor), not wire
bytes, so the numbers answer "how many MB of model per second can a service move through the codec"
and are comparable across payload kinds. MB = 10**6 bytes. Each cell is the median over ``repeats``
timings; each timing averages enough back-to-back calls to last >= ~20 ms, which keeps timer noise out
of sub-millisecond operations. Decoding uses the default Limits, so the NaN/Inf scan is included.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    from shared.codec import (
        DEFAULT_LIMITS,
        Dense,
        Sliced,
        Sparse,
        SparseFormat,
        Tensor,
        decode,
        dense_bytes,
        encode,
        packb,
        unpackb,
    )
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared.codec import (
        DEFAULT_LIMITS,
        Dense,
        Sliced,
        Sparse,
        SparseFormat,
        Tensor,
        decode,
        dense_bytes,
        encode,
        packb,
        unpackb,
    )

SHAPE = (1024, 1024)  # float32: 4 MiB dense-equivalent
MIN_SECONDS = 0.02


def _time_per_call(fn: Callable[[], object]) -> float:
    """Seconds per call, averaged over enough calls to span MIN_SECONDS."""
    fn()  # warm up (page faults, lazy imports)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_SECONDS:
            return elapsed / calls


def _encoder(tensor: Tensor, fmt: SparseFormat) -> Callable[[], bytes]:
    return lambda: packb(encode(tensor, sparse_format=fmt))


def _decoder(wire: bytes) -> Callable[[], Tensor]:
    return lambda: decode(unpackb(wire, max_bytes=len(wire)))


def _payloads(rng: np.random.Generator) -> list[tuple[str, str, Tensor, SparseFormat]]:
    """(label, density, tensor, sparse_format) for every row of the table."""
    w = rng.standard_normal(SHAPE).astype(np.float32)
    rows: list[tuple[str, str, Tensor, SparseFormat]] = [("dense", "1.0", Dense(w), "auto")]
    for density in (0.1, 0.5):
        sp = Sparse.from_dense(w, rng.random(SHAPE) < density)
        chosen = encode(sp)["format"]
        fmts: tuple[SparseFormat, ...] = ("bitmask", "coo")
        for fmt in fmts:
            label = f"sparse {fmt}" + (" (auto's pick)" if fmt == chosen else "")
            rows.append((label, str(density), sp, fmt))
        # Width slicing keeps a fraction sqrt(d) of rows and of columns -> density d (HeteroFL-style).
        keep = [np.sort(rng.choice(n, round(n * density**0.5), replace=False)) for n in SHAPE]
        rows.append(("sliced", str(density), Sliced.from_dense(w, keep), "auto"))
    return rows


def run(repeats: int = 5) -> str:
    """Benchmark every payload kind and return a markdown table (also the CLI's output)."""
    rng = np.random.default_rng(0)
    lines = [
        f"Codec throughput, float32 tensor {SHAPE[0]}x{SHAPE[1]} "
        f"({4 * SHAPE[0] * SHAPE[1] / 1e6:.1f} MB dense), "
        f"median of {repeats}; MB/s of dense-equivalent bytes (MB = 10^6 B). "
        f"Python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}.",
        "",
        "| payload | density | wire bytes | wire / dense | encode+packb MB/s | unpackb+decode MB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, density, tensor, fmt in _payloads(rng):
        wire = packb(encode(tensor, sparse_format=fmt))
        assert decode(unpackb(wire, max_bytes=len(wire)), DEFAULT_LIMITS) == tensor
        dense = dense_bytes(tensor)
        enc = statistics.median(_time_per_call(_encoder(tensor, fmt)) for _ in range(repeats))
        dec = statistics.median(_time_per_call(_decoder(wire)) for _ in range(repeats))
        lines.append(
            f"| {label} | {density} | {len(wire):,} | {len(wire) / dense:.3f} "
            f"| {dense / enc / 1e6:,.0f} | {dense / dec / 1e6:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell; the median is reported")
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    table = run(args.repeats)
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return table


if __name__ == "__main__":
    main()
