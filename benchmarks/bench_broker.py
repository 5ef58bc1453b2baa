"""Round time at 50 devices by broker topology and queue type: classic and quorum queues, on one
RabbitMQ node and on a 3-node cluster, side by side in one run.

Usage: ``python benchmarks/bench_broker.py [--n 50] [--rounds 8] [--out FILE]``; ``run()`` returns the
markdown table for ``results.md``.

Why: ``RABBITMQ_QUEUE_TYPE`` trades cost for survival. A quorum queue replicates every message to a
majority of its members (Raft) before confirming it, a classic queue writes it once on one node; on
one node a quorum queue still writes a Raft log. The default (``classic``) and the ``ha`` overlay's
choice (``quorum``) should follow from what that costs per round, measured on the same workload as
the rounds benchmark (``bench_rounds.workload``: FedAvg on digits, every device trains every round,
quorum 1.0), each run a real ``fedfleet run`` with every service its own process.

The one-node figures use the broker ``RABBITMQ_URL`` names (the machine's); the 3-node figures a
private loopback cluster (``shared.transport.local_cluster``, the Kubernetes configuration), started
for this benchmark and removed after it. All three nodes share the machine's cores, so the cluster
figures are an upper bound on what separate machines would cost in CPU and a lower bound in latency.
Round 1 is a warm-up and is not in the median.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for path in (str(REPO), str(BENCH_DIR)):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench_rounds  # noqa: E402

from shared.config import Settings  # noqa: E402
from shared.transport import local_cluster  # noqa: E402
from shared.transport.urls import redact_all  # noqa: E402

Progress = Callable[[str], None]
QUEUE_TYPES = ("classic", "quorum")


def step_count() -> int:
    return 1 + 2 * len(QUEUE_TYPES)


def _series(
    url: str, queue_type: str, n: int, rounds: int, runs_dir: Path, run_id: str
) -> bench_rounds.Series:
    """One ``fedfleet run`` over ``url`` with ``queue_type`` (the CLI's environment carries both)."""
    saved = {k: os.environ.get(k) for k in ("RABBITMQ_URL", "RABBITMQ_QUEUE_TYPE")}
    os.environ["RABBITMQ_URL"], os.environ["RABBITMQ_QUEUE_TYPE"] = url, queue_type
    try:
        return bench_rounds.run_fedfleet(
            n, "amqp", rounds, clients=2, aggregators=1, runs_dir=runs_dir, run_id=run_id
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run(n: int, rounds: int, *, runs_dir: Path, progress: Progress | None = None) -> str:
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[tuple[str, str, bench_rounds.Series]] = []
    single = Settings().rabbitmq_url
    for queue_type in QUEUE_TYPES:
        say(f"broker: one node, {queue_type} queues")
        rows.append(
            (
                "1 node",
                queue_type,
                _series(single, queue_type, n, rounds, runs_dir, f"bench-broker-1-{queue_type}-{stamp}"),
            )
        )
    say("broker: forming a 3-node loopback cluster")
    with (
        tempfile.TemporaryDirectory(prefix="fedfleet-bench-cluster-") as tmp,
        local_cluster.LocalCluster(Path(tmp)) as cluster,
    ):
        for queue_type in QUEUE_TYPES:
            say(f"broker: 3 nodes, {queue_type} queues")
            series = _series(
                cluster.url, queue_type, n, rounds, runs_dir, f"bench-broker-3-{queue_type}-{stamp}"
            )
            rows.append(("3 nodes (loopback)", queue_type, series))
    lines = [
        f"Round seconds at {n} devices per round (all {n} train every round), {rounds} rounds, round 1 "
        "skipped; one `fedfleet run --transport amqp` each (2 client processes, 1 aggregator), "
        f"`python benchmarks/bench_broker.py --n {n} --rounds {rounds}`. One node: "
        f"`{redact_all(single)}`.",
        "",
        "| broker | queues | median round (s) | p90 (s) | median cycle (s) | run |",
        "|---|---|---:|---:|---:|---|",
    ]
    for broker, queue_type, s in rows:
        cycle = f"{s.cycle_median:.3f}" if s.cycle_median is not None else "-"
        lines.append(f"| {broker} | {queue_type} | {s.median:.3f} | {s.p90:.3f} | {cycle} | {s.note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=50, help="devices per round (= fleet size)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    table = run(args.n, args.rounds, runs_dir=args.runs_dir)
    if args.out:
        args.out.write_text(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
