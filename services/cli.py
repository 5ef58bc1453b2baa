"""``fedfleet``: the command line behind ``make run`` and the Kubernetes pods.

``fedfleet run CONFIG`` is the researcher's front door: it starts the server, the aggregators and the
client processes against RabbitMQ as separate OS processes, shows a progress bar over rounds, prints
a results table and leaves ``runs/<run-id>/``. The per-service commands (``server``, ``aggregator``,
``client``) are what those processes — and the Kubernetes pods — execute.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rich.console import Console

from services import orchestrator
from services.report import ACCURACY_CHOICES, print_report
from shared.config import (
    ConfigError,
    ExperimentConfig,
    RunMismatch,
    Settings,
    claim_run_dir,
    dump_config,
    explain,
    load_config,
)
from shared.results import read_summary, write_summary

if TYPE_CHECKING:  # torch stays out of the CLI's start-up path
    from shared.algorithms.base import Strategy
    from shared.experiment import Experiment

console = Console(stderr=True)
DEFAULT_PORTS = {"server": 9100, "aggregator": 9101, "client": 9102}


# -- helpers ---------------------------------------------------------------------------------------
def _load(path: str) -> ExperimentConfig:
    try:
        return load_config(path)
    except ConfigError as err:
        console.print(f"[red]config error[/red]\n{err}")
        raise SystemExit(2) from None


def _experiment_id(args: argparse.Namespace, cfg: ExperimentConfig, settings: Settings) -> str:
    return args.experiment or settings.experiment or cfg.name


def _metrics_port(args: argparse.Namespace, settings: Settings, service: str) -> int:
    if args.metrics_port is not None:
        return int(args.metrics_port)
    if settings.metrics_port is not None:
        return settings.metrics_port
    return DEFAULT_PORTS[service]


def _settings() -> Settings:
    """The process's settings; they also name its deployment's broker users (``user_prefix``)."""
    from shared import identity

    try:
        settings = Settings()
    except ValidationError as err:  # e.g. FEDFLEET_LINGER_S=inf: one clear message, no traceback
        console.print(f"[red]settings error[/red]\n{explain(err, 'environment', Settings)}")
        raise SystemExit(2) from None
    identity.configure(settings.user_prefix)
    return settings


def _transport(url: str, experiment: str) -> Any:
    """A RabbitMQ connection. Logged in as a role user other than the server's, it only checks that
    the experiment's exchanges exist (the server creates them; least privilege)."""
    from shared.identity import Role, identify, strict
    from shared.transport.amqp import AmqpTransport

    user = AmqpTransport.url_user(url)
    owner = not strict(user) or identify(user).role is Role.SERVER
    return AmqpTransport(url, experiment, declare_topology=owner)


_TERMINATED = threading.Event()


def _linger(settings: Settings) -> None:
    """After the work: wait until Prometheus has scraped the final counts, at most ``linger_s``.

    A scrape that began after this point read every counter as it ends, so the service may go as
    soon as one happened. A SIGTERM/SIGINT ends the wait at once (``_TERMINATED``), so lingering never
    delays a shutdown.
    """
    from shared import metrics

    if settings.linger_s > 0:
        metrics.wait_for_scrape(time.time(), settings.linger_s, stop=_TERMINATED)


def _install_signal_handlers(service: Any) -> None:
    """SIGTERM/SIGINT: the service's own ``terminate`` (a client host first hands its devices back)."""

    def stop(signum: int, frame: Any) -> None:
        service.terminate()
        _TERMINATED.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _parse_devices(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        elif part.strip():
            out.append(int(part))
    return out


def _host_id(given: str | None) -> str:
    """``--id``, else the pod's (or machine's) name plus a random suffix: a restarted container in
    the same pod is a new host (its old leases may already have gone to others)."""
    if given:
        return given
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", os.environ.get("HOSTNAME") or socket.gethostname())
    return f"{name.strip('-') or 'host'}-{uuid.uuid4().hex[:6]}"


def _claim(run_dir: Path, cfg: ExperimentConfig, force: bool) -> Path | None:
    """The config file of ``run_dir`` for this run (None: another experiment's run, said why)."""
    try:
        extra = claim_run_dir(run_dir, cfg, force=force)
    except RunMismatch as err:
        console.print(f"[red]cannot resume:[/red] {err}")
        return None
    if extra is not None:
        console.print(f"[yellow]--force: resuming {run_dir} with the config in {extra}[/yellow]")
    return extra or run_dir / "config.yaml"


# -- service commands ------------------------------------------------------------------------------
def cmd_server(args: argparse.Namespace) -> int:
    from services.common import setup_logging
    from services.server.service import Server
    from shared import metrics

    settings = _settings()
    setup_logging(settings.log_level)
    cfg = _load(args.config)
    exp_id = _experiment_id(args, cfg, settings)
    run_dir = Path(args.run_dir)
    if _claim(run_dir, cfg, args.force) is None:
        return 2
    exp = _experiment(cfg, args.config)
    metrics.serve(_metrics_port(args, settings, "server"))
    transport = _transport(settings.rabbitmq_url, exp_id)
    server = Server(transport, exp, run_dir, experiment_id=exp_id, admin=_broker_admin(settings))
    _install_signal_handlers(server)
    server.run()
    transport.close()
    _linger(settings)
    server.release_host_users()
    if server.error:
        print(server.error, file=sys.stderr)
        return 1
    return 0 if server.phase == "done" else 3


def cmd_aggregator(args: argparse.Namespace) -> int:
    from services.aggregator.service import Aggregator, registered_samples
    from services.common import setup_logging
    from shared import metrics

    settings = _settings()
    setup_logging(settings.log_level)
    cfg = _load(args.config)
    exp_id = _experiment_id(args, cfg, settings)
    exp, strategy = _aggregation(cfg, args.config)
    metrics.serve(_metrics_port(args, settings, "aggregator"))
    transport = _transport(settings.rabbitmq_url, exp_id)
    agg = Aggregator(
        transport,
        strategy,
        experiment_id=exp_id,
        algorithm=cfg.algorithm.name,
        # the pod's name on Kubernetes: its queue is named after it, so two aggregators must never
        # share one (HOSTNAME is what a pod, or a harness emulating pods on one machine, sets)
        aggregator_id=args.id or os.environ.get("HOSTNAME") or socket.gethostname(),
        prefetch=cfg.processes.prefetch,
        max_bytes=cfg.processes.max_message_bytes,
        bounds=cfg.bounds,
        sample_limits=registered_samples(exp),
    )
    _install_signal_handlers(agg)
    agg.run()
    transport.close()
    _linger(settings)
    return 0


#: a SIGTERM/SIGINT reached a client host before its own handlers were installed
_TERMINATED_EARLY = threading.Event()


#: the host is waiting for the server's answer to its join request or for its connection
#: (``_joining``): the phase of its start where a SIGTERM may raise, because it may last minutes
_INTERRUPTIBLE = False


def _leave_before_joining(signum: int, frame: Any) -> None:
    """SIGTERM before the host has joined (a pod scaled away while it starts): nothing to hand over.

    The request is recorded (``_TERMINATED_EARLY``) and honoured at the next step of the start
    (``cmd_client`` looks after each one, ``_honour_early_term`` once the host has joined). It
    raises ``SystemExit`` only while the host waits for its join answer and its connection
    (``_INTERRUPTIBLE``), or at a second signal.
    Why not always: an exception raised by a signal handler lands wherever the main thread is.
    Inside a callback Python runs for itself (an import's module-lock callback) it is lost ("Exception
    ignored": seen in CI, the pod then joined, served and idled, and never exited). Inside a class
    body's ``__set_name__`` (an import of scikit-learn) it becomes a ``RuntimeError``: exit 1 after
    SIGTERM, a failure to Kubernetes (seen in CI at 971e80d).
    """
    again = _TERMINATED_EARLY.is_set()
    _TERMINATED_EARLY.set()
    if _INTERRUPTIBLE or again:  # a second signal: whoever sent it will not wait for the next step
        raise SystemExit(0)


@contextlib.contextmanager
def _joining() -> Iterator[None]:
    """The waits for the join answer and the broker connection (each up to a minute or two),
    during which a SIGTERM ends the host at once (exit 0)."""
    global _INTERRUPTIBLE
    _INTERRUPTIBLE = True  # first: a signal from now on raises, one before it was recorded
    try:
        if _TERMINATED_EARLY.is_set():
            raise SystemExit(0)
        yield
    finally:
        _INTERRUPTIBLE = False


def _honour_early_term(client: Any) -> None:
    """A SIGTERM that came before the client's own handlers, and was lost: leave now, as that
    SIGTERM would have made it (the client has joined: it hands its devices back)."""
    if _TERMINATED_EARLY.is_set():
        client.terminate()
        _TERMINATED.set()


def cmd_client(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _leave_before_joining)
    signal.signal(signal.SIGINT, _leave_before_joining)
    # imported before the join's wait, whose SIGTERM raises: an import is no place for that
    import encodings.idna  # noqa: F401

    from services.client.capacity import host_budget, memory_limit
    from services.client.service import Client, per_device_bytes
    from services.common import setup_logging
    from shared import metrics, provision  # noqa: F401
    from shared.transport import amqp  # noqa: F401

    settings = _settings()
    setup_logging(settings.log_level)
    cfg = _load(args.config)
    exp_id = _experiment_id(args, cfg, settings)
    pinned = _parse_devices(args.devices) if args.devices else None
    if args.max_devices is not None and args.max_devices < 1:
        raise SystemExit("--max-devices must be at least 1")
    metrics.serve(_metrics_port(args, settings, "client"))
    if _TERMINATED_EARLY.is_set():  # asked to stop while starting; not joined yet: nothing to hand back
        return 0
    exp = _experiment(cfg, args.config)
    capacity, memory = host_budget(
        memory_limit(), per_device_bytes(exp), exp.full_footprint_bytes, args.max_devices
    )
    if _TERMINATED_EARLY.is_set():
        return 0
    with _joining():  # the join answer, then the connection (it may wait for the server's queues)
        url, client_id = _host_login(settings.rabbitmq_url, exp_id, args.id)
        transport = _transport(url, exp_id)
    state_dir = Path(args.state_dir or Path("runs") / exp_id / "hosts" / client_id)
    client = Client(
        transport,
        exp,
        experiment_id=exp_id,
        client_id=client_id,
        state_dir=state_dir,
        pinned=pinned,
        max_devices=capacity,
        memory_bytes=memory,
        on_stop=settings.on_stop,
        bundle=settings.bundle,
    )
    _install_signal_handlers(client)
    _honour_early_term(client)
    client.run()
    transport.close()
    _linger(settings)
    return 0


def _broker_admin(settings: Settings) -> Any:
    """The management API the server makes host users with (None: hosts bring their own users)."""
    if not settings.broker_admin_url:
        return None
    import pika

    from shared.provision import BrokerAdmin, ProvisionError
    from shared.transport.urls import split_urls

    vhost = pika.URLParameters(split_urls(settings.rabbitmq_url)[0]).virtual_host
    try:
        return BrokerAdmin(settings.broker_admin_url, vhost=vhost)
    except ProvisionError as err:
        console.print(f"[red]FEDFLEET_BROKER_ADMIN_URL[/red]: {err}")
        raise SystemExit(2) from None


def _host_login(url: str, experiment: str, given_id: str | None) -> tuple[str, str]:
    """(broker URL, host id) of a client host. Started with the join user, it first asks the server
    for a broker user of its own (``shared.provision``); otherwise it uses ``url`` as it is."""
    from shared.identity import Role, identify
    from shared.provision import ProvisionError, join, with_user
    from shared.transport.amqp import AmqpTransport

    if identify(AmqpTransport.url_user(url)).role is not Role.JOIN:
        return url, _host_id(given_id)
    from shared.transport.amqp import broker_reachable
    from shared.transport.urls import SEPARATOR, split_urls

    urls = split_urls(url)
    first = next((u for u in urls if broker_reachable(u)), urls[0])  # join through a live node
    try:
        reply = join(first, experiment, hint=_host_id(given_id))
    except ProvisionError as err:
        console.print(f"[red]cannot join experiment {experiment}[/red]: {err}")
        raise SystemExit(2) from None
    return SEPARATOR.join(with_user(u, reply.user, reply.password) for u in urls), reply.host_id


def cmd_healthcheck(args: argparse.Namespace) -> int:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/metrics", timeout=3) as resp:
            return 0 if resp.status == 200 else 1
    except OSError:
        return 1


# -- run: the whole experiment on this machine -----------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if args.rounds:
        cfg = cfg.model_copy(update={"rounds": args.rounds})
    settings = _settings()
    run_id = args.run_id or f"{cfg.name}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.runs_dir) / run_id
    if (run_dir / "summary.json").exists():
        console.print(f"[red]{run_dir} already holds a finished run[/red]; choose another --run-id")
        return 2
    transport = _choose_transport(args.transport, settings)
    if transport is None:
        return 2
    # Build the experiment once before any process starts, so that a bad fleet, dataset or algorithm
    # option is refused with the error that names the file, row and field. For a run as processes
    # the build happens in a child process: this parent only launches and watches the services, and
    # should not hold torch, the model and the dataset for the whole run (issue 16: lean processes).
    why = _cannot_run(cfg) if transport == "inproc" else _cannot_run_in_child(cfg)
    if why is not None:
        console.print(f"[red]cannot run {args.config}[/red]\n{why}")
        return 2
    if (config_path := _claim(run_dir, cfg, args.force)) is None:
        return 2
    console.print(f"run [bold]{run_id}[/bold] · {cfg.algorithm.name} · {transport} · results in {run_dir}")
    started = time.time()
    if transport == "inproc":
        rc = orchestrator.run_inproc(cfg, run_dir, run_id, bundle=settings.bundle)
    else:
        rc = orchestrator.run_processes(
            cfg,
            run_dir,
            run_id,
            settings.rabbitmq_url,
            aggregators=args.aggregators or cfg.processes.aggregators,
            clients=args.clients or cfg.processes.clients,
            base_port=args.metrics_base_port,
            config=config_path,
            force=args.force,
        )
    if rc == 0:
        summary = read_summary(run_dir)
        summary["wall_seconds_total"] = time.time() - started
        write_summary(run_dir, summary)
        print_report(run_dir)
    return rc


def _broker_hosts(url: str) -> str:
    """The ``host:port`` of each broker address in ``url`` (``;``-separated), never its password."""
    from urllib.parse import urlsplit

    hosts = []
    for one in filter(None, (u.strip() for u in url.split(";"))):
        parts = urlsplit(one)
        hosts.append(f"{parts.hostname or '?'}:{parts.port or 5672}")
    return ", ".join(hosts) or "(empty RABBITMQ_URL)"


def _choose_transport(requested: str, settings: Settings) -> str | None:
    """The transport ``fedfleet run`` uses (None: refused, and said why).

    Why an explicit ``RABBITMQ_URL`` never falls back: a user who names a broker wants the run on it
    (its Prometheus, its queues, a deployment's timings). Falling back to the in-process transport
    when it did not answer gave a result that looked fine but was not the measurement asked for, and
    hid the broker's address typo. Only the implicit default (no ``RABBITMQ_URL``, local broker
    absent) falls back, loudly. Messages name the host and port, never the credentials.
    """
    if requested == "inproc":
        return "inproc"
    from shared.transport.amqp import broker_reachable

    url = settings.rabbitmq_url
    if broker_reachable(url):
        return "amqp"
    if requested == "amqp" or "rabbitmq_url" in settings.model_fields_set:
        why = "RABBITMQ_URL is set" if "rabbitmq_url" in settings.model_fields_set else "--transport amqp"
        console.print(
            f"[red]RabbitMQ does not answer at {_broker_hosts(url)}[/red] ({why}): start the broker or "
            "fix RABBITMQ_URL; to run without a broker, unset RABBITMQ_URL or pass --transport inproc"
        )
        return None
    console.print(
        "[bold yellow]WARNING: no RabbitMQ broker reachable at "
        f"{_broker_hosts(url)} (RABBITMQ_URL unset) — running IN-PROCESS (one process, no broker). "
        "Results are the same; timings and traffic are not those of a deployment.[/bold yellow]"
    )
    return "inproc"


def _build(cfg: ExperimentConfig) -> Experiment | str:
    """The experiment with its strategy, fleet and partitions made, or why this machine cannot make
    it (a missing dataset file, a bad fleet row, a partition that cannot be made).

    ``run`` and ``validate`` share it so that a config ``validate`` calls ok does not then fail at
    ``run``; the services use it so that a bad config is one clear line, not a traceback.
    """
    from shared.data import DatasetUnavailable
    from shared.devices import FleetError
    from shared.experiment import Experiment

    try:
        exp = Experiment.build(cfg)
        _ = exp.strategy, exp.fleet, exp.partitions
    except (FleetError, DatasetUnavailable, ValueError) as err:
        return str(err)
    return exp


def _cannot_run_in_child(cfg: ExperimentConfig) -> str | None:
    """``_cannot_run`` in a child process (``fedfleet validate`` of ``cfg`` as resolved here)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fedfleet-check-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(dump_config(cfg))
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", "validate", str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
    if out.returncode == 0:
        return None
    text = (
        (out.stdout + out.stderr)
        .strip()
        .replace(f"{path}: cannot run here: ", "")
        .replace(str(path), "config")
    )
    return text or f"the check exited with {out.returncode}"


def _cannot_run(cfg: ExperimentConfig) -> str | None:
    """Why this machine cannot run ``cfg`` (None: it can)."""
    built = _build(cfg)
    if isinstance(built, str):
        return built
    return _too_small_for_messages(built)


def message_sizes(exp: Experiment) -> dict[str, int]:
    """The largest messages the experiment's first round sends, in bytes, by what they are.

    ``task``: the largest task or shared payload of round 1, encoded exactly as the server encodes
    them (``services.server.fanout``) for every device of the fleet. ``partial``: an aggregator's
    partial reduction of one update shaped like that task (the reduction keeps float64 sums, so it
    is often the biggest message); left out for an algorithm whose update cannot have a task's shape.
    Why round 1: later rounds of the shipped algorithms send the same shapes (sparse ones fewer bytes).
    """
    from services.common import encode_tensors
    from services.server import fanout
    from services.server.service import Server
    from shared import schemas
    from shared.algorithms.base import Partial, UpdateSpec

    registry = Server._device_infos(exp)
    devices = sorted(registry)
    strategy = exp.strategy
    specs = strategy.plan(strategy.init_state(), 1, devices, registry)
    exp_id, key = exp.cfg.name, "0" * 32

    def encode(kind: schemas.Kind, body: Any) -> bytes:
        return schemas.encode(kind, body, exp=exp_id, round=1, sender="server", inc="0" * 12, key=key)

    planned = [d for d in devices if d in specs]
    out = fanout.build(
        schemas.Kind.TASK,
        specs,
        planned,
        host_of=lambda d: "host",
        route=lambda h: f"host.{h}",
        task_key=lambda d: key,
        encode=encode,
    )
    sizes = {"task": max([len(t.data) for t in out.tasks] + [len(d) for _, _, d in out.payloads] + [0])}
    biggest = max((specs[d] for d in planned), key=lambda s: _codec_bytes(s.tensors), default=None)
    if biggest is not None and biggest.tensors:
        try:
            partial = strategy.reduce(Partial(), UpdateSpec(dict(biggest.tensors), num_samples=1))
        except Exception:  # an update of another shape than the task (thresholds, masks): no estimate
            return sizes
        tensors, scalars = partial.to_wire()
        body = schemas.Partial(
            aggregator_id="aggregator-0-00000000",
            seq=0,
            devices=list(range(math.ceil(exp.cfg.devices_per_round * exp.cfg.emulation.over_selection))),
            tensors=encode_tensors(tensors)[0],
            scalars=scalars,
        )
        sizes["partial"] = len(encode(schemas.Kind.PARTIAL, body))
    return sizes


def _codec_bytes(tensors: dict[str, Any]) -> int:
    """Dense-equivalent bytes of named tensors (to pick the largest task)."""
    from shared import codec

    return sum(codec.dense_bytes(t) for t in tensors.values())


def _too_small_for_messages(exp: Experiment) -> str | None:
    """Why ``processes.max_message_bytes`` cannot carry the experiment's messages (None: it can).

    Why check before running: every service dead-letters a message over the limit unread, so a limit
    below the model's size let the run start and then fail as "only 0 of 20 devices registered",
    nowhere near the cause. Validation says how big the messages are instead.
    """
    limit = exp.cfg.processes.max_message_bytes
    try:
        sizes = message_sizes(exp)
    except Exception as err:  # sizing is a check on top: a failure in it must not hide the config
        why = f"{type(err).__name__}: {err}"
        console.print(f"[yellow]could not size this experiment's messages ({why})[/yellow]")
        return None
    if max(sizes.values()) <= limit:
        return None
    what = {"task": "a round-1 task or shared payload", "partial": "an aggregator's partial"}
    listed = " and ".join(f"{what[k]} {v:,} bytes" for k, v in sizes.items())
    return (
        f"processes.max_message_bytes ({limit:,}) is smaller than the messages this experiment sends: "
        f"{listed}; set it to at least {max(sizes.values()):,} or leave it out (default 256 MiB)"
    )


def _experiment(cfg: ExperimentConfig, source: str) -> Experiment:
    """``_build`` for a service: exit 2 with the reason when the experiment cannot be made."""
    built = _build(cfg)
    if isinstance(built, str):
        console.print(f"[red]cannot run {source}[/red]: {built}")
        raise SystemExit(2)
    return built


def _aggregation(cfg: ExperimentConfig, source: str) -> tuple[Experiment, Strategy]:
    """The experiment and strategy of an aggregator: ``Experiment.aggregation_strategy``, with no
    model and no torch when the algorithm allows it (issue 16). Exit 2 with the reason when the
    experiment cannot be made (a missing dataset, a bad partition, an unknown algorithm)."""
    from shared.data import DatasetUnavailable
    from shared.experiment import Experiment

    try:
        exp = Experiment.build(cfg)
        strategy = exp.aggregation_strategy
        _ = exp.partitions
    except (DatasetUnavailable, ValueError, RuntimeError) as err:
        console.print(f"[red]cannot run {source}[/red]: {err}")
        raise SystemExit(2) from None
    return exp, strategy


def cmd_report(args: argparse.Namespace) -> int:
    from services.report import report

    return report(args.run)


def cmd_compare(args: argparse.Namespace) -> int:
    from services.report import compare

    return compare(args.runs, args.plot, args.accuracy)


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    from shared import algorithms

    try:
        options = algorithms.parse_options(cfg.algorithm.name, cfg.algorithm.options)
        algorithms.check_train(cfg.algorithm.name, cfg.train)
        algorithms.check_robust(cfg.algorithm.name, cfg.robust)
    except ValueError as err:
        console.print(f"[red]{args.config}[/red]: {err}")
        return 2
    if not args.syntax_only and (why := _cannot_run(cfg)) is not None:
        console.print(f"[red]{args.config}[/red]: cannot run here: {why}")
        return 2
    if args.resolved:
        # every key with its value or default, the algorithm's options included: what a run will use
        algo = cfg.algorithm.model_copy(update={"options": options.model_dump(mode="json")})
        print(dump_config(cfg.model_copy(update={"algorithm": algo})), end="")
        return 0
    console.print(f"{args.config}: ok")
    return 0


def _write_or_print(text: str, out: Path | None) -> int:
    """A generated document to ``out`` (and say so), or to stdout."""
    if out:
        out.write_text(text)
        console.print(f"wrote {out}")
    else:
        print(text, end="")
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from shared.config.reference import config_reference

    return _write_or_print(config_reference(), args.out)


def cmd_asyncapi(args: argparse.Namespace) -> int:
    from shared.asyncapi import render

    return _write_or_print(render(), args.out)


def cmd_tap(args: argparse.Namespace) -> int:
    from services import tap

    url = os.environ.get("RABBITMQ_URL", "")
    if not url:
        console.print(
            "[red]fedfleet tap needs RABBITMQ_URL (a broker user with shared.provision.tap_permissions)[/red]"
        )
        return 2
    return tap.run(
        url.split(";")[0].strip(),
        args.experiment,
        kinds=args.kind or (),
        devices=args.device or (),
        as_json=args.json,
        seconds=args.seconds,
        count=args.count,
        admin_url=args.admin_url or tap.admin_url_from_env(),
        until_stop=args.until_stop,
    )


# -- reproduce: a paper's result tables, rewritten from runs ---------------------------------------
def cmd_reproduce(args: argparse.Namespace) -> int:
    """Delegates to :mod:`services.reproduce` (the registry of docs blocks and their scripts)."""
    from services import reproduce

    try:
        written = reproduce.reproduce(
            args.alg,
            seeds=tuple(args.seeds) if args.seeds else None,
            only=tuple(args.only or ()),
            rounds=args.rounds,
            allow_dirty=args.allow_dirty,
        )
    except (ValueError, RuntimeError) as err:
        console.print(f"[red]{err}[/red]")
        return 2
    console.print(f"rewrote {', '.join(written)}")
    return 0


def cmd_verdicts(args: argparse.Namespace) -> int:
    """Print (``--write``: also put in ``docs/algorithms/README.md``) how many spec §8 checks hold."""
    from services import reproduce

    text = reproduce.verdict_tally()
    if args.write:
        reproduce.replace_block(reproduce.TALLY_DOC, reproduce.TALLY_MARKER, text)
    print(text)
    return 0


# -- argument parsing ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedfleet", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment: server, aggregators and clients as processes")
    run.add_argument("config")
    run.add_argument("--transport", choices=["auto", "amqp", "inproc"], default="auto")
    run.add_argument("--runs-dir", default="runs")
    run.add_argument("--run-id")
    run.add_argument("--rounds", type=int, help="override the config's number of rounds")
    run.add_argument(
        "--aggregators", type=int, help="aggregator processes (default: config processes.aggregators)"
    )
    run.add_argument("--clients", type=int, help="client processes (default: config processes.clients)")
    run.add_argument("--metrics-base-port", type=int, default=9100)
    run.add_argument(
        "--force", action="store_true", help="resume --run-id even if its config differs from this one"
    )
    run.set_defaults(fn=cmd_run)

    def service(name: str, fn: Any) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=f"run one {name} process")
        sp.add_argument("--config", required=True)
        sp.add_argument(
            "--experiment", help="experiment id on the broker (default: env FEDFLEET_EXPERIMENT, then name)"
        )
        sp.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = off)")
        sp.set_defaults(fn=fn)
        return sp

    srv = service("server", cmd_server)
    srv.add_argument(
        "--run-dir", required=True, help="results and checkpoints; resumes if it holds a checkpoint"
    )
    srv.add_argument(
        "--force", action="store_true", help="resume a run directory even if its config differs from this one"
    )
    agg = service("aggregator", cmd_aggregator)
    agg.add_argument("--id")
    cli = service("client", cmd_client)
    cli.add_argument("--id")
    cli.add_argument(
        "--devices",
        help="serve exactly these devices, e.g. '0-9' or '0,2,4' (default: whatever the server leases)",
    )
    cli.add_argument(
        "--max-devices", type=int, help="most devices to host (default: what the memory limit allows)"
    )
    cli.add_argument("--state-dir", help="the devices' private state (default: runs/<experiment>/hosts/<id>)")

    rep = sub.add_parser("report", help="print a finished run's results")
    rep.add_argument("run")
    rep.set_defaults(fn=cmd_report)
    cmp_ = sub.add_parser("compare", help="tabulate several runs side by side")
    cmp_.add_argument("runs", nargs="+")
    cmp_.add_argument("--plot", metavar="PNG", help="also draw accuracy vs round and vs wire bytes, all runs")
    cmp_.add_argument(
        "--accuracy",
        choices=ACCURACY_CHOICES,
        default="auto",
        help="what --plot draws: the global model's accuracy, the devices' own models' (personalised "
        "algorithms), or both, labelled (default auto: the one kind the runs have; runs of both "
        "kinds need a choice)",
    )
    cmp_.set_defaults(fn=cmd_compare)
    hc = sub.add_parser("healthcheck", help="exit 0 iff the local /metrics endpoint answers")
    hc.add_argument("--port", type=int, required=True)
    hc.set_defaults(fn=cmd_healthcheck)
    val = sub.add_parser("validate", help="check an experiment config")
    val.add_argument("config")
    val.add_argument(
        "--resolved",
        action="store_true",
        help="print the config as YAML with every default filled in (algorithm options included)",
    )
    val.add_argument(
        "--syntax-only",
        action="store_true",
        help="check keys and values only; do not load the dataset and fleet (for a config meant for "
        "another machine, e.g. a pod whose paths do not exist here)",
    )
    val.set_defaults(fn=cmd_validate)

    rp = sub.add_parser("reproduce", help="rerun a paper's reproduction and rewrite its docs tables")
    rp.add_argument("alg", help="a paper (feddse, hermes, spafl, fedmef, embracingfl) or a baseline")
    rp.add_argument("--seeds", type=int, nargs="+", help="default: the reproduction's (0 1 2)")
    rp.add_argument("--only", nargs="+", metavar="MARKER", help="only these docs blocks")
    rp.add_argument("--rounds", type=int, help="shorter runs (smoke); the caption says so")
    rp.add_argument("--allow-dirty", action="store_true", help="run from an uncommitted tree")
    rp.set_defaults(fn=cmd_reproduce)

    ver = sub.add_parser("verdicts", help="count the spec checks that hold, from the algorithm pages")
    ver.add_argument("--write", action="store_true", help="also write it into docs/algorithms/README.md")
    ver.set_defaults(fn=cmd_verdicts)

    ref = sub.add_parser("reference", help="print every config key and algorithm option (Markdown)")
    ref.add_argument("--out", type=Path, help="write to this file instead (docs/configuration.md)")
    ref.set_defaults(fn=cmd_reference)

    tp = sub.add_parser(
        "tap", help="print an experiment's messages as they go by (RabbitMQ's tracer; takes nothing away)"
    )
    tp.add_argument("experiment", help="the experiment id (the run's id)")
    tp.add_argument("--kind", action="append", help="only this message kind (repeatable)")
    tp.add_argument(
        "--device", type=int, action="append", help="only messages about this device (repeatable)"
    )
    tp.add_argument("--json", action="store_true", help="one JSON object per line")
    tp.add_argument("--seconds", type=float, help="stop after this long")
    tp.add_argument("--count", type=int, help="stop after printing this many lines")
    tp.add_argument("--until-stop", action="store_true", help="stop when the server ends the run")
    tp.add_argument(
        "--admin-url",
        help="management API URL to switch the vhost's tracer on (default: FEDFLEET_BROKER_ADMIN_URL)",
    )
    tp.set_defaults(fn=cmd_tap)

    aa = sub.add_parser("asyncapi", help="print the message plane as an AsyncAPI 3 document (YAML)")
    aa.add_argument("--out", type=Path, help="write to this file instead (docs/asyncapi.yaml)")
    aa.set_defaults(fn=cmd_asyncapi)
    return p


def main(argv: list[str] | None = None) -> int:
    from services.server.errors import CheckpointError
    from shared.metrics import MetricsPortInUse
    from shared.transport import BrokerUnavailable

    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except MetricsPortInUse as err:  # a deployment mistake, not a bug: one line, no traceback
        console.print(f"[red]{err}[/red]")
        return 2
    except CheckpointError as err:  # a run directory whose checkpoints are all unusable
        console.print(f"[red]cannot resume:[/red] {err}")
        return 2
    except BrokerUnavailable as err:  # the broker is gone past the reconnect budget: one line
        print(f"fedfleet {args.command}: {err}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
