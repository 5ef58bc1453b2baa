"""Shared fixtures: a real RabbitMQ broker, experiment configs, and service processes.

Broker resolution, as the project promises: ``RABBITMQ_URL`` if set, else the local broker on
127.0.0.1:5672, else a private ``rabbitmq-server`` started for the session (or a testcontainers one
where a Docker engine answers). Under CI (``CI`` set) a broker test is never skipped: no broker is a
failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports for child processes to serve on.

    Why not ``_free_port(0)`` n times: each call frees its port before the next asks, so the kernel
    may hand the same port out twice, and the second service to bind it dies at start-up. Holding
    all n sockets until every port is chosen makes them distinct.
    """
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


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
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


class Proc:
    """A service process with its log file, killable like a real crash."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        self._fh = log.open("wb")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv], stdout=self._fh, stderr=self._fh, env=env, cwd=ROOT
        )

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()

    def stop(self, timeout: float = 10) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._fh.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Cluster:
    """Start server/aggregator/client processes of one experiment against the test broker."""

    def __init__(self, url: str, exp: str, config: Path, workdir: Path) -> None:
        self.url, self.exp, self.config, self.workdir = url, exp, config, workdir
        self.run_dir = workdir / "run"
        self.procs: list[Proc] = []
        self.env = dict(os.environ, RABBITMQ_URL=url, PYTHONPATH=str(ROOT))

    def _start(self, name: str, argv: list[str]) -> Proc:
        return self._start_with_port(name, argv, 0)

    def _start_with_port(self, name: str, argv: list[str], port: int) -> Proc:
        p = Proc(
            name,
            [*argv, "--config", str(self.config), "--experiment", self.exp, "--metrics-port", str(port)],
            self.workdir / f"{name}.log",
            self.env,
        )
        self.procs.append(p)
        return p

    def server(self, name: str = "server") -> Proc:
        return self._start(name, ["server", "--run-dir", str(self.run_dir)])

    def aggregator(self, name: str) -> Proc:
        return self._start(name, ["aggregator", "--id", name])

    def client(self, name: str, devices: str) -> Proc:
        return self._start(
            name, ["client", "--id", name, "--devices", devices, "--state-dir", str(self.workdir / "state")]
        )

    def stop_all(self) -> None:
        for p in self.procs:
            p.stop()

    def cleanup_broker(self) -> None:
        from shared.transport.amqp import AmqpTransport

        t = AmqpTransport(self.url, self.exp)
        try:
            t.delete_experiment(
                [t.names.server_queue, t.names.updates_queue]
                + [t.names.client_queue(p.name) for p in self.procs if p.name.startswith("c")]
            )
        finally:
            t.close()


@pytest.fixture
def cluster(broker_url: str, experiment_id: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(config: Path) -> Cluster:
        c = Cluster(broker_url, experiment_id, config, tmp_path)
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
