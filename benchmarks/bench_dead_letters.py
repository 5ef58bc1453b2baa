"""A burst of bad messages: how long a service spends storing their dead letters.

Usage: ``python benchmarks/bench_dead_letters.py [--counts 64 4096] [--repeats 3]``; ``run()`` returns
the markdown table for ``results.md`` (``make bench``).

Why: every bad message a service receives is stored in the dead-letter queue before its original is
acked, so that nothing is dropped unrecorded. Stored one by one, each is a confirmed publish, a broker
round trip: a hostile client host that sends one ``answers`` of 4,096 bad entries (the most one may
carry), or 4,096 bad messages, held the server in its handlers for seconds. A service now stores a
turn's dead letters together (``ServiceBase.turn`` -> ``Transport.dead_letter_many``: one AMQP
transaction on a classic queue). This measures both paths on the same broker: the old one
(``dead_letter`` per message, what a service still does outside its turn loop) and the batch.

Each measurement: ``count`` messages of 200 B are published to a fresh experiment's queue, consumed
unacked, then dead-lettered; the time is from the first dead letter to the last original's ack.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from shared.transport import Delivery  # noqa: E402
from shared.transport.amqp import AmqpTransport  # noqa: E402

COUNTS = (64, 4096)


def _one(url: str, count: int, batched: bool) -> float:
    """Seconds to dead-letter ``count`` held messages, one by one or together."""
    t = AmqpTransport(url, f"bench-dl-{uuid.uuid4().hex[:8]}")
    try:
        q = t.names.server_queue
        t.declare_queue(q, ["server"])
        t.publish_many([("server", b"x" * 200)] * count)
        held: list[Delivery] = []
        t.consume(q, held.append, prefetch=count)
        deadline = time.monotonic() + 60
        while len(held) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(held)} of {count} messages arrived")
            t.process(0.05)
        items = [(d, "bench", "a bad message") for d in held]
        started = time.perf_counter()
        if batched:
            t.dead_letter_many(items)
        else:
            for d, reason, detail in items:
                t.dead_letter(d, reason, detail)
        seconds = time.perf_counter() - started
        stored = t.queue_depth(t.names.dead_letter_queue)
        if stored != count or not all(d.settled for d in held):
            raise RuntimeError(f"{stored} of {count} dead letters stored")
        return seconds
    finally:
        t.delete_experiment()
        t.close()


def run(repeats: int = 3, counts: tuple[int, ...] = COUNTS) -> str:
    url = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    lines = [
        f"Seconds to store `count` dead letters and ack their originals over RabbitMQ (classic queue), "
        f"median of {repeats} (min-max); one by one = a confirmed publish each (`dead_letter`), "
        "together = one transaction (`dead_letter_many`, what a service's turn does).",
        "",
        "| count | one by one (s) | together (s) | ms per message, one by one | ms per message, together "
        "| speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for count in counts:
        lone = [_one(url, count, batched=False) for _ in range(repeats)]
        batch = [_one(url, count, batched=True) for _ in range(repeats)]
        a, b = statistics.median(lone), statistics.median(batch)
        lines.append(
            f"| {count:,} | {a:.3f} ({min(lone):.3f}-{max(lone):.3f}) "
            f"| {b:.3f} ({min(batch):.3f}-{max(batch):.3f}) "
            f"| {1e3 * a / count:.3f} | {1e3 * b / count:.3f} | {a / b:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(run(args.repeats, tuple(args.counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
