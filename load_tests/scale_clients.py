"""Load scenario: one server, N aggregator and M client processes on this machine, for a few rounds.

Usage::

    .venv/bin/python load_tests/scale_clients.py [--clients 4] [--aggregators 2]
        [--devices-per-client 5] [--rounds 5] [--devices-per-round K] [--timeout 300]
        [--sample-s 0.5] [--json FILE] [--keep DIR]

Prints the round wall times (p50/p90/p95/max, round 1 apart: it is the warm-up), how long the fleet
took to register, and how deep each broker queue of the experiment got (sampled every ``--sample-s``
seconds with a passive ``queue.declare``, which reads the broker's live count). See
load_tests/README.md for what the numbers mean and how to read them.

Why a separate script from benchmarks/bench_rounds.py: that benchmark measures the cost of the
plumbing per round at a fixed workload; this one asks what happens to the *broker* and to the round
time as the number of client *processes* grows (what ``make scale CLIENTS=n`` does in Kubernetes),
and watches the queues for a backlog.

Safety: every count is capped (see ``LIMITS``), the whole scenario is killed after ``--timeout``
seconds, the broker must be on a loopback address (this never generates load against a remote
broker), services run with their /metrics endpoints off (no listening sockets), and the experiment's
queues and exchanges are deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pika.exceptions
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from services.orchestrator import ProcessCluster  # noqa: E402
from shared.config import Settings, parse_config  # noqa: E402
from shared.results import read_rounds, read_summary  # noqa: E402
from shared.transport import ExperimentNames  # noqa: E402
from shared.transport.amqp import AmqpTransport, broker_reachable  # noqa: E402

#: upper bounds of every knob, so a typo cannot fork hundreds of processes on a shared machine
LIMITS = {
    "clients": 32,
    "aggregators": 8,
    "devices_per_client": 50,
    "rounds": 50,
    "timeout": 1800.0,
}


def _workload(num_devices: int, devices_per_round: int, rounds: int, aggregators: int) -> dict[str, Any]:
    """The experiment: FedAvg on digits with a small MLP (the benchmarks' workload, a few epochs less),
    so the CPU goes to the services and the broker rather than to training."""
    return {
        "name": "loadtest",
        "seed": 0,
        "rounds": rounds,
        "num_devices": num_devices,
        "devices_per_round": devices_per_round,
        "round_timeout_s": 120,
        "quorum_fraction": 1.0,  # a round carries every selected update: the load is what was asked
        "registration_timeout_s": 300,
        "dataset": {"name": "digits", "partition": "iid", "train_limit": 1500},
        "model": {"name": "mlp", "options": {"hidden": [128, 64]}},
        "algorithm": {"name": "fedavg"},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "processes": {"aggregators": aggregators, "clients": 1},
    }


def _loopback(url: str) -> bool:
    host = urllib.parse.urlparse(url.replace("amqp://", "http://", 1)).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p95": None, "max": None}
    arr = np.asarray(values, dtype=float)
    return {
        "n": len(values),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p95": float(np.percentile(arr, 95)),
        "max": float(arr.max()),
    }


@dataclass
class QueueStats:
    """Depth samples of one queue (messages ready, as the broker counts them)."""

    samples: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"samples": 0, "max": 0, "mean": 0.0, "last": 0}
        return {
            "samples": len(self.samples),
            "max": max(self.samples),
            "mean": sum(self.samples) / len(self.samples),
            "last": self.samples[-1],
        }


class DepthSampler:
    """Reads queue depths with passive declares on its own connection.

    A passive declare of a queue that does not exist (yet) closes the channel with 404; that is
    normal here (a client's queue appears when it starts), so the channel is reopened and the queue
    skipped for this sample.
    """

    def __init__(self, url: str, queues: list[str]) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.ch = self.conn.channel()
        self.stats = {q: QueueStats() for q in queues}

    def sample(self) -> None:
        for queue, stats in self.stats.items():
            try:
                stats.samples.append(int(self.ch.queue_declare(queue, passive=True).method.message_count))
            except pika.exceptions.ChannelClosedByBroker:
                self.ch = self.conn.channel()
        self.conn.process_data_events(0)  # heartbeats

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def _registered_at(server_log: Path, total: int) -> float | None:
    """Unix time at which the server knew every device (from its structured log), if it did."""
    if not server_log.exists():
        return None
    for line in server_log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if event.get("event") == "register" and f"({total} known)" in event.get("msg", ""):
                return float(event["ts"])
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    url = args.broker or Settings().rabbitmq_url
    if not _loopback(url):
        raise SystemExit(f"refusing to load a non-loopback broker ({urllib.parse.urlparse(url).hostname})")
    if not broker_reachable(url):
        raise SystemExit("no RabbitMQ broker answers: run scripts/ensure_broker.sh (or `make broker`)")
    num_devices = args.clients * args.devices_per_client
    per_round = min(args.devices_per_round or num_devices, num_devices)
    exp_id = f"load{uuid.uuid4().hex[:8]}"
    names = ExperimentNames(exp_id)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fedfleet-load-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    cfg = parse_config(_workload(num_devices, per_round, args.rounds, args.aggregators), "load test")
    config = work / "experiment.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

    cluster = ProcessCluster(
        url,
        exp_id,
        config,
        run_dir,
        logs=work / "logs",
        state_dir=work / "s",
        env=dict(os.environ, FEDFLEET_LOG_LEVEL="WARNING"),
    )
    agg_ids = [f"agg-{i}" for i in range(args.aggregators)]
    client_ids = [f"client-{i}" for i in range(args.clients)]
    # Each aggregator's own queue carries only control messages and is named per session (a random
    # suffix), so it is not sampled; aggregators delete it when they stop (and it expires anyway).
    queues = [names.server_queue, names.updates_queue, names.dead_letter_queue]
    queues += [names.client_queue(c) for c in client_ids]

    started = time.time()
    sampler = DepthSampler(url, queues)
    timed_out = False
    try:
        # the server logs at INFO so its registration events can be read back; the others stay quiet
        server = cluster.server(env={"FEDFLEET_LOG_LEVEL": "INFO"})
        for a in agg_ids:
            cluster.aggregator(a)
        for i, c in enumerate(client_ids):
            first = i * args.devices_per_client
            cluster.client(c, f"{first}-{first + args.devices_per_client - 1}")
        launched = time.time()
        deadline = started + args.timeout
        while server.alive():
            if time.time() > deadline:
                timed_out = True
                break
            sampler.sample()
            time.sleep(args.sample_s)
        server_rc = server.returncode
    finally:
        sampler.close()
        cluster.stop_all()
        t = AmqpTransport(url, exp_id)
        try:
            t.delete_experiment(queues)
        finally:
            t.close()
    finished = time.time()

    rows = read_rounds(run_dir)
    registered = _registered_at(cluster.logs / "server.log", num_devices)
    summary = read_summary(run_dir) if (run_dir / "summary.json").exists() else {}
    result = {
        "experiment": exp_id,
        "clients": args.clients,
        "aggregators": args.aggregators,
        "devices": num_devices,
        "devices_per_round": per_round,
        "rounds_asked": args.rounds,
        "rounds_done": len(rows),
        "outcomes": sorted({r["outcome"] for r in rows}),
        "server_exit": server_rc,
        "timed_out": timed_out,
        "wall_s": finished - started,
        "registration_s": (registered - launched) if registered else None,
        "round_1_s": rows[0]["round_seconds"] if rows else None,
        "round_s": _percentiles([float(r["round_seconds"]) for r in rows[1:]]),
        "bytes_up": summary.get("bytes_up"),
        "bytes_down": summary.get("bytes_down"),
        "queues": {q.removeprefix(f"ff.{exp_id}."): s.summary() for q, s in sampler.stats.items()},
        "load_average": os.getloadavg(),
        "cores": os.cpu_count(),
        "logs": str(cluster.logs) if args.keep else None,
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f} {unit}"


def report(r: dict[str, Any]) -> str:
    rs = r["round_s"]
    lines = [
        f"# load: {r['clients']} client processes x {r['devices'] // r['clients']} devices, "
        f"{r['aggregators']} aggregators, {r['devices_per_round']} devices per round",
        f"rounds: {r['rounds_done']}/{r['rounds_asked']} ({', '.join(r['outcomes']) or 'none'})"
        + ("  TIMED OUT" if r["timed_out"] else "")
        + (f"  server exit {r['server_exit']}" if r["server_exit"] not in (0, None) else ""),
        f"wall: {r['wall_s']:.1f} s   registration of all devices: {_fmt(r['registration_s'])}   "
        f"round 1 (warm-up): {_fmt(r['round_1_s'])}",
        f"round wall time (rounds 2..): n={rs['n']}  p50 {_fmt(rs['p50'])}  p90 {_fmt(rs['p90'])}  "
        f"p95 {_fmt(rs['p95'])}  max {_fmt(rs['max'])}",
        f"bytes: up {r['bytes_up']}  down {r['bytes_down']}",
        f"load average {', '.join(f'{x:.2f}' for x in r['load_average'])} on {r['cores']} cores",
        "",
        f"{'queue':<24}{'max':>8}{'mean':>10}{'last':>8}{'samples':>9}",
    ]
    for name, q in r["queues"].items():
        lines.append(f"{name:<24}{q['max']:>8}{q['mean']:>10.2f}{q['last']:>8}{q['samples']:>9}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--clients", type=int, default=4, help="client processes (M)")
    p.add_argument("--aggregators", type=int, default=2, help="aggregator processes (N)")
    p.add_argument("--devices-per-client", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--devices-per-round", type=int, help="default: every device, every round")
    p.add_argument("--timeout", type=float, default=300.0, help="kill everything after this many seconds")
    p.add_argument("--sample-s", type=float, default=0.5, help="seconds between queue-depth samples")
    p.add_argument("--broker", help="AMQP URL (default: RABBITMQ_URL, then the local broker); loopback only")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.add_argument("--keep", help="keep the config, run directory and logs in this directory")
    args = p.parse_args(argv)
    for key, cap in LIMITS.items():
        value = getattr(args, key)
        if not 1 <= value <= cap:
            p.error(f"--{key.replace('_', '-')} must be between 1 and {cap:g}, got {value:g}")
    if args.devices_per_round is not None and args.devices_per_round < 1:
        p.error("--devices-per-round must be >= 1")
    if not 0.05 <= args.sample_s <= 10:
        p.error("--sample-s must be between 0.05 and 10")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["server_exit"] == 0 and not result["timed_out"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
