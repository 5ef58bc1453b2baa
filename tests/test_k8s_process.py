"""The manifests, run: each overlay rendered with kustomize and every fedfleet container started as a
local process with its command, arguments and environment as Kubernetes would give them.

No cluster exists here, so this test is how we know the manifests describe a system that finishes:

* **Rendering**: ``kubectl kustomize k8s/overlays/<overlay>``; ConfigMaps become files and
  environment, the Secrets get random passwords under the keys ``make secrets`` creates.
* **Network**: ``<service>:<port>`` becomes ``127.0.0.1:<port of the process behind it>``; the real
  local RabbitMQ stands in for the ``rabbitmq`` StatefulSet, in a scratch vhost (the URLs' ``/%2F``
  becomes it) with the broker's own definitions applied through the management API — the role
  users (admin, server, aggregator, join) with the permissions and topic permissions the broker's init
  container renders, so the least-privilege model is what the processes run under, and the
  experiment's exchanges and dead-letter queue (the server declares them again: any difference in
  type or flags would fail it).
* **Volumes**: each mount is a directory (a PersistentVolumeClaim one per claim, shared by the pods
  that mount it; emptyDir one per pod); paths under a mount are rewritten to it.
* **Restart semantics**: init containers run first, in order. A container that exits under
  ``restartPolicy: Always`` (a Deployment) is a crash loop and fails the test; under a Job, exit 0 is
  a completion and anything else fails the test (no run here should need a retry).
* **Lifecycle**: the run goes to completion; mid-run the clients are scaled up and down the way
  ``make scale`` does (new pods; removed pods get SIGTERM), after the server Job completes they are
  scaled to 0 the way ``make up`` does, and the results are copied out of the server's volume the way
  ``make results`` does (through deploy/k8s/results-pod.yaml's mount).

What is overridden, and why: the experiment (fewer rounds, so each overlay runs in a minute or two on
a shared machine), the broker ids (a unique experiment id and user prefix, so concurrent runs on the
shared broker never collide), ``FEDFLEET_LINGER_S=0`` (no Prometheus scrapes here), and a client
Deployment starts at most ``MAX_CLIENT_PODS`` pods (fleet-100's ten would not fit this machine).
Prometheus and Grafana are not fedfleet images and are not started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import read_rounds

ROOT = Path(__file__).resolve().parents[1]
#: every overlay but ``ha``, whose services name three broker pods: its 3-node broker is what
#: tests/test_broker_cluster.py starts from the same component's configuration
OVERLAYS = sorted(
    p.name
    for p in (ROOT / "k8s" / "overlays").iterdir()
    if (p / "kustomization.yaml").is_file() and p.name != "ha"
)
#: the fedfleet workloads every overlay must deploy, and their kinds
WORKLOADS = {("Job", "server"), ("Job", "aggregator"), ("Deployment", "clients")}
MAX_CLIENT_PODS = 3
#: rounds of the shortened experiment; FEDFLEET_K8S_ROUNDS=overlay runs the overlay's own (how
#: docs/kubernetes.md measures an overlay's accuracy as deployed)
ROUNDS_ENV = os.environ.get("FEDFLEET_K8S_ROUNDS", "20")
RUN_TIMEOUT_S = 1800.0

pytestmark = pytest.mark.broker


def _tool(name: str) -> str:
    for candidate in (Path(sys.executable).parent / name, ROOT / ".venv" / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: run scripts/setup_deploy_tools.sh")
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [_tool("kubectl"), "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def secret_keys() -> list[str]:
    """The keys of rabbitmq-credentials, as ``make secrets`` creates them."""
    text = (ROOT / "deploy" / "k8s.mk").read_text()
    recipe = text[text.index("create secret generic rabbitmq-credentials") :]
    recipe = recipe[: recipe.index("create secret generic grafana-admin")]
    return re.findall(r"--from-literal=([a-z-]+)=", recipe)


# -- the management API (the real broker's, standing in for the rabbitmq pod's) ------------------------
class Management:
    def __init__(self, amqp_url: str) -> None:
        parts = urllib.parse.urlsplit(amqp_url)
        self.base = f"http://{parts.hostname}:15672"
        user, password = (
            urllib.parse.unquote(parts.username or ""),
            urllib.parse.unquote(parts.password or ""),
        )
        self.auth = "Basic " + b64encode(f"{user}:{password}".encode()).decode()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            self.base + path, data=None if body is None else json.dumps(body).encode(), method=method
        )
        req.add_header("Authorization", self.auth)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                data = resp.read()
        except urllib.error.HTTPError as err:
            if method == "DELETE" and err.code == 404:
                return None
            raise AssertionError(f"management API {method} {path}: HTTP {err.code}") from None
        return json.loads(data) if data else None


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


# -- pods as processes ------------------------------------------------------------------------------
@dataclass
class Pod:
    name: str
    workload: tuple[str, str]
    restart_policy: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    terminated: bool = False
    exit_code: int | None = None
    port: int = 0


@dataclass
class Cluster:
    """The rendered objects of one overlay, run as local processes (see the module docstring)."""

    docs: list[dict[str, Any]]
    work: Path
    vhost: str
    passwords: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    pods: list[Pod] = field(default_factory=list)
    seq: int = 0

    def obj(self, kind: str, name: str) -> dict[str, Any]:
        for d in self.docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
        raise KeyError((kind, name))

    def configmap(self, name: str) -> dict[str, str]:
        return dict(self.obj("ConfigMap", name).get("data", {}))

    # the network: service:port -> 127.0.0.1:port of the process behind it
    def rewrite(self, text: str, mounts: dict[str, Path]) -> str:
        for svc, port in (("rabbitmq", 5672), ("rabbitmq", 15672)):
            text = text.replace(f"{svc}:{port}", f"127.0.0.1:{port}")
        for key, local in self.ports.items():
            text = text.replace(key, f"127.0.0.1:{local}")
        text = text.replace("@127.0.0.1:5672/%2F", f"@127.0.0.1:5672/{q(self.vhost)}")
        for mount, local_dir in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if text == mount or text.startswith(mount + "/"):
                return str(local_dir) + text[len(mount) :]
        return text

    def env(self, container: dict[str, Any], pod_name: str, mounts: dict[str, Path]) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in container.get("envFrom", []):
            env.update(self.configmap(src["configMapRef"]["name"]))
        for item in container.get("env", []):
            if "value" in item:
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
            elif "secretKeyRef" in item["valueFrom"]:
                value = self.passwords[item["valueFrom"]["secretKeyRef"]["key"]]
            else:
                ref = item["valueFrom"]["configMapKeyRef"]
                value = self.configmap(ref["name"])[ref["key"]]
            env[item["name"]] = value
        env = {k: self.rewrite(v, mounts) for k, v in env.items()}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FEDFLEET_", "RABBITMQ_"))}
        return {**base, **env, "HOSTNAME": pod_name, "PYTHONUNBUFFERED": "1"}

    def mounts(self, spec: dict[str, Any], container: dict[str, Any], pod_dir: Path) -> dict[str, Path]:
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out: dict[str, Path] = {}
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "persistentVolumeClaim" in vol:
                local = self.work / "pvc" / vol["persistentVolumeClaim"]["claimName"]
            elif "configMap" in vol:
                local = pod_dir / "cm" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
                for key, value in self.configmap(vol["configMap"]["name"]).items():
                    (local / key).write_text(value)
            else:
                local = pod_dir / "vol" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "subPath" in m:
                local = local / m["subPath"]
            out[m["mountPath"]] = local
        return out

    def argv(self, container: dict[str, Any], env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
        command = container.get("command") or ["fedfleet"]  # the image's ENTRYPOINT
        exe = {"python": sys.executable, "fedfleet": str(Path(sys.executable).parent / "fedfleet")}
        argv = [*command, *container.get("args", [])]
        expanded = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]
        # the container's paths map to local directories; this machine's interpreter is not one of
        # them (it may itself live under a path a container mounts, e.g. a clone in /tmp)
        rewritten = [self.rewrite(a, mounts) for a in expanded]
        return [exe.get(command[0], rewritten[0]), *rewritten[1:]]

    def start_pod(self, kind: str, name: str) -> Pod:
        spec = self.obj(kind, name)["spec"]["template"]["spec"]
        self.seq += 1
        pod_name = f"{name}-{self.seq}"
        pod_dir = self.work / "pods" / pod_name
        pod_dir.mkdir(parents=True)
        policy = spec.get("restartPolicy", "Always")
        for init in spec.get("initContainers", []):  # in order; each must succeed
            mounts = self.mounts(spec, init, pod_dir)
            env = self.env(init, pod_name, mounts)
            done = subprocess.run(self.argv(init, env, mounts), env=env, capture_output=True, timeout=120)
            assert done.returncode == 0, f"{pod_name}: init container {init['name']} failed: {done.stderr!r}"
        (container,) = spec["containers"]
        mounts = self.mounts(spec, container, pod_dir)
        # one metrics port per process (Kubernetes gives each pod its own IP)
        port = _free_port()
        env = self.env(container, pod_name, mounts)
        env["FEDFLEET_METRICS_PORT"] = str(port)
        log = pod_dir / "log"
        pod = Pod(pod_name, (kind, name), policy, log=log, port=port)
        pod.proc = subprocess.Popen(
            self.argv(container, env, mounts),
            env=env,
            cwd=mounts.get("/data", pod_dir),
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.pods.append(pod)
        if name == "server":
            # the server Service's port now leads to this process
            for c in container.get("ports", []):
                self.ports[f"server:{c['containerPort']}"] = port
        return pod

    def live(self, workload: tuple[str, str]) -> list[Pod]:
        return [p for p in self.pods if p.workload == workload and not p.terminated and p.exit_code is None]

    def check(self) -> None:
        """Restart semantics: what exited, and whether Kubernetes would call it a failure."""
        for pod in self.pods:
            if pod.proc is None or pod.exit_code is not None:
                continue
            code = pod.proc.poll()
            if code is None:
                continue
            pod.exit_code = code
            if pod.terminated:
                assert code == 0, f"{pod.name} exited {code} after SIGTERM:\n{self.tail(pod)}"
            elif pod.restart_policy == "Always":
                pytest.fail(
                    f"{pod.name} exited {code} under restartPolicy Always: a crash loop\n{self.tail(pod)}"
                )
            else:
                assert code == 0, f"{pod.name} ({pod.restart_policy}) failed with {code}:\n{self.tail(pod)}"

    def ready(self, pod: Pod) -> bool:
        """The container's readinessProbe (an HTTP GET on its metrics port)."""
        spec = self.obj(*pod.workload)["spec"]["template"]["spec"]
        probe = spec["containers"][0]["readinessProbe"]["httpGet"]
        try:
            url = f"http://127.0.0.1:{pod.port}{probe['path']}"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def job_complete(self, name: str) -> bool:
        want = int(self.obj("Job", name)["spec"].get("completions", 1))
        return sum(1 for p in self.pods if p.workload == ("Job", name) and p.exit_code == 0) >= want

    def scale(self, name: str, replicas: int) -> None:
        """``make scale``: ``kubectl scale deployment/<name>`` (new pods, or SIGTERM to the newest
        ones), then ``rollout status`` (every new pod passes its readiness probe)."""
        pods = self.live(("Deployment", name))
        new = [self.start_pod("Deployment", name) for _ in range(replicas - len(pods))]
        deadline = time.time() + 120
        for pod in new:
            while not self.ready(pod):
                assert time.time() < deadline, f"{pod.name} never became ready:\n{self.tail(pod)}"
                self.check()
                time.sleep(0.2)
        for pod in pods[replicas:] if replicas < len(pods) else []:
            pod.terminated = True
            assert pod.proc is not None
            pod.proc.send_signal(signal.SIGTERM)

    @contextlib.contextmanager
    def paused(self, workload: tuple[str, str]) -> Iterator[None]:
        """SIGSTOP a workload's live pods for the duration (the harness holding a round in flight)."""
        stopped = [p.proc for p in self.live(workload) if p.proc is not None]
        for proc in stopped:
            proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for proc in stopped:
                proc.send_signal(signal.SIGCONT)

    def wait_terminated(self, timeout: float) -> None:
        deadline = time.time() + timeout
        for pod in self.pods:
            if pod.terminated and pod.proc is not None:
                pod.proc.wait(max(1.0, deadline - time.time()))
        self.check()

    def tail(self, pod: Pod) -> str:
        return pod.log.read_text(errors="replace")[-3000:] if pod.log and pod.log.exists() else ""

    def kill_all(self) -> None:
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_definitions(cluster: Cluster, env_overrides: dict[str, str]) -> dict[str, Any]:
    """The broker pod's init container (render-definitions.sh), as a process: its definitions."""
    spec = cluster.obj("StatefulSet", "rabbitmq")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    pod_dir = cluster.work / "pods" / "rabbitmq-0"
    pod_dir.mkdir(parents=True)
    mounts = cluster.mounts(spec, init, pod_dir)
    env = {**cluster.env(init, "rabbitmq-0", mounts), **env_overrides}
    assert init["command"][0] == "/bin/sh"
    done = subprocess.run(cluster.argv(init, env, mounts), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = Path(cluster.rewrite(env["OUT"], mounts))
    return dict(json.loads(out.read_text()))


def apply_definitions(api: Management, defs: dict[str, Any], vhost: str) -> None:
    """What RabbitMQ's load_definitions does with them, into the scratch vhost."""
    api.call("PUT", f"/api/vhosts/{q(vhost)}", {})
    for u in defs["users"]:
        api.call("PUT", f"/api/users/{q(u['name'])}", {"password": u["password"], "tags": u["tags"]})
    for p in defs["permissions"]:
        assert p["vhost"] == "/"
        body = {k: p[k] for k in ("configure", "write", "read")}
        api.call("PUT", f"/api/permissions/{q(vhost)}/{q(p['user'])}", body)
    for t in defs["topic_permissions"]:
        body = {k: t[k] for k in ("exchange", "write", "read")}
        api.call("PUT", f"/api/topic-permissions/{q(vhost)}/{q(t['user'])}", body)
    # the topology: the server's transport declares the same again, and fails (406) if it differs
    for e in defs["exchanges"]:
        body = {k: e[k] for k in ("type", "durable", "auto_delete", "internal", "arguments")}
        api.call("PUT", f"/api/exchanges/{q(vhost)}/{q(e['name'])}", body)
    for qu in defs["queues"]:
        body = {k: qu[k] for k in ("durable", "auto_delete", "arguments")}
        api.call("PUT", f"/api/queues/{q(vhost)}/{q(qu['name'])}", body)
    for b in defs["bindings"]:
        assert b["destination_type"] == "queue"
        path = f"/api/bindings/{q(vhost)}/e/{q(b['source'])}/q/{q(b['destination'])}"
        api.call("POST", path, {"routing_key": b["routing_key"], "arguments": b["arguments"]})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_runs_to_completion_as_processes(overlay: str, broker_url: str, tmp_path: Path) -> None:
    docs = render(overlay)
    fedfleet = {
        (d["kind"], d["metadata"]["name"])
        for d in docs
        if d["kind"] in ("Job", "Deployment", "StatefulSet")
        and any(c["image"].startswith("fedfleet") for c in d["spec"]["template"]["spec"]["containers"])
    }
    assert fedfleet == WORKLOADS

    # overrides: unique broker ids, a short experiment, no lingering for Prometheus
    tag = uuid.uuid4().hex[:8]
    exp_id, prefix, vhost = f"k8s{tag}", f"ffk8s{tag}-", f"ff-k8s-{tag}"
    env_cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("fedfleet-env")
    )
    env_cm["data"].update(FEDFLEET_EXPERIMENT=exp_id, FEDFLEET_USER_PREFIX=prefix, FEDFLEET_LINGER_S="0")
    exp_cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("experiment")
    )
    experiment = yaml.safe_load(exp_cm["data"]["experiment.yaml"])
    rounds = int(experiment["rounds"]) if ROUNDS_ENV == "overlay" else int(ROUNDS_ENV)
    experiment["rounds"] = rounds
    exp_cm["data"]["experiment.yaml"] = yaml.safe_dump(experiment)

    passwords = {key: secrets.token_urlsafe(18).replace("-", "_") for key in secret_keys()}
    assert set(passwords) == {"admin-password", "server-password", "aggregator-password", "join-password"}
    cluster = Cluster(docs, tmp_path, vhost, passwords)
    api = Management(broker_url)
    try:
        defs = run_definitions(cluster, {})
        assert {u["name"] for u in defs["users"]} == {
            f"{prefix}{r}" for r in ("admin", "server", "aggregator", "join")
        }
        apply_definitions(api, defs, vhost)

        server = cluster.start_pod("Job", "server")
        aggregators = int(cluster.obj("Job", "aggregator")["spec"].get("parallelism", 1))
        for _ in range(aggregators):
            cluster.start_pod("Job", "aggregator")
        replicas = min(int(cluster.obj("Deployment", "clients")["spec"]["replicas"]), MAX_CLIENT_PODS)
        cluster.scale("clients", replicas)

        run_dir = cluster.work / "pvc" / "server-data" / "runs" / exp_id
        scaled_up = scaled_down = False
        scaled_at = 0
        deadline = time.time() + RUN_TIMEOUT_S
        while not cluster.job_complete("server"):
            assert time.time() < deadline, f"the run did not finish:\n{cluster.tail(server)}"
            cluster.check()
            done = len(read_rounds(run_dir)) if (run_dir / "rounds.csv").exists() else 0
            if done >= 1 and not scaled_up:  # make scale CLIENTS=n+1 (returns once the pod is ready)
                # with the aggregators paused a round stays in flight while the new pod starts: a fast
                # machine cannot finish the run first (the round deadline is far longer than a start)
                with cluster.paused(("Job", "aggregator")):
                    cluster.scale("clients", replicas + 1)
                scaled_up, scaled_at = True, done
            elif scaled_up and not scaled_down and done > scaled_at and not cluster.job_complete("server"):
                # make scale CLIENTS=1: the others hand over and leave, with a round held in flight
                # (a leaving host's user deleted before its last ack once crashed it; now a clean
                # leave, tests/test_host_leave.py)
                with cluster.paused(("Job", "aggregator")):
                    cluster.scale("clients", 1)
                scaled_down = True
            # polled often: on a fast machine a shortened run's rounds take ~35 ms each, and a 0.5 s
            # poll saw the run end before it could scale down
            time.sleep(0.05)
        assert scaled_up and scaled_down, "the run ended before the clients were scaled"

        # the aggregators exit 0 once the server stops the run: their Job completes too
        deadline = time.time() + 60
        while not cluster.job_complete("aggregator"):
            assert time.time() < deadline, "the aggregator Job did not complete"
            cluster.check()
            time.sleep(0.5)
        # the clients idle after the run (no exit, no restart) until make up scales them to 0
        time.sleep(2)
        cluster.check()
        assert cluster.live(("Deployment", "clients")), "every client pod exited under restartPolicy Always"
        cluster.scale("clients", 0)
        cluster.wait_terminated(60)

        # make results: the results pod's volume mount, copied out
        pod = yaml.safe_load((ROOT / "deploy" / "k8s" / "results-pod.yaml").read_text())
        (mount,) = pod["spec"]["containers"][0]["volumeMounts"]
        (volume,) = pod["spec"]["volumes"]
        claim = volume["persistentVolumeClaim"]["claimName"]
        source = cluster.work / "pvc" / claim / f"/data/runs/{exp_id}".removeprefix(mount["mountPath"] + "/")
        target = tmp_path / "out" / "runs" / exp_id
        shutil.copytree(source, target)
        summary = json.loads((target / "summary.json").read_text())
        assert len(read_rounds(target)) == rounds
        accuracy = summary["final_accuracy"]
        print(f"{overlay}: {rounds} rounds as manifest-driven processes, final accuracy {accuracy}")
        assert summary["final_accuracy"] is not None and summary["final_accuracy"] > 0.2  # chance is 0.1
        # the server deleted the run's host users: nothing is left behind on the broker
        users = [u["name"] for u in api.call("GET", "/api/users")]
        assert not [u for u in users if u.startswith(f"{prefix}host-")]
    finally:
        cluster.kill_all()
        api.call("DELETE", f"/api/vhosts/{q(vhost)}")
        for u in api.call("GET", "/api/users"):
            if u["name"].startswith(prefix):
                api.call("DELETE", f"/api/users/{q(u['name'])}")


def test_the_harness_calls_an_exit_under_restart_policy_always_a_crash_loop(tmp_path: Path) -> None:
    """The restart semantics above can fail: a Deployment's container that exits (even with 0) is a
    crash loop; a Job's that exits non-zero is a failure; a Job's exit 0, or an exit after SIGTERM,
    is fine."""

    def exited(policy: str, code: int, terminated: bool = False) -> Cluster:
        cluster = Cluster([], tmp_path, "unused", {})
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        proc.wait()
        cluster.pods.append(Pod("p", ("X", "p"), policy, proc=proc, terminated=terminated))
        return cluster

    with pytest.raises(pytest.fail.Exception, match="crash loop"):
        exited("Always", 0).check()
    with pytest.raises(AssertionError, match="failed with 1"):
        exited("Never", 1).check()
    with pytest.raises(AssertionError, match="after SIGTERM"):
        exited("Always", 1, terminated=True).check()
    exited("OnFailure", 0).check()
    exited("Always", 0, terminated=True).check()
