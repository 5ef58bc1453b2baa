"""Start and drive an experiment's services: in one process, or as one OS process per service.

Why one module: ``fedfleet run``, the tests and the benchmark scripts all need "server + aggregators +
clients of this experiment, driven until the server stops, with a look at every finished round".
Wired separately in each, the copies drifted (a test's cluster hosted devices differently from the
CLI's). Here it exists once:

* :class:`InprocCluster` — the services as objects in this process, each with its own transport
  connection: the in-process broker by default (fast, no broker), or any transport factory, e.g. a
  RabbitMQ connection per service (the real broker, without paying a torch import per process).
  ``run(on_round=...)`` calls the hook as soon as a round's row exists, before any device trains for
  the next round.
* :class:`ProcessCluster` — the services as OS processes (``python -m services.cli server|...``),
  each with its log file and metrics port; what ``fedfleet run`` and the end-to-end tests start,
  and what a test can SIGKILL like a real crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from shared.config import ExperimentConfig, dump_config
from shared.identity import aggregator_user, host_user, server_user
from shared.results import read_rounds

if TYPE_CHECKING:  # torch stays out of the import path of ``fedfleet run``'s parent process
    from services.aggregator.service import Aggregator
    from services.client.service import Client
    from services.common import ServiceBase
    from services.server.service import Server
    from services.zygote import ForkServer
    from shared.experiment import Experiment
    from shared.transport import Transport

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parents[1]

#: called with the server once a round's row is written (``server.rows[-1]``)
RoundHook = Callable[["Server"], None]


# -- progress --------------------------------------------------------------------------------------
class RoundProgress:
    """A rich progress bar over rounds: accuracy and megabytes on the wire so far."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]round {task.completed:.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("· {task.fields[mb]} MB"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not enabled,
        )
        self._task: TaskID = self._progress.add_task("rounds", total=total, acc="-", mb="0.0")

    def __enter__(self) -> RoundProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(None, None, None)

    def update(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        last = rows[-1]
        accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
        mb = (last["cum_bytes_up"] + last["cum_bytes_down"]) / 1e6
        acc = f"{accs[-1]:.3f}" if accs else "-"
        self._progress.update(self._task, completed=len(rows), acc=acc, mb=f"{mb:.1f}")


# -- in one process --------------------------------------------------------------------------------
class InprocCluster:
    """The experiment's services as objects in this process, driven round-robin by :meth:`run`.

    ``transport(user)`` makes each service's connection as broker user ``user`` (default: a shared
    in-process broker, where each service publishes as its role's user, so sender checks are on). Services can
    be added and removed while the run goes on — what the fault tests do to emulate a late start or
    a crash (:meth:`crash` closes a service's connection without any clean-up, as a SIGKILL would).
    """

    def __init__(
        self,
        exp: Experiment,
        run_dir: Path,
        experiment_id: str,
        *,
        transport: Callable[[str], Transport] | None = None,
        aggregators: int | None = None,
        clients: int | None = None,
        state_dir: Path | None = None,
        bundle: bool = True,
    ) -> None:
        from services.server.service import Server

        self.exp, self.cfg, self.run_dir, self.experiment_id = exp, exp.cfg, run_dir, experiment_id
        #: the hosts' ``bundle`` (``FEDFLEET_BUNDLE``): whether a flush's updates and answers go as
        #: one ``updates`` and one ``answers``, or each alone
        self.bundle = bundle
        #: hosts keep their devices' state under ``<state_dir>/<host id>`` (the server keeps the newest
        #: copy of every device in ``<run_dir>/device-state``)
        self.state_dir = state_dir or run_dir / "hosts"
        if transport is None:
            from shared.transport.inproc import InprocBroker, InprocTransport

            self.broker: InprocBroker | None = InprocBroker()
            broker = self.broker
            self._transport: Callable[[str], Transport] = lambda user: InprocTransport(
                broker, experiment_id, user
            )
        else:
            self.broker, self._transport = None, transport
        self.server = Server(self._transport(server_user()), exp, run_dir, experiment_id=experiment_id)
        self.services: list[ServiceBase] = [self.server]
        #: services that stopped by themselves (a host that left, everyone at the end)
        self.exited: list[ServiceBase] = []
        for i in range(self.cfg.processes.aggregators if aggregators is None else aggregators):
            self.add_aggregator(f"agg-{i}")
        n_clients = self.cfg.processes.clients if clients is None else clients
        for i in range(min(n_clients, self.cfg.num_devices)):
            self.add_client(f"client-{i}")

    @property
    def aggregators(self) -> list[Aggregator]:
        from services.aggregator.service import Aggregator

        return [s for s in self.services if isinstance(s, Aggregator)]

    @property
    def clients(self) -> list[Client]:
        from services.client.service import Client

        return [s for s in self.services if isinstance(s, Client)]

    def add_aggregator(self, name: str) -> Aggregator:
        from services.aggregator.service import Aggregator, registered_samples

        agg = Aggregator(
            self._transport(aggregator_user()),
            self.exp.strategy,
            experiment_id=self.experiment_id,
            algorithm=self.cfg.algorithm.name,
            aggregator_id=name,
            prefetch=self.cfg.processes.prefetch,
            max_bytes=self.cfg.processes.max_message_bytes,
            bounds=self.cfg.bounds,
            sample_limits=registered_samples(self.exp),
        )
        self.services.append(agg)
        return agg

    def add_client(
        self, name: str, devices: list[int] | None = None, *, max_devices: int | None = None
    ) -> Client:
        """A client host: it serves what the server leases it, or exactly ``devices`` (pinned)."""
        from services.client.service import Client

        client = Client(
            self._transport(host_user(name)),
            self.exp,
            experiment_id=self.experiment_id,
            client_id=name,
            state_dir=self.state_dir / name,
            pinned=devices,
            max_devices=max_devices,
            bundle=self.bundle,
        )
        self.services.append(client)
        return client

    def leave(self, client: Client) -> None:
        """A host asked to leave (SIGTERM): it goes on serving until its devices are handed over,
        then stops and is removed here."""
        client.terminate()

    def crash(self, service: ServiceBase) -> None:
        """Take a service away as a crash would: its connection closes, its unacked messages are
        redelivered to others, and nothing of it runs again."""
        service.transport.close()
        self.services.remove(service)

    def step(self, after_each: Callable[[], None] | None = None) -> None:
        """One pass: every service handles what is ready for it, then runs its timers; ``after_each``
        runs after each service's turn."""
        for svc in list(self.services):
            if svc in self.services and svc not in self.exited:  # a hook may have crashed it
                svc.turn(0)
                if svc.stopped and svc is not self.server:  # as its process would exit
                    svc.transport.close()
                    self.exited.append(svc)
                if after_each is not None:
                    after_each()

    def run(
        self,
        *,
        on_round: RoundHook | None = None,
        on_step: Callable[[], None] | None = None,
        progress: RoundProgress | None = None,
        until: Callable[[], bool] | None = None,
        max_steps: int | None = None,
    ) -> int:
        """Drive every service until the server stops (or ``until()`` holds); returns an exit code.

        ``on_round(server)`` runs once per finished round, right after the server's turn that wrote
        its row — before any client handles the next round's task, so a hook sees exactly the
        rounds so far (counters included). ``on_step()`` runs after every service's turn (fault
        tests inject their faults there).
        """
        seen = len(self.server.rows)

        def after_each() -> None:
            nonlocal seen
            if len(self.server.rows) > seen:
                seen = len(self.server.rows)
                if on_round is not None:
                    on_round(self.server)
                if progress is not None:
                    progress.update(self.server.rows)
            if on_step is not None:
                on_step()

        steps = 0
        while not self.server.stopped and not (until is not None and until()):
            self.step(after_each)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"the run did not finish within {max_steps} passes")
            if self.broker is not None and self.broker.pending() == 0:
                time.sleep(0.001)
        return 1 if self.server.error else 0

    def close(self) -> None:
        for svc in self.services:
            if svc not in self.exited:
                svc.transport.close()


def run_inproc(
    cfg: ExperimentConfig,
    run_dir: Path,
    run_id: str,
    *,
    exp: Experiment | None = None,
    on_round: RoundHook | None = None,
    show_progress: bool = True,
    bundle: bool = True,
) -> int:
    """Run ``cfg`` with every service in this process over the in-process broker; returns an exit code.

    ``exp`` lets a caller pass an experiment it has instrumented (e.g. a wrapped ``strategy.train``).
    ``bundle``: the hosts' ``FEDFLEET_BUNDLE`` (``fedfleet run`` passes the setting, so that it means
    the same on either transport).
    """
    from services.common import setup_logging
    from shared.experiment import Experiment

    setup_logging("WARNING")
    cluster = InprocCluster(exp if exp is not None else Experiment.build(cfg), run_dir, run_id, bundle=bundle)
    try:
        with RoundProgress(cfg.rounds, enabled=show_progress) as progress:
            rc = cluster.run(on_round=on_round, progress=progress)
        if rc == 0 and cluster.broker is not None and (run_dir / "summary.json").exists():
            _record_inproc_dead_letters(cluster.broker, run_id, run_dir)
        return rc
    finally:
        cluster.close()


def _record_inproc_dead_letters(broker: Any, experiment: str, run_dir: Path) -> None:
    """What ``fedfleet run`` records over RabbitMQ, for a run over the in-process broker: its dead
    letters in ``dead_letters.jsonl``, their count and reasons in ``summary.json``."""
    from shared.results import write_dead_letters
    from shared.transport import names

    records = []
    for msg in broker.queues.get(names(experiment).dead_letter_queue, ()):
        # in process, a dead letter keeps its original sender as its user
        headers = {"x-fedfleet-user": msg.user_id, "x-original-key": msg.key, **msg.headers}
        records.append(dead_letter_record(headers, None, msg.body))
    write_dead_letters(run_dir, records)
    summarise_dead_letters(run_dir, records)


def summarise_dead_letters(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """``summary.json`` gets the dead letters' count and the count of each reason."""
    from collections import Counter

    from shared.results import read_summary, write_summary

    summary = read_summary(run_dir)
    summary["dead_lettered"] = len(records)
    summary["dead_letter_reasons"] = dict(Counter(r["reason"] for r in records).most_common())
    write_summary(run_dir, summary)


def run_inproc_once(cfg: ExperimentConfig, run_dir: Path, run_id: str, *, force: bool = False) -> bool:
    """Run ``cfg`` in process into ``run_dir`` (with its resolved ``config.yaml``) unless a finished
    run is already there; True if it ran.

    Why: the benchmark scripts run dozens of configurations and are invoked again to add a row or
    re-render a table, so a finished run (its ``summary.json``) is reused and a half-written one is
    replaced. A failed run raises: a table must not quietly lose a row.
    """
    if (run_dir / "summary.json").exists() and not force:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    started = time.time()
    rc = run_inproc(cfg, run_dir, run_id)
    if rc != 0:
        raise RuntimeError(f"{cfg.name}: the in-process run failed (exit code {rc}), see {run_dir}")
    print(f"  {cfg.name}: {time.time() - started:.0f}s", file=sys.stderr, flush=True)
    return True


# -- one OS process per service --------------------------------------------------------------------
class ServiceProcess:
    """One service as an OS process (``python -m services.cli ...``) with its log file; killable
    like a real crash."""

    def __init__(
        self, name: str, argv: list[str], log: Path, env: dict[str, str], *, zygote: ForkServer | None = None
    ) -> None:
        """``zygote``: fork the service from this fork server instead of starting a new interpreter
        (``services/zygote.py``); ``.p`` is a ``subprocess.Popen`` either way."""
        self.name = name
        self.log = log
        self._fh = log.open("wb")
        self.forked = zygote is not None
        if zygote is not None:
            self.p = zygote.spawn(argv, log, env, ROOT)
        else:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv],
                stdout=self._fh,
                stderr=self._fh,
                env=env,
                cwd=ROOT,
            )

    @property
    def returncode(self) -> int | None:
        return self.p.poll()

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as a crash or an OOM kill."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()

    def terminate(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._fh.close()

    def wait(self, timeout: float | None = None) -> int:
        return self.p.wait(timeout)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _fork_server_setting(env: dict[str, str]) -> bool:
    """``Settings.fork_server`` as ``env`` (the cluster's environment, not this process's) sets it."""
    from pydantic import TypeAdapter

    from shared.config import Settings

    raw = env.get("FEDFLEET_FORK_SERVER")
    default = bool(Settings.model_fields["fork_server"].default)
    return default if raw is None else TypeAdapter(bool).validate_python(raw)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports for child processes to serve on.

    Why not one free port n times: each call frees its port before the next asks, so the kernel may
    hand the same port out twice, and the second service to bind it dies at start-up. Holding all n
    sockets until every port is chosen makes them distinct.
    """
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(preferred: int) -> int:
    """``preferred`` if it is free, else any free port."""
    for port in [preferred, 0]:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            try:
                s.bind(("0.0.0.0", port))
                return int(s.getsockname()[1])
            except OSError:
                continue
    raise RuntimeError("no free port")


class ProcessCluster:
    """The services of one experiment as OS processes against one broker.

    ``url`` is the broker every process gets as ``RABBITMQ_URL``; ``logs`` receives one log file per
    process. Metrics ports: ``metrics_port(name)`` decides (default 0 = off).
    """

    def __init__(
        self,
        url: str,
        experiment_id: str,
        config: Path,
        run_dir: Path,
        *,
        logs: Path | None = None,
        state_dir: Path | None = None,
        env: dict[str, str] | None = None,
        fork_server: bool | None = None,
    ) -> None:
        self.url, self.experiment_id, self.config, self.run_dir = url, experiment_id, config, run_dir
        self.logs = logs or run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        #: hosts keep their devices' state under ``<state_dir>/<host id>``
        self.state_dir = state_dir or run_dir / "hosts"
        self.procs: list[ServiceProcess] = []
        self.ports: dict[str, int] = {}
        self.env = dict(env if env is not None else os.environ, RABBITMQ_URL=url, PYTHONPATH=str(ROOT))
        #: start the server and the client hosts from a fork server that has imported torch once, so
        #: that they share its pages (``services/zygote.py``); ``FEDFLEET_FORK_SERVER`` in ``env``
        self.fork_server = fork_server if fork_server is not None else _fork_server_setting(self.env)
        self._zygote: ForkServer | None = None

    def _zygote_for(self, argv: list[str], env: dict[str, str]) -> ForkServer | None:
        """The fork server to start ``argv`` from (started on first use), or None: a subprocess."""
        from services.zygote import ForkServer, ForkServerError, forkable

        # against the zygote's own environment once it runs (a caller may change ``self.env`` later)
        if not self.fork_server or not forkable(argv[0], env, self._zygote.env if self._zygote else self.env):
            return None
        if self._zygote is None:
            try:
                self._zygote = ForkServer(self.env, self.logs / "zygote.log")
            except (ForkServerError, OSError) as err:  # e.g. not Linux: every service a subprocess
                console.print(f"[yellow]no fork server ({err}); starting services as subprocesses[/yellow]")
                self.fork_server = False
                return None
        return self._zygote

    def close_zygote(self) -> None:
        """End the fork server (the services it started go on; nothing more can be forked)."""
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    def start(
        self, name: str, argv: list[str], metrics_port: int = 0, *, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start ``python -m services.cli <argv>`` for this experiment; ``env`` adds to the cluster's."""
        common = ["--config", str(self.config), "--experiment", self.experiment_id]
        argv = [*argv, *common, "--metrics-port", str(metrics_port)]
        full_env = {**self.env, **(env or {})}
        zygote = self._zygote_for(argv, full_env)
        proc = ServiceProcess(name, argv, self.logs / f"{name}.log", full_env, zygote=zygote)
        self.procs.append(proc)
        if metrics_port:
            self.ports[name] = metrics_port
        return proc

    def server(
        self,
        name: str = "server",
        *,
        metrics_port: int = 0,
        env: dict[str, str] | None = None,
        force: bool = False,
    ) -> ServiceProcess:
        argv = ["server", "--run-dir", str(self.run_dir), *(["--force"] if force else [])]
        return self.start(name, argv, metrics_port, env=env)

    def aggregator(self, name: str, *, metrics_port: int = 0) -> ServiceProcess:
        return self.start(name, ["aggregator", "--id", name], metrics_port=metrics_port)

    def client(
        self, name: str, devices: str | None = None, *, max_devices: int | None = None, metrics_port: int = 0
    ) -> ServiceProcess:
        """A client host; ``devices`` pins what it serves (default: what the server leases it)."""
        argv = ["client", "--id", name, "--state-dir", str(self.state_dir / name)]
        if devices is not None:
            argv += ["--devices", devices]
        if max_devices is not None:
            argv += ["--max-devices", str(max_devices)]
        return self.start(name, argv, metrics_port=metrics_port)

    def standard(
        self,
        cfg: ExperimentConfig,
        *,
        aggregators: int,
        clients: int,
        base_port: int = 0,
        force: bool = False,
    ) -> None:
        """A server, ``aggregators`` aggregators and ``clients`` clients sharing the fleet round-robin.

        ``base_port`` > 0: metrics ports from there on (skipping taken ones); 0: no metrics endpoint.
        """
        port = base_port

        def next_port() -> int:
            nonlocal port
            if not base_port:
                return 0
            chosen = free_port(port)
            port = chosen + 1
            return chosen

        self.server(metrics_port=next_port(), force=force)
        for i in range(aggregators):
            self.aggregator(f"aggregator-{i}", metrics_port=next_port())
        for i in range(min(clients, cfg.num_devices)):
            self.client(f"client-{i}", metrics_port=next_port())

    def get(self, name: str) -> ServiceProcess:
        return next(p for p in self.procs if p.name == name)

    def others(self) -> Iterator[ServiceProcess]:
        return (p for p in self.procs if p.name != "server")

    def stop_all(self) -> None:
        for p in self.procs:
            p.stop()
        self.close_zygote()

    def client_queues(self) -> list[str]:
        from shared.transport import names

        return [names(self.experiment_id).client_queue(p.name) for p in self.procs if "client" in p.name]

    def cleanup_broker(self, *, keep_dead_letters: bool = False) -> None:
        """Delete the experiment's queues and exchanges: a run leaves the broker as it found it.

        ``keep_dead_letters``: the dead-letter queue stays while it holds messages (what the user may
        want to read; ``fedfleet run`` has exported them first) and goes only when empty.
        """
        known = [*self.client_queues(), *self.aggregator_queues()]
        tidy_broker(self.url, self.experiment_id, known=known, keep_dead_letters=keep_dead_letters)

    def aggregator_queues(self) -> list[str]:
        """The aggregators' queue names as their ids alone would make them (an aggregator may add a
        session suffix; ``tidy_broker`` finds those through the management API)."""
        from shared.transport import names

        return [
            names(self.experiment_id).aggregator_queue(p.name) for p in self.procs if "aggregator" in p.name
        ]

    def wait_for_server(self, progress: RoundProgress | None = None, *, orphan_timeout_s: float = 60) -> int:
        """Wait for the server process to exit, showing progress; returns its exit code.

        A service that dies is reported once. If every other service has exited while the server
        still runs for ``orphan_timeout_s``, the server can never finish: it is stopped.
        """
        server = self.get("server")
        reported: set[str] = set()
        orphaned_since: float | None = None
        while server.alive():
            time.sleep(0.25)
            if progress is not None:
                progress.update(read_rounds(self.run_dir))
            for proc in self.others():
                if proc.returncode not in (None, 0) and proc.name not in reported:
                    reported.add(proc.name)
                    console.print(
                        f"[yellow]{proc.name} exited with {proc.returncode}; see {proc.log}[/yellow]"
                    )
            if all(not p.alive() for p in self.others()):
                orphaned_since = orphaned_since or time.time()
                if time.time() - orphaned_since > orphan_timeout_s:
                    console.print("[red]every aggregator and client has exited; stopping the server[/red]")
                    server.terminate()
        if progress is not None:
            progress.update(read_rounds(self.run_dir))
        return server.wait()

    def shutdown(self, rc: int, grace_s: float = 15) -> None:
        """After the server exited: let the others exit on its ``stop`` (or stop them when the run
        failed), killing whatever is still running after ``grace_s``."""
        deadline = time.time() + grace_s
        for proc in self.procs:
            if rc != 0:
                proc.terminate()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.time()))
            proc.stop(timeout=0.1)
        self.close_zygote()


def run_processes(
    cfg: ExperimentConfig,
    run_dir: Path,
    run_id: str,
    url: str,
    *,
    aggregators: int,
    clients: int,
    base_port: int,
    config: Path | None = None,
    force: bool = False,
) -> int:
    """``fedfleet run`` over RabbitMQ: every service its own process; returns the server's exit code.

    ``config``: the file the services read (default ``run_dir/config.yaml``); ``force``: the server
    resumes ``run_dir`` even though it holds another config (``fedfleet run --force``).
    """
    cluster = ProcessCluster(url, run_id, config or run_dir / "config.yaml", run_dir)
    cluster.standard(cfg, aggregators=aggregators, clients=clients, base_port=base_port, force=force)
    # every service of the run is started: the fork server goes, and with it the pages only it still
    # maps (those its services have since written to; the pages they share stay theirs)
    cluster.close_zygote()
    (run_dir / "ports.json").write_text(json.dumps(cluster.ports, indent=2))
    rc = 0
    try:
        with RoundProgress(cfg.rounds) as progress:
            rc = cluster.wait_for_server(progress)
    except KeyboardInterrupt:
        console.print(
            "[yellow]interrupted: stopping services (the server checkpoint allows a resume)[/yellow]"
        )
        rc = 130
    finally:
        cluster.shutdown(rc)
    if rc != 0:
        log = cluster.get("server").log
        console.print(f"[red]server exited with {rc}[/red]; last lines of {log}:")
        for line in log.read_text(errors="replace").splitlines()[-5:]:
            console.print(line, markup=False)
        return rc if rc > 0 else 1
    _record_dead_letters_and_clean(cluster)
    return 0


def _record_dead_letters_and_clean(cluster: ProcessCluster) -> None:
    """Export the dead letters into the run directory and their count and reasons into
    ``summary.json``, then tidy the broker, keeping a dead-letter queue that holds messages."""
    from shared.results import DEAD_LETTERS_FILE

    records = export_dead_letters(cluster.url, cluster.experiment_id, cluster.run_dir)
    summarise_dead_letters(cluster.run_dir, records)
    cluster.cleanup_broker(keep_dead_letters=True)
    if records:
        from shared.transport import names

        console.print(
            f"[yellow]{len(records)} messages were dead-lettered[/yellow]: "
            f"{cluster.run_dir / DEAD_LETTERS_FILE} (reasons: fedfleet report {cluster.run_dir}); the "
            f"broker keeps them in {names(cluster.experiment_id).dead_letter_queue} until you delete it"
        )


# -- the broker after a run ------------------------------------------------------------------------
def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def dead_letter_record(headers: dict[str, Any] | None, user_id: str | None, body: bytes) -> dict[str, Any]:
    """What ``dead_letters.jsonl`` says about one dead letter.

    ``reason``/``detail``: the service's (``x-fedfleet-reason``), or ``broker-<why>`` for a message
    the broker itself dead-lettered (expired, rejected, over a limit). ``sender``: the broker user
    that published the original (validated by the broker, not the message's own claim, which is in
    ``claimed_sender``); ``kind`` and ``round`` from the envelope when it can be read at all.
    """
    from shared import codec
    from shared.schemas import DecodeError, Envelope, message_parts

    headers = headers or {}
    by_service = "x-fedfleet-reason" in headers
    if by_service:
        reason = _text(headers["x-fedfleet-reason"])
    elif "x-first-death-reason" in headers:
        reason = f"broker-{_text(headers['x-first-death-reason'])}"
    else:
        reason = "unknown"
    env: Envelope | None = None
    with contextlib.suppress(DecodeError, codec.CodecError, ValueError):
        env = message_parts(body)  # the envelope of any version this build reads
    return {
        "reason": reason,
        "detail": _text(headers.get("x-fedfleet-detail")),
        "kind": env.kind.value if env else None,
        "round": env.round if env else None,
        "sender": _text(headers.get("x-fedfleet-user")) if by_service else user_id,
        "claimed_sender": (env.sender or None) if env else None,
        "routing_key": _text(headers.get("x-original-key")),
        "dead_lettered_by": user_id if by_service else "broker",
        "size": len(body),
    }


def broker_addresses(url: str) -> list[str]:
    """The AMQP URLs in ``url``: one, or several separated by ``;`` (the nodes of a cluster)."""
    return [u.strip() for u in url.split(";") if u.strip()]


def _connect(url: str) -> Any:
    """A pika connection to the first address of ``url`` that answers."""
    import pika
    import pika.exceptions

    error: Exception | None = None
    for address in broker_addresses(url):
        try:
            return pika.BlockingConnection(pika.URLParameters(address))
        except pika.exceptions.AMQPConnectionError as err:
            error = err
    raise ConnectionError(f"no broker answers at {len(broker_addresses(url))} address(es)") from error


def export_dead_letters(url: str, experiment: str, run_dir: Path) -> list[dict[str, Any]]:
    """Copy every message of the experiment's dead-letter queue into ``run_dir/dead_letters.jsonl``
    and return the records; the queue keeps the messages.

    Why read without acking: the messages are fetched unacknowledged and the connection is closed, so
    the broker puts every one back where it was. Exporting must not be what empties the queue.
    """
    import pika.exceptions

    from shared.results import write_dead_letters
    from shared.transport import names

    dlq = names(experiment).dead_letter_queue
    records: list[dict[str, Any]] = []
    conn = _connect(url)
    try:
        ch = conn.channel()
        try:
            ch.queue_declare(dlq, passive=True)
        except pika.exceptions.ChannelClosedByBroker as err:
            if err.reply_code != 404:
                raise
        else:
            while True:
                method, props, body = ch.basic_get(dlq, auto_ack=False)
                if method is None:
                    break
                records.append(dead_letter_record(props.headers, props.user_id, body))
    finally:
        conn.close()  # the unacknowledged messages go back into the queue
    write_dead_letters(run_dir, records)
    return records


def management_queues(url: str, experiment: str, timeout_s: float = 5.0) -> list[str] | None:
    """The experiment's queues as RabbitMQ's management API lists them (None: no API answered).

    Every queue an experiment declares dead-letters into the experiment's DLX, so that argument picks
    out exactly its queues (a name prefix would also match an experiment whose id extends this one's).
    The API is assumed on the broker's host, port 15672, with the AMQP URL's credentials (what
    ``make broker`` sets up).
    """
    import base64
    import json as _json
    import urllib.error
    import urllib.parse
    import urllib.request

    import pika

    from shared.transport import names

    listed: Any = None
    for address in broker_addresses(url):  # any node of a cluster lists every queue
        params = pika.URLParameters(address)
        creds = params.credentials
        auth = base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        vhost = urllib.parse.quote(params.virtual_host, safe="")
        req = urllib.request.Request(f"http://{params.host}:15672/api/queues/{vhost}?columns=name,arguments")
        req.add_header("Authorization", f"Basic {auth}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                listed = _json.loads(resp.read())
            break
        except (OSError, ValueError):
            continue
    if not isinstance(listed, list):
        return None
    dlx = names(experiment).dead_letter_exchange
    return [
        str(q["name"])
        for q in listed
        if isinstance(q, dict) and (q.get("arguments") or {}).get("x-dead-letter-exchange") == dlx
    ]


def tidy_broker(
    url: str, experiment: str, *, known: Sequence[str] = (), keep_dead_letters: bool = False
) -> None:
    """Delete the experiment's queues and exchanges.

    Which queues: the server's and the updates queue, ``known`` (client and aggregator queues whose
    names the caller knows), and whatever else the management API lists for the experiment — a
    killed aggregator's session queue, whose name nobody else knows, would otherwise stay until its
    ``x-expires``. The dead-letter queue goes too, unless ``keep_dead_letters`` and it holds messages.
    """
    import pika.exceptions

    from shared.transport import names

    n = names(experiment)
    listed = management_queues(url, experiment) or []
    queues = dict.fromkeys([n.server_queue, n.updates_queue, *known, *listed])
    # (what, name): a delete the broker refuses closes the channel, so each one that fails gets a
    # fresh channel (and a fresh connection if the broker closed that too)
    deletes: list[tuple[str, str]] = [("queue", q) for q in queues]
    deletes += [("exchange", n.exchange), ("exchange", n.dead_letter_exchange)]
    conn = _connect(url)
    try:
        ch = conn.channel()
        if not (keep_dead_letters and _holds_messages(ch, n.dead_letter_queue)):
            # not ``if_empty``: quorum queues refuse that flag (540 NOT_IMPLEMENTED, which closes the
            # whole connection); the run is over, so nothing can dead-letter between count and delete
            deletes.append(("queue", n.dead_letter_queue))
        for what, name in deletes:
            try:
                if not conn.is_open:
                    conn = _connect(url)
                if not ch.is_open:
                    ch = conn.channel()
                if what == "queue":
                    ch.queue_delete(name)
                else:
                    ch.exchange_delete(name)
            except (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ConnectionClosedByBroker):
                pass
    finally:
        if conn.is_open:
            conn.close()


def _holds_messages(ch: Any, queue: str) -> bool:
    """Whether ``queue`` exists and holds messages (a passive declare; a missing queue closes the
    channel, so the caller's channel is replaced after a ``False`` from that path)."""
    import pika.exceptions

    try:
        return int(ch.queue_declare(queue, passive=True).method.message_count) > 0
    except pika.exceptions.ChannelClosedByBroker:
        return False
