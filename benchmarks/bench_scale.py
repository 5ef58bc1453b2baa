"""Thousands of phones on one machine: memory, round time and registration at fleet scale.

Usage: ``python benchmarks/bench_scale.py [--devices 10000] [--per-round 1000] [--rounds 3]
[--clients 4] [--aggregators 2] [--samples-per-device N] [--out FILE]``; ``make bench-scale`` runs it
and writes its table, with the command, into ``benchmarks/results-scale.md``.

``--samples-per-device N`` deals the data with the ``sampled`` partition (each device draws N samples
of the pool from its own seed) instead of ``iid``: how a fleet larger than the dataset (100,000
devices on Fashion-MNIST's 60,000 samples) is run.

The scenario (issue 16): ``experiments/fleet_2000.yaml`` — FedAvg on Fashion-MNIST, the ``mobile``
phone preset — with ``--devices`` registered devices, ``--per-round`` kept per round with
over-selection 1.3 (so 1.3x that many invited), over RabbitMQ with separate processes. It reports:

* **peak PSS** (proportional set size: shared pages split among the processes sharing them, so the
  sum is what the machine really holds) of every fedfleet process *and* the broker, sampled every
  0.5 s, with each process's own peak;
* **registration**: from the server's start until every device is served by a host;
* **round wall time** of every round, next to a **plain-loop floor**: the same invited devices'
  local training (the same tasks, ``strategy.train``) in one plain Python loop, no messaging,
  measured in this run. ``slowest round / floor`` is the price of the plumbing at scale.

The broker (``beam.smp``) is counted whole: on a shared machine it includes others' queues. Only the
broker listening on ``RABBITMQ_URL``'s port is counted (other brokers on the machine, such as the
throwaway ones of multi-broker tests, are not this run's); if it cannot be found (another user's
process whose sockets this one may not read), every ``beam.smp`` is, as before 2026-11-26 15:00 UTC.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(Path(__file__).resolve().parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_rounds import _roles  # noqa: E402

RUN_TIMEOUT_S = 1800.0


def scenario(
    devices: int,
    per_round: int,
    rounds: int,
    clients: int,
    aggregators: int,
    samples_per_device: int | None = None,
) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "experiments" / "fleet_2000.yaml").read_text())
    cfg.update(
        name=f"bench-scale-{devices}",
        rounds=rounds,
        num_devices=devices,
        devices_per_round=per_round,
        registration_timeout_s=600,
        round_timeout_s=600,
    )
    cfg["dataset"] = {**cfg["dataset"], "partition": "iid"}
    if samples_per_device is not None:
        cfg["dataset"] = {**cfg["dataset"], "partition": "sampled", "samples_per_device": samples_per_device}
    cfg["processes"] = {"clients": clients, "aggregators": aggregators}
    cfg["hosts"] = {"join_quiet_s": 3.0, "lease_timeout_s": 60.0}
    return dict(cfg)


def pss_kib(pid: int) -> int | None:
    """A process's proportional set size in KiB (None once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def broker_pid(port: int) -> int | None:
    """The ``beam.smp`` listening on ``port`` (None if there is none this process may see)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                sockets.add(f"socket:[{f[9]}]")
    for entry in Path("/proc").iterdir() if sockets else ():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().split(b"\0")[0].endswith(b"beam.smp"):
                continue
            if any(os.readlink(fd) in sockets for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    return None


def amqp_port() -> int:
    """The port of the broker a run uses (the first of ``RABBITMQ_URL``'s, else the default)."""
    url = os.environ.get("RABBITMQ_URL") or "amqp://guest:guest@127.0.0.1:5672/%2F"
    return urlsplit(url.split(",")[0].strip()).port or 5672


@dataclass
class MemorySampler:
    """Samples the PSS of the run's processes (and the broker) until stopped.

    ``broker``: the run's broker's pid; other ``beam.smp`` processes are left out (None: all count).
    """

    parent: int
    broker: int | None = None
    interval_s: float = 0.5
    peak_total_kib: int = 0
    peak_by_process: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            roles = _roles(self.parent, broker=True)
            if self.broker is not None:
                roles = {pid: r for pid, r in roles.items() if r != "broker" or pid == self.broker}
            names = _names(roles)
            total = 0
            for pid, name in names.items():
                kib = pss_kib(pid)
                if kib is None:
                    continue
                total += kib
                self.peak_by_process[name] = max(self.peak_by_process.get(name, 0), kib)
            self.peak_total_kib = max(self.peak_total_kib, total)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


def _names(roles: dict[int, str]) -> dict[int, str]:
    """pid → a readable name: the role plus the service's --id, if any."""
    out = {}
    for pid, role in roles.items():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ident = ""
        for i, a in enumerate(args):
            if a == b"--id" and i + 1 < len(args):
                ident = args[i + 1].decode()
        fixed = {"cli": "fedfleet run", "broker": "broker", "zygote": "fork server"}
        out[pid] = fixed.get(role) or f"{role} {ident}".strip()
    return out


def plain_floor(cfg_path: Path, run_dir: Path) -> list[float]:
    """Seconds per round of the invited devices' training in one plain loop (the same tasks)."""
    from services.server.service import Server
    from shared.algorithms.base import DeviceContext, derive_seed
    from shared.config import load_config
    from shared.experiment import Experiment
    from shared.transport.inproc import InprocBroker, InprocTransport

    cfg = load_config(cfg_path)
    exp = Experiment.build(cfg)
    strategy = exp.strategy
    server = Server(InprocTransport(InprocBroker(), "floor"), exp, run_dir / "floor", experiment_id="floor")
    server.leases.table.all_devices = list(range(cfg.num_devices))
    state = strategy.init_state()
    out = []
    for rnd in range(1, cfg.rounds + 1):
        invited = _invited(server, exp, rnd)
        tasks = strategy.plan(state, rnd, invited, server.registry)
        started = time.perf_counter()
        for dev in invited:
            seed = derive_seed(cfg.seed, "train", rnd, dev) % (2**32)
            ctx = DeviceContext(dev, rnd, exp.device_data(dev), run_dir / "floor-state" / str(dev), seed)
            strategy.train(tasks[dev], ctx)
        out.append(time.perf_counter() - started)
    return out


def _invited(server: Any, exp: Any, rnd: int) -> list[int]:
    import numpy as np

    from shared.algorithms.base import derive_seed
    from shared.devices import is_online, over_select

    cfg = exp.cfg
    rng = np.random.default_rng(derive_seed(cfg.seed, "select", rnd) % (2**32))
    online = [d for d in range(cfg.num_devices) if is_online(exp.fleet[d], rnd, cfg.seed)]
    picked = over_select(online, cfg.devices_per_round, cfg.emulation.over_selection, rng)
    return sorted(int(x) for x in picked)


def run(
    devices: int,
    per_round: int,
    rounds: int,
    clients: int,
    aggregators: int,
    runs_dir: Path,
    samples_per_device: int | None = None,
) -> dict[str, Any]:
    runs_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"bench-scale-{devices}-{time.strftime('%H%M%S')}"
    cfg_path = runs_dir / f"{run_id}.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            scenario(devices, per_round, rounds, clients, aggregators, samples_per_device), sort_keys=False
        )
    )
    log_path = runs_dir / f"{run_id}.log"
    argv = [sys.executable, "-m", "services.cli", "run", str(cfg_path), "--transport", "amqp"]
    argv += ["--runs-dir", str(runs_dir), "--run-id", run_id]
    started = time.time()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, COLUMNS="120")
        )
        broker = broker_pid(amqp_port())
        sampler = MemorySampler(proc.pid, broker)
        time.sleep(0.5)
        sampler.start()
        try:
            rc = proc.wait(RUN_TIMEOUT_S)
        finally:
            sampler.stop()
    if rc != 0:
        raise RuntimeError(f"fedfleet run exited with {rc}; see {log_path}")
    run_dir = runs_dir / run_id
    rows = [json.loads(json.dumps(r)) for r in _rows(run_dir)]
    registered = _registration_s(run_dir / "logs" / "server.log")
    floor = plain_floor(cfg_path, run_dir)
    return {
        "run_dir": str(run_dir.relative_to(REPO)) if run_dir.is_relative_to(REPO) else str(run_dir),
        "wall_s": time.time() - started,
        "peak_pss_mib": sampler.peak_total_kib / 1024,
        "broker_pid": broker,
        "peak_pss_by_process_mib": {k: v / 1024 for k, v in sorted(sampler.peak_by_process.items())},
        "registration_s": registered,
        "round_s": [float(r["round_seconds"]) for r in rows],
        "floor_s": floor,
        "participants": [int(r["participants"]) for r in rows],
    }


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    from shared.results import read_rounds

    return read_rounds(run_dir)


def _registration_s(server_log: Path) -> float | None:
    """Seconds from the server's start until its first round opened (every device then served)."""
    ready = first = None
    for line in server_log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        if e.get("event") == "server_ready" and ready is None:
            ready = e["ts"]
        elif e.get("event") == "round_open" and first is None:
            first = e["ts"]
    return (first - ready) if ready and first else None


def table(r: dict[str, Any], devices: int, per_round: int) -> str:
    slowest = max(r["round_s"])
    floor = max(r["floor_s"])
    lines = [
        f"{devices:,} registered devices, {per_round:,} kept per round (over-selection 1.3), "
        f"{len(r['round_s'])} rounds; run `{r['run_dir']}`.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| peak PSS, all fedfleet processes + broker | {r['peak_pss_mib']:.0f} MiB |",
        f"| registration (server start → first round) | {r['registration_s']:.1f} s |",
        f"| round wall time, each | {' / '.join(f'{x:.2f}' for x in r['round_s'])} s |",
        f"| plain-loop floor, each round | {' / '.join(f'{x:.2f}' for x in r['floor_s'])} s |",
        f"| slowest round / slowest floor | {slowest / floor:.2f}x |",
        "",
        "| process | peak PSS (MiB) |",
        "|---|---|",
        *(f"| {k} | {v:.0f} |" for k, v in r["peak_pss_by_process_mib"].items()),
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--devices", type=int, default=10_000)
    p.add_argument("--per-round", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--aggregators", type=int, default=2)
    p.add_argument("--samples-per-device", type=int, help="the sampled partition with this many samples each")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "bench-scale")
    p.add_argument("--json", type=Path)
    p.add_argument("--out", type=Path, help="also write the table, with the command, to this markdown file")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    args = p.parse_args()
    r = run(
        args.devices,
        args.per_round,
        args.rounds,
        args.clients,
        args.aggregators,
        args.runs_dir,
        args.samples_per_device,
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    text = table(r, args.devices, args.per_round)
    if args.out:
        command = " ".join(["python", "benchmarks/bench_scale.py", *sys.argv[1:]])
        block = f"Command: `{command}` ({time.strftime('%Y-%m-%d')})\n\n{text}\n"
        if args.append and args.out.exists():
            block = args.out.read_text() + "\n" + block
        args.out.write_text(block)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
