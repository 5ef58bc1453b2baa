"""Consumer CPU per message by pika's socket read size (its 4 KiB against fedfleet's) and frame parsing.

Usage: ``python benchmarks/bench_recv.py [--sizes 300 50000 438000] [--repeats 3] [--out FILE]``.

Why: pika appends every socket read to its frame buffer (a copy of the partial frame) and tries to
parse a frame after each, so with 4 KiB reads a 438 KB update (a ``fleet_2000`` phone's model)
costs ~107 reads and as many copies of a growing buffer. ``shared.transport.amqp`` raises the read
size to ``RECV_BYTES``, and parses the frames of a read where they lie instead of cutting each
off the front of pika's buffer (``shared.transport.amqp._on_data_available``); this measures what
each buys. Each measurement is a fresh process: it
publishes N messages of one size to a temporary queue, then consumes and acks them all with a
plain ``BlockingConnection`` (prefetch 50), timing the consumer's process CPU. The median of
``--repeats`` runs is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: how many messages each size is measured on (enough for a stable CPU time per message)
COUNTS = {300: 5000, 50_000: 2000, 438_000: 300}


def _one(url: str, read_bytes: int, size: int, count: int, in_place: bool) -> float:
    """In this process: publish ``count`` messages of ``size`` bytes, consume them all; returns the
    consumer's CPU seconds per message. ``in_place``: with fedfleet's frame parsing."""
    import pika
    from pika.adapters.utils import io_services_utils as io

    if in_place:
        import shared.transport.amqp  # noqa: F401  (installs the parsing; sets its read size, reset below)
    io._AsyncTransportBase._MAX_RECV_BYTES = read_bytes
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    queue = f"ff.bench-recv.{uuid.uuid4().hex[:8]}"
    ch.queue_declare(queue, auto_delete=True)
    body = os.urandom(size)
    for _ in range(count):
        ch.basic_publish("", queue, body)
    time.sleep(0.5)  # let the broker settle before the consumer's clock starts
    got = 0

    def on_message(chan: object, method: object, props: object, data: bytes) -> None:
        nonlocal got
        got += 1
        ch.basic_ack(method.delivery_tag)  # type: ignore[attr-defined]

    ch.basic_qos(prefetch_count=50)
    t0 = time.process_time()
    ch.basic_consume(queue, on_message)
    while got < count:
        conn.process_data_events(time_limit=1)
    cpu = time.process_time() - t0
    conn.close()
    return cpu / count


#: (read size, fedfleet's frame parsing) of each column: pika as it comes, larger reads, both
MODES = ((4096, False), (1 << 20, False), (1 << 20, True))


def measure(url: str, sizes: list[int], repeats: int) -> list[tuple[int, int, list[float]]]:
    """(size, count, ms per message in each of :data:`MODES`), medians over ``repeats``."""
    rows = []
    for size in sizes:
        count = COUNTS.get(size, max(100, 130_000_000 // max(size, 1)))
        per: dict[tuple[int, bool], list[float]] = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for read, in_place in per:  # interleaved, so that a busy moment hits all
                argv = [url, str(read), str(size), str(count), str(int(in_place))]
                out = subprocess.run(
                    [sys.executable, __file__, "--child", *argv], check=True, capture_output=True, text=True
                )
                per[read, in_place].append(json.loads(out.stdout)["s"])
        rows.append((size, count, [statistics.median(per[m]) * 1e3 for m in MODES]))
    return rows


def run(repeats: int = 3, sizes: list[int] | None = None) -> str:
    """The markdown table (for ``run_all``'s report, under its own heading)."""
    from shared.transport.amqp import RECV_BYTES

    url = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    rows = measure(url, sizes or sorted(COUNTS), repeats)
    assert MODES[-1][0] == RECV_BYTES
    lines = [
        f"Consumer CPU per message (ms, median of {repeats} runs, each a fresh process) with pika's "
        f"4 KiB socket reads, with fedfleet's {RECV_BYTES:,} B (`shared.transport.amqp.RECV_BYTES`), "
        "and with those reads and fedfleet's frame parsing (`shared.transport.amqp._on_data_available`: "
        "frames decoded where they lie in a read, not cut off the front of pika's buffer one by one).",
        "",
        "| message bytes | messages | 4 KiB reads, ms | fedfleet's reads, ms | + in-place frames, ms "
        "| ratio (last / first) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size, count, (default, reads, ours) in rows:
        lines.append(
            f"| {size:,} | {count:,} | {default:.3f} | {reads:.3f} | {ours:.3f} | {ours / default:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, read, size, count = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps({"s": _one(url, read, size, count, sys.argv[6] == "1")}))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=sorted(COUNTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = p.parse_args()
    command = "python benchmarks/bench_recv.py " + " ".join(sys.argv[1:])
    when = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    text = f"## Reading large messages\n\nWritten by `{command.strip()}` on {when}.\n\n"
    text += run(args.repeats, args.sizes)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
