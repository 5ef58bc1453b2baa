"""Shared fixtures: a real RabbitMQ broker, experiment configs, and service processes.

Broker resolution, as the project promises: ``RABBITMQ_URL`` if set, else the local broker on
127.0.0.1:5672, else a private ``rabbitmq-server`` started for the session (or a testcontainers one
where a Docker engine answers). Under CI (``CI`` set) a broker test is never skipped: no broker is a
failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.orchestrator import ProcessCluster
from shared.transport.amqp import broker_reachable

ROOT = Path(__file__).resolve().parents[1]
LOCAL_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def _private_broker(tmp: Path) -> tuple[str, Any]:
    """Start a throw-away rabbitmq-server node on a spare port; returns (url, stop callback)."""
    server = shutil.which("rabbitmq-server") or "/usr/sbin/rabbitmq-server"
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    if not Path(server).exists():
        raise RuntimeError("rabbitmq-server is not installed")
    port = 5699
    node = f"fedfleet-test-{os.getpid()}@localhost"
    env = dict(
        os.environ,
        RABBITMQ_NODENAME=node,
        RABBITMQ_NODE_PORT=str(port),
        RABBITMQ_DIST_PORT=str(port + 20000),
        RABBITMQ_MNESIA_BASE=str(tmp / "mnesia"),
        RABBITMQ_LOG_BASE=str(tmp / "log"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(tmp / "enabled_plugins"),
    )
    (tmp / "enabled_plugins").write_text("[].\n")
    subprocess.run([server, "-detached"], env=env, check=True, capture_output=True)
    url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    for _ in range(60):
        if broker_reachable(url):
            break
        time.sleep(1)
    else:
        raise RuntimeError("private rabbitmq-server did not start in 60 s")

    def stop() -> None:
        subprocess.run([ctl, "-n", node, "stop"], env=env, capture_output=True)

    return url, stop


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    explicit = os.environ.get("RABBITMQ_URL")
    if explicit:
        if not broker_reachable(explicit):
            pytest.fail(f"RABBITMQ_URL={explicit} does not answer")
        yield explicit
        return
    if broker_reachable(LOCAL_URL):
        yield LOCAL_URL
        return
    try:
        url, stop = _private_broker(tmp_path_factory.mktemp("rabbit"))
    except Exception as err:  # no broker binary, or it would not start
        try:
            from testcontainers.rabbitmq import RabbitMqContainer

            container = RabbitMqContainer("rabbitmq:3.13")
            container.start()
            host, port = container.get_container_host_ip(), container.get_exposed_port(5672)
            yield f"amqp://guest:guest@{host}:{port}/%2F"
            container.stop()
            return
        except Exception:
            pass
        msg = f"no RabbitMQ broker: none at {LOCAL_URL} and a private one failed ({err})"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    yield url
    stop()


@pytest.fixture
def experiment_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def write_config(path: Path, **overrides: Any) -> Path:
    """A small, fast FedAvg-on-digits config with ``overrides`` merged in (nested dicts merge)."""
    base: dict[str, Any] = {
        "name": "test",
        "seed": 1,
        "rounds": 3,
        "num_devices": 8,
        "devices_per_round": 4,
        "round_timeout_s": 30,
        "quorum_fraction": 0.5,
        "registration_timeout_s": 60,
        "dataset": {"name": "digits", "partition": "iid", "train_limit": 800},
        "model": {"name": "mlp", "options": {"hidden": [32]}},
        "algorithm": {"name": "fedavg"},
        "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.3},
        "processes": {"aggregators": 2, "clients": 2, "prefetch": 8},
        "hosts": {"join_quiet_s": 0.2},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def process_cluster(url: str, exp: str, config: Path, workdir: Path) -> ProcessCluster:
    """The services of one experiment as processes: results in ``workdir/run``, a log per process
    in ``workdir``, device state in ``workdir/state``."""
    return ProcessCluster(url, exp, config, workdir / "run", logs=workdir, state_dir=workdir / "state")


@pytest.fixture
def cluster(broker_url: str, experiment_id: str, tmp_path: Path) -> Iterator[Any]:
    made: list[ProcessCluster] = []

    def make(config: Path) -> ProcessCluster:
        c = process_cluster(broker_url, experiment_id, config, tmp_path)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop_all()
        c.cleanup_broker()


def read_rounds(run_dir: Path) -> list[dict[str, str]]:
    import csv

    with (run_dir / "rounds.csv").open() as f:
        return list(csv.DictReader(f))


def log_events(text: str) -> list[dict[str, Any]]:
    """A service's structured log lines (one JSON object per line; anything else is skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def reduce_two_ways(strategy: Any, updates: list[Any], rnd: Any) -> tuple[Any, Any]:
    """A round's updates reduced by one aggregator in arrival order, and by two aggregators over a
    random split in a shuffled order then merged — the two partials every strategy's associativity
    test compares (the aggregation interface promises they finalise to the same model)."""
    from shared.algorithms.base import Partial

    one = Partial()
    for u in updates:
        one = strategy.reduce(one, u)
    order = list(range(len(updates)))
    rnd.shuffle(order)
    cut = rnd.randint(1, len(updates) - 1)
    left, right = Partial(), Partial()
    for i in order[:cut]:
        left = strategy.reduce(left, updates[i])
    for i in order[cut:]:
        right = strategy.reduce(right, updates[i])
    return one, strategy.merge(right, left)


def tap_inproc_publishes(monkeypatch: pytest.MonkeyPatch, tap: Any) -> None:
    """Route every in-process publish through ``tap(key, body, transient)`` first: it returns
    whether the message goes on to the broker (False: the broker took it, then lost it)."""
    from shared.transport.inproc import InprocTransport

    publish = InprocTransport.publish

    def tapped(
        self: InprocTransport,
        key: str,
        body: bytes,
        headers: dict[str, Any] | None = None,
        *,
        transient: bool = False,
    ) -> None:
        if tap(key, body, transient):
            publish(self, key, body, headers, transient=transient)

    monkeypatch.setattr(InprocTransport, "publish", tapped)


def lone_tasks(body: bytes) -> list[tuple[Any, bytes]]:
    """Each entry of a ``tasks`` message with the lone ``task`` message it stands for: the message's
    own envelope with its kind and body replaced (what the entry's device is charged, and what its
    dead letter holds). Rebuilt here from the raw message, apart from the client's own code."""
    from shared import codec
    from shared.schemas import KIND_CODES, Kind, Tasks, decode, pack_body

    env, msg = decode(body, max_bytes=len(body) + 1)
    assert isinstance(msg, Tasks)
    raw = codec.unpackb(body, max_bytes=len(body) + 1)
    out = []
    for task in msg.tasks:
        raw[1], raw[6] = KIND_CODES[Kind.TASK], pack_body(Kind.TASK, task, version=env.v)
        out.append((task, codec.packb(raw)))
    return out


def unbundled(kind: Any) -> Any:
    """A ``ServiceBase._bundle`` that sends the messages bundles of ``kind`` (``updates``,
    ``answers``) would carry alone, as in real time or a host of the previous build; set it with
    ``monkeypatch.setattr(ServiceBase, "_bundle", unbundled(Kind.UPDATES))``."""
    from services.common import ServiceBase

    real = ServiceBase._bundle

    def bundle(self: ServiceBase, bundling: Any) -> None:
        if bundling.kind is not kind:
            real(self, bundling)

    return bundle
