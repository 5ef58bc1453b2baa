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
  1 s, with each process's own peak (reading a process's PSS makes the kernel walk its page
  tables: at 0.5 s that sampling took ~4 % of the machine's CPU during rounds, competing with them);
* **registration**: from the server's start until every device is served by a host;
* **round wall time** of every round, next to a **plain-loop floor**: the same invited devices'
  local training (the same tasks, ``strategy.train``) in one plain Python loop, no messaging,
  measured in this run. ``slowest round / floor`` is the price of the plumbing at scale, and each
  round against its own floor says the same without round 1's warm-up;
* **CPU seconds per round by role** (broker, client hosts, aggregators, server, the benchmark's own
  samplers), rounds 2 to N-1, from ``/proc`` as each round ends: on 2 cores a round at this scale is
  bound by all processes' CPU together, so this is where "the rest of the time" goes.

``--out FILE --append`` (what ``make bench-scale`` does) adds a section headed with the date, the
commit and the CPU to FILE, so runs of different sessions and machines stay side by side; ``--out``
alone replaces FILE.

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

from bench_rounds import _cpu_seconds, _roles  # noqa: E402

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
    interval_s: float = 1.0
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


@dataclass
class CpuSampler:
    """CPU seconds of the run's processes by role, snapshotted as each round ends.

    Why: on 2 cores a round at this scale is bound by the CPU of all processes together (the
    broker, the client hosts, the aggregators, the server), not by any latency, so "where does the
    rest of the time go" is answered by CPU seconds per round and role (issue 16, item 5). It polls
    ``rounds.csv`` often (``interval_s``) so that a snapshot lies close to a round's end; its own CPU
    (and the PSS sampler's, which shares this process) is reported as ``bench`` because it competes
    with the run for the same cores.
    """

    parent: int
    rounds_csv: Path
    broker: int | None = None
    interval_s: float = 0.05
    #: (rounds done, CPU seconds by pid) at each round's end, the first as soon as one is done
    snapshots: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        done = 0
        while not self._stop.wait(self.interval_s):
            try:
                now = max(0, len(self.rounds_csv.read_text().splitlines()) - 1)
            except OSError:
                continue
            if now <= done:
                continue
            done = now
            if not self.roles:
                roles = _roles(self.parent, broker=True)
                self.roles = {
                    pid: r for pid, r in roles.items() if r != "broker" or self.broker in (None, pid)
                }
                self.roles[os.getpid()] = "bench"
            cpu = {pid: c for pid in self.roles if (c := _cpu_seconds(pid)) is not None}
            self.snapshots.append((done, cpu))

    def stop(self) -> None:
        self._stop.set()

    def per_round(self, last: int) -> tuple[int, dict[str, float]] | None:
        """CPU seconds per round by role over rounds 2 to ``last - 1``, and how many rounds that is.

        Round 1 is the warm-up (imports, first connections) and the last round's end is followed by
        the run's own end (results, plots), which a snapshot taken a few ms late would count. None
        when the run had too few rounds or a snapshot is missing (a process that exited mid-run:
        a client killed by its memory budget, say, is left out of both ends).
        """
        by_done = dict(self.snapshots)
        first, end = by_done.get(1), by_done.get(last - 1)
        if first is None or end is None or last - 2 < 1:
            return None
        n = last - 2
        out: dict[str, float] = {}
        for pid, role in self.roles.items():
            if pid in first and pid in end:
                out[role] = out.get(role, 0.0) + (end[pid] - first[pid]) / n
        return n, out


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
        cpu = CpuSampler(proc.pid, runs_dir / run_id / "rounds.csv", broker)
        cpu.start()
        time.sleep(0.5)
        sampler.start()
        try:
            rc = proc.wait(RUN_TIMEOUT_S)
        finally:
            sampler.stop()
            cpu.stop()
    if rc != 0:
        raise RuntimeError(f"fedfleet run exited with {rc}; see {log_path}")
    run_dir = runs_dir / run_id
    cpu_rounds = cpu.per_round(rounds)
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
        "cpu_rounds": cpu_rounds[0] if cpu_rounds else 0,
        "cpu_s_per_round": dict(sorted(cpu_rounds[1].items())) if cpu_rounds else {},
        "cores": os.cpu_count() or 1,
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
    ratios = zip(r["round_s"], r["floor_s"], strict=True)
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
        f"| each round / its own floor | {' / '.join(f'{a / b:.2f}x' for a, b in ratios)} |",
        "",
        "| process | peak PSS (MiB) |",
        "|---|---|",
        *(f"| {k} | {v:.0f} |" for k, v in r["peak_pss_by_process_mib"].items()),
    ]
    return "\n".join(lines + cpu_table(r))


#: how the CPU table names a role of ``bench_rounds._roles`` (and this benchmark's own process)
CPU_ROLES = {
    "broker": "broker",
    "client": "client hosts",
    "aggregator": "aggregators",
    "server": "server",
    "cli": "`fedfleet run`",
    "zygote": "fork server",
    "bench": "this benchmark (its samplers)",
}


def cpu_table(r: dict[str, Any]) -> list[str]:
    """Where a round's time goes: CPU seconds per round by role, against the cores and the floor."""
    cpu: dict[str, float] = r.get("cpu_s_per_round") or {}
    if not cpu:
        return ["", "(CPU by role: not measured; the run needs at least 3 rounds)"]
    n, cores = r["cpu_rounds"], r["cores"]
    total = sum(cpu.values())
    rounds = r["round_s"][1 : 1 + n]
    floors = r["floor_s"][1 : 1 + n]
    mean_round, mean_floor = sum(rounds) / n, sum(floors) / n
    lines = [
        "",
        f"CPU seconds per round by role, rounds 2–{n + 1} (from `/proc`, snapshotted as each round ends; "
        f"mean round {mean_round:.2f} s, mean floor {mean_floor:.2f} s):",
        "",
        "| role | CPU s per round | share | x floor |",
        "|---|---:|---:|---:|",
    ]
    for role, secs in sorted(cpu.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"| {CPU_ROLES.get(role, role)} | {secs:.2f} | {secs / total:.0%} | {secs / mean_floor:.2f} |"
        )
    lines += [
        f"| **all** | {total:.2f} | 100% | {total / mean_floor:.2f} |",
        "",
        f"All processes' CPU per round / {cores} cores = {total / cores:.2f} s: no schedule of this "
        f"work makes a round shorter ({total / cores / mean_floor:.2f}x the floor; the mean round took "
        f"{mean_round / (total / cores):.2f}x that bound).",
    ]
    return lines


def _provenance(out: Path | None = None) -> str:
    """When, at which commit and on which CPU a run was made: the heading of an appended section.

    Why: round times and their ratios to the floor move with the machine (a host with AVX-512 trains
    this model ~2.4x faster than one without, so the same plumbing is a larger multiple of its floor),
    and results from different sessions sit in the same file.
    """
    from run_all import _cpu_model, _git_commit  # the report of ``make bench`` names its machine so

    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    simd = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = f"{_cpu_model()}, {simd}, {os.cpu_count()} cores"
    return f"`make bench-scale`, {when}, main at {_git_commit(out)} ({machine})"


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
        block = f"Command: `{command}`\n\n{text}\n"
        if args.append and args.out.exists():
            block = f"{args.out.read_text()}\n## {_provenance(args.out)}\n\n{block}"
        args.out.write_text(block)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
