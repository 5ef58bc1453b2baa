"""A private RabbitMQ cluster on loopback: N nodes of Debian's ``rabbitmq-server``, for fault tests.

Why: the promises of a replicated broker (a run survives the loss of any one node) can only be
checked against a real cluster, and a machine without Kubernetes can still run three nodes on
127.0.0.1. Each node gets its own name (``<prefix>N@localhost``), ports, data and log directory, one
shared Erlang cookie, and joins the first with ``rabbitmqctl join_cluster`` (about 30 s for three).

Its configuration is the Kubernetes one (``k8s/components/rabbitmq-cluster``), with what only makes
sense there replaced: the listeners move to free loopback ports, and peer discovery (a fixed list of
pod names there) becomes ``join_cluster`` here, since the nodes start one after another. So what the
tests show is what the deployment runs.

Every process is started in its own session and stopped by its id (the node's ``beam.smp`` is
SIGKILLed to emulate a crash). ``close`` kills every node this object started, so a test that
fails half-way leaves nothing running. The nodes register with the machine's ``epmd``, which is
left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # not the sbin wrapper: it switches users
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "k8s" / "components" / "rabbitmq-cluster"

#: keys of the Kubernetes configuration that name pods, files or ports of a pod; replaced locally
_POD_ONLY = (
    "cluster_formation.",
    "listeners.",
    "management.tcp.",
    "prometheus.tcp.",
    "load_definitions",
    "log.",
)


class ClusterError(RuntimeError):
    """A node that would not start, join or answer."""


def available() -> bool:
    """Whether this machine can run a private cluster (Debian's rabbitmq-server is installed)."""
    return Path(SERVER).exists() and Path(CTL).exists()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def local_config(conf: str, *, port: int, management_port: int, prometheus_port: int) -> str:
    """The Kubernetes ``rabbitmq.conf`` made for one loopback node: pod-only keys dropped, loopback
    listeners added."""
    kept = [
        line
        for line in conf.splitlines()
        if not line.strip().startswith(_POD_ONLY) and not line.strip().startswith("#") and line.strip()
    ]
    return "\n".join(
        [
            *kept,
            f"listeners.tcp.default = 127.0.0.1:{port}",
            "loopback_users = none",
            f"management.tcp.port = {management_port}",
            "management.tcp.ip = 127.0.0.1",
            f"prometheus.tcp.port = {prometheus_port}",
            "prometheus.tcp.ip = 127.0.0.1",
            "",
        ]
    )


def component_files() -> tuple[str, str]:
    """(rabbitmq.conf, enabled_plugins) of a Kubernetes broker pod with the 3-node component: the
    base's settings followed by the component's (the order of their conf.d files)."""
    base = ROOT / "k8s" / "base" / "rabbitmq"
    conf = (base / "rabbitmq.conf").read_text() + "\n" + (COMPONENT / "rabbitmq.conf").read_text()
    return conf, (base / "enabled_plugins").read_text()


@dataclass
class Node:
    name: str
    port: int
    dist_port: int
    management_port: int
    prometheus_port: int
    home: Path
    proc: subprocess.Popen[bytes] | None = None
    #: the Erlang VM's OS pid (what a crash kills)
    os_pid: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """``size`` RabbitMQ nodes on loopback under ``root``; use as a context manager."""

    def __init__(self, root: Path, size: int = 3, *, prefix: str | None = None) -> None:
        if not available():
            raise ClusterError(f"{SERVER} is not installed (Debian package rabbitmq-server)")
        self.root = root
        self.prefix = prefix or f"ff{os.getpid()}n"
        self.cookie = secrets.token_hex(16)
        self.conf, self.plugins = component_files()
        ports = _free_ports(4 * size)
        self.nodes = [
            Node(
                name=f"{self.prefix}{i + 1}@localhost",
                port=ports[4 * i],
                dist_port=ports[4 * i + 1],
                management_port=ports[4 * i + 2],
                prometheus_port=ports[4 * i + 3],
                home=root / f"node{i + 1}",
            )
            for i in range(size)
        ]

    # -- addresses -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Every node's address, ``;``-separated (what ``RABBITMQ_URL`` takes)."""
        return ";".join(n.url for n in self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- life cycle ------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start every node, then join the others to the first (one after another: a join
        restarts the joining node's application)."""
        for node in self.nodes:
            self._launch(node)
        for node in self.nodes:
            self._await(node)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", first.name)
            self.ctl(node, "start_app")
        for node in self.nodes:
            self._await(node)

    def _launch(self, node: Node) -> None:
        d = node.home
        (d / "home").mkdir(parents=True, exist_ok=True)
        cookie = d / "home" / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(self.cookie)
            cookie.chmod(0o400)
        (d / "rabbitmq.conf").write_text(
            local_config(
                self.conf,
                port=node.port,
                management_port=node.management_port,
                prometheus_port=node.prometheus_port,
            )
        )
        (d / "enabled_plugins").write_text(self.plugins)
        (d / "rabbitmq-env.conf").write_text("")  # or the node reads the system node's env file
        node.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "HOME": str(d / "home"),
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(node.port),
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(d / "expand"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        out = (d / "stdout.log").open("ab")
        node.proc = subprocess.Popen(
            [SERVER], env=node.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def _await(self, node: Node, timeout_s: float = 120) -> None:
        """Wait until the node has booted (``await_startup`` fails at once while the VM is not yet
        registered with epmd, so it is asked again until the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if node.proc is not None and node.proc.poll() is not None:
                log = (node.home / "stdout.log").read_text(errors="replace")[-2000:]
                raise ClusterError(f"{node.name} exited with {node.proc.returncode}: {log}")
            try:
                self.ctl(node, "await_startup", "--timeout", "60", timeout_s=70)
                break
            except ClusterError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        pid = self.ctl(node, "eval", "os:getpid().").strip().strip('"')
        node.os_pid = int(pid)

    def ctl(self, node: Node, *args: str, timeout_s: float = 120) -> str:
        """``rabbitmqctl -n <node> args``; raises ``ClusterError`` with its output on failure."""
        env = node.env or {"HOME": str(node.home / "home")}
        proc = subprocess.run(
            [CTL, "-n", node.name, *args], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            raise ClusterError(f"rabbitmqctl {' '.join(args)} on {node.name}: {proc.stderr or proc.stdout}")
        return proc.stdout

    def kill(self, node: Node) -> None:
        """A crash: SIGKILL the node's Erlang VM and everything of its session (by id)."""
        if node.os_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.os_pid, signal.SIGKILL)
        if node.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=30)
        node.os_pid = None

    def restart(self, node: Node) -> None:
        """Start a killed node again on its data; it rejoins the cluster by itself."""
        self._launch(node)
        self._await(node)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                self.kill(node)

    # -- where things live -----------------------------------------------------------------------
    def running(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def leaders(self, vhost: str = "/") -> dict[str, str]:
        """Queue name -> the node leading it (quorum) or holding it (classic).

        Asked through a node's management API first: it answers in milliseconds, where
        ``rabbitmqctl`` boots an Erlang VM (about a second), long enough for a test's run to move on.
        """
        for node in self.running():
            url = f"http://127.0.0.1:{node.management_port}/api/queues/{urllib.parse.quote(vhost, safe='')}"
            req = urllib.request.Request(url, headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="})  # guest
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    rows = json.loads(resp.read())
                return {row["name"]: str(row.get("leader") or row.get("node")) for row in rows}
            except OSError:
                continue
        for node in self.running():
            try:
                out = self.ctl(
                    node, "list_queues", "-q", "-p", vhost, "name", "leader", "--formatter", "json"
                )
            except ClusterError:
                continue
            return {row["name"]: row["leader"] for row in json.loads(out or "[]")}
        raise ClusterError("no running node answered list_queues")

    def wait_members(self, count: int, timeout_s: float = 60) -> None:
        """Wait until ``count`` nodes run in the cluster (after a restart, say)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.running():
                with contextlib.suppress(ClusterError):
                    status = json.loads(self.ctl(node, "cluster_status", "--formatter", "json"))
                    if len(status.get("running_nodes", [])) >= count:
                        return
            time.sleep(0.5)
        raise ClusterError(f"the cluster did not reach {count} running nodes within {timeout_s:g}s")
