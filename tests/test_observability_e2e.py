"""Observability end to end: a real Prometheus scrapes a real run, and the dashboard shows all of it.

Issue 6 promises two things that only running services can prove: every query of the Grafana
communication-cost dashboard returns data, and the bytes Prometheus reports are the bytes in the
run's ``summary.json``. The offline lint (tests/test_deploy.py) checks that the queries parse and name
exported metrics; it cannot tell a panel that stays empty because nothing ever sets its metric.

How the run is made to produce every kind of event the dashboard shows, each by a real mechanism:

* bytes, rounds, accuracy, aggregation, partials: an ordinary FedAvg run (server, two aggregators,
  clients, all separate processes over the local RabbitMQ);
* rejections (and the memory gauges, transfer and compute times by tier): the experiment has a
  ``fleet:``; two devices belong to a ``tiny`` tier whose memory budget (1 KiB) no task fits, so
  their client refuses every task at admission;
* dropouts: two devices belong to a ``flaky`` tier with ``p_dropout: 1.0``; they download their task
  and vanish (in virtual time the client tells the server at once, reason ``dropout``). Dropouts
  by deadline (a SIGKILLed client) are tests/test_scaling_e2e.py's subject;
* dead letters: a malformed message is published to the updates key mid-run;
* broker queue depth: RabbitMQ's own exporter (rabbitmq_prometheus, per-object endpoint).

Prometheus is Debian's ``prometheus`` binary with a config derived from deploy/prometheus/prometheus.yml
(same jobs and rule file, this run's ports, a 1 s scrape interval). Services keep serving /metrics
for ``FEDFLEET_LINGER_S`` seconds after they finish, so the last scrape sees the final counts.
Queries are evaluated over the run's time range (what Grafana shows for it), and final counters are
read with ``last_over_time`` so services that have exited still count.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.orchestrator import ProcessCluster as Cluster
from services.orchestrator import ServiceProcess as Proc
from services.orchestrator import free_ports
from tests.conftest import process_cluster, read_rounds, wait_for, write_config
from tests.test_deploy import (
    DEPLOY,
    RULES,
    dashboard_queries,
    load_dashboard,
    substitute_grafana_vars,
    tool,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow]

RUN_TIMEOUT = 300.0
#: the most seconds a finished service keeps /metrics up waiting for its final scrape (it leaves as
#: soon as one happened): many scrape intervals, so a busy CI machine's Prometheus still gets there
LINGER_S = 20
#: fedfleet targets are scraped fast so that even a short run's rounds span several scrapes (rate()
#: needs two samples that differ); the broker's per-object endpoint, shared with everyone, at 1 s
SCRAPE_INTERVAL = "200ms"
BROKER_SCRAPE_INTERVAL = "1s"
#: range queries are evaluated every 0.1 s, half the fedfleet scrape interval. Why: a scrape that fails
#: (a 200 ms timeout is easily missed by a service busy training on a loaded 2-core CI machine) makes
#: Prometheus mark every series of that target stale, so a sample is visible only until the next
#: scrape. With Grafana-like 1 s steps a series whose good scrapes were all followed by failed ones
#: showed no point at all (CI at 716b8d9: the server's accuracy, loss, participants and dropouts
#: panels "without data" although test_prometheus_counts_equal_the_run_files read their final values)
QUERY_STEP_S = 0.1
RABBITMQ_METRICS_PORT = 15692
ROUNDS = 5
#: generous on purpose: no round needs its deadline (dropouts announce themselves in virtual time), and
#: an update that missed it would be published but never aggregated, so bytes could not match
ROUND_TIMEOUT_S = 90

#: Tiers: 4 ``roomy`` devices train normally, 2 ``flaky`` ones always drop out after downloading their
#: task, 2 ``tiny`` ones have a memory budget (1 KiB) no task fits and refuse every task at admission.
#: Which ids get which tier is the fleet's business; the assertions read it back from devices.csv.
TIER_COUNTS = {"roomy": 4, "flaky": 2, "tiny": 2}
_LINK = {"uplink_bps": "50Mbit/s", "downlink_bps": "100Mbit/s", "latency_s": "5ms"}
FLEET: dict[str, Any] = {
    "tiers": {
        "roomy": {"count": 4, "memory_fraction": 4.0, "flops_per_s": "5GFLOP/s", **_LINK},
        "flaky": {"count": 2, "memory_fraction": 4.0, "flops_per_s": "1GFLOP/s", "p_dropout": 1.0, **_LINK},
        "tiny": {
            "count": 2,
            "memory_bytes": "1KiB",
            "uplink_bps": "1Mbit/s",
            "downlink_bps": "2Mbit/s",
            "latency_s": "100ms",
            "flops_per_s": "100MFLOP/s",
        },
    },
}


# -- Prometheus --------------------------------------------------------------------------------------
class Prometheus:
    """A throw-away Prometheus server (temp storage, free port) and its HTTP API."""

    def __init__(self, binary: str, config: Path, workdir: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self._fh = self.log.open("wb")
        self.p = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._fh,
            stderr=self._fh,
        )

    def ready(self) -> bool:
        if self.p.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.p.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"prometheus /api/v1/{path} {params}: {err.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr, time=at)["result"])

    def scalar(self, expr: str, at: float) -> float:
        """The single value of an expression that aggregates to one series (NaN when it has none)."""
        result = self.query(expr, at)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else math.nan

    def query_range(
        self, expr: str, start: float, end: float, step: float = QUERY_STEP_S
    ) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._fh.close()


def prometheus_config(
    targets: dict[str, int], broker: str, prometheus_port: int, path: Path
) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with this run's targets, a short interval and the real rules.

    Derived, not hand-written, so the test exercises the jobs and metrics path the project ships: the
    fedfleet job's fixed 9100-9119 range becomes this run's ports (each labelled with its process
    name, so a target can be told apart), the broker job keeps its /metrics/per-object path.
    """
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(
        scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL, evaluation_interval="1s"
    )
    cfg["rule_files"] = [str(RULES)]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert set(jobs) == {"fedfleet-local", "broker", "prometheus"}, (
        f"deploy/prometheus/prometheus.yml changed its jobs ({sorted(jobs)}): update this test"
    )
    jobs["fedfleet-local"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"process": name}} for name, port in targets.items()
    ]
    assert jobs["broker"]["metrics_path"] == "/metrics/per-object"
    jobs["broker"]["static_configs"] = [{"targets": [broker], "labels": {"process": "rabbitmq"}}]
    jobs["broker"].update(scrape_interval=BROKER_SCRAPE_INTERVAL, scrape_timeout=BROKER_SCRAPE_INTERVAL)
    jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{prometheus_port}"]}]
    jobs["prometheus"].update(scrape_interval="1s", scrape_timeout="1s")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def _rabbitmq_exporter(broker_url: str) -> str:
    """host:port of the broker's rabbitmq_prometheus endpoint; fails under CI when it does not answer."""
    host = urllib.parse.urlparse(broker_url.replace("amqp://", "http://", 1)).hostname or "127.0.0.1"
    target = f"{host}:{RABBITMQ_METRICS_PORT}"
    try:
        with urllib.request.urlopen(f"http://{target}/metrics/per-object", timeout=10) as r:
            if r.status == 200 and b"rabbitmq_" in r.read():
                return target
    except OSError:
        pass
    message = (
        f"RabbitMQ's Prometheus endpoint http://{target}/metrics/per-object does not answer: "
        "run `rabbitmq-plugins enable rabbitmq_prometheus` (scripts/ensure_broker.sh)"
    )
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set: this test must run, not skip)")
    pytest.skip(message)


# -- the run ----------------------------------------------------------------------------------------
@dataclass
class ObservedRun:
    exp: str
    run_dir: Path
    summary: dict[str, Any]
    rounds: list[dict[str, str]]
    devices: list[dict[str, str]]
    prom: Prometheus
    start: float
    end: float
    targets: dict[str, int]
    logs: dict[str, Path] = field(default_factory=dict)

    def last(self, selector: str) -> float:
        """Sum of each series' last scraped value (services that exited still count)."""
        return self.prom.scalar(f"sum(last_over_time({selector}[1h]))", self.end)


def _logs_tail(procs: list[Proc], prom: Prometheus) -> str:
    parts = [f"--- {p.name} (exit {p.p.poll()})\n{p.text()[-1500:]}" for p in procs]
    parts.append(f"--- prometheus\n{prom.log.read_text()[-1500:]}")
    return "\n".join(parts)


def _wait(
    predicate: Any, what: str, cluster: Cluster, prom: Prometheus, interval: float = 0.2, *, alive: list[Proc]
) -> None:
    """``wait_for`` that gives up early, with every log, when a process it depends on has exited."""

    def done() -> bool:
        if predicate():
            return True
        for p in alive:
            if p.p.poll() is not None:
                tail = _logs_tail(cluster.procs, prom)
                raise AssertionError(f"{p.name} exited while waiting for {what}\n{tail}")
        return False

    try:
        wait_for(done, RUN_TIMEOUT, what, interval)
    except AssertionError as err:
        if "timed out" not in str(err):
            raise
        raise AssertionError(f"{err}\n{_logs_tail(cluster.procs, prom)}") from None


@pytest.fixture(scope="module")
def observed(broker_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedRun]:
    """One run, watched by one Prometheus, shared by the checks below (a run costs about a minute).

    Order matters: Prometheus is up before any service so the run is scraped from its first second;
    the queries run after every service has exited, over the run's time range.
    """
    prometheus_bin = tool("prometheus")
    broker_target = _rabbitmq_exporter(broker_url)
    work = tmp_path_factory.mktemp("observability")
    exp = f"obs{os.getpid()}{time.time_ns() % 10**8}"
    config = write_config(
        work / "experiment.yaml",
        rounds=ROUNDS,
        devices_per_round=8,  # every device every round: each round has rejections and dropouts
        round_timeout_s=ROUND_TIMEOUT_S,
        quorum_fraction=0.25,
        registration_timeout_s=120,  # the server waits for all 8 devices; the timeout never decides
        fleet=FLEET,
    )
    cluster = process_cluster(broker_url, exp, config, work)
    cluster.env["FEDFLEET_LINGER_S"] = str(LINGER_S)
    clients = {"c0": "0-3", "c1": "4-7"}
    names = ["server", "agg-0", "agg-1", *clients]
    *service_ports, prom_port = free_ports(len(names) + 1)
    targets = dict(zip(names, service_ports, strict=True))
    prom_dir = work / "prometheus"
    prom_dir.mkdir()
    prom_cfg = prom_dir / "prometheus.yml"
    prometheus_config(targets, broker_target, prom_port, prom_cfg)
    prom = Prometheus(prometheus_bin, prom_cfg, prom_dir, prom_port)
    state = str(work / "state")
    try:
        wait_for(prom.ready, 60, "prometheus to be ready", interval=0.5)
        start = time.time()
        server = cluster.start("server", ["server", "--run-dir", str(cluster.run_dir)], targets["server"])
        for agg in ("agg-0", "agg-1"):
            cluster.start(agg, ["aggregator", "--id", agg], targets[agg])
        # rate() needs two scrapes that differ, and five rounds of eight devices take about half a
        # second: a histogram whose first scrape came after the rounds reads one constant value and
        # its quantile panel stays empty (CI at 3c1bc5b: round duration and aggregation time, when the
        # clients registered while the server was still starting). So the rounds wait for Prometheus
        # to have read the empty series: the server's and aggregators' before any client starts, and
        # the first client's before the second one completes the registration that opens round 1.
        _wait_scraped(f'fedfleet_round_duration_seconds_count{{experiment="{exp}"}}', 1, cluster, prom, start)
        _wait_scraped(f'fedfleet_aggregation_seconds_count{{experiment="{exp}"}}', 2, cluster, prom, start)
        for name, hosted in clients.items():
            cluster.start(
                name, ["client", "--id", name, "--devices", hosted, "--state-dir", state], targets[name]
            )
            if name == "c0":
                _wait_scraped(
                    f'fedfleet_client_train_seconds_count{{experiment="{exp}"}}', 1, cluster, prom, start
                )
        _wait(lambda: '"round_open"' in server.text(), "round 1 to open", cluster, prom, alive=cluster.procs)
        _publish_garbage(cluster)

        try:
            rc = server.p.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish\n{_logs_tail(cluster.procs, prom)}") from None
        assert rc == 0, f"server exited with {rc}\n{_logs_tail(cluster.procs, prom)}"
        for p in cluster.procs:
            try:
                p.p.wait(60 + LINGER_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{p.name} did not exit\n{_logs_tail(cluster.procs, prom)}") from None
        # RabbitMQ refreshes its per-queue statistics every collect_statistics_interval (5 s by
        # default), so a short run can end before the exporter shows the dead letter that has sat in
        # the (kept) dead-letter queue since round 1: wait for one refreshed scrape, not longer
        dead = f'rabbitmq_queue_messages{{queue="ff.{exp}.dead"}}'

        def broker_showed_the_dead_letter() -> bool:
            series = prom.query_range(dead, start, time.time())
            return any(float(v) >= 1 for s in series for _, v in s["values"])

        wait_for(
            broker_showed_the_dead_letter,
            30,
            "Prometheus to scrape the broker's refreshed queue statistics",
            interval=1.0,
        )
        # and for the recording rules to have evaluated over the run's scrapes: on a loaded machine
        # (the whole suite on 2 cores) a run of a few seconds could end before Prometheus had two
        # scrapes of a counter to take a rate of at an evaluation (seen once in a full run)
        rate = f'fedfleet:wire_bytes:rate5m{{experiment="{exp}"}}'
        wait_for(
            lambda: bool(prom.query_range(rate, start, time.time())),
            30,
            "Prometheus to evaluate the recording rules over the run",
            interval=1.0,
        )
        end = time.time()
        with (cluster.run_dir / "devices.csv").open() as f:
            devices = list(csv.DictReader(f))
        yield ObservedRun(
            exp=exp,
            run_dir=cluster.run_dir,
            summary=json.loads((cluster.run_dir / "summary.json").read_text()),
            rounds=read_rounds(cluster.run_dir),
            devices=devices,
            prom=prom,
            start=start,
            end=end,
            targets=targets,
            logs={p.name: p.log for p in cluster.procs},
        )
    finally:
        cluster.stop_all()
        cluster.cleanup_broker()
        prom.stop()
        shutil.rmtree(prom_dir / "tsdb", ignore_errors=True)


def _wait_scraped(expr: str, series: int, cluster: Cluster, prom: Prometheus, start: float) -> None:
    """Wait until Prometheus holds a zero sample of ``series`` series matching ``expr`` (the series the
    services create empty at start-up), with every log if a service exits first."""

    def scraped() -> bool:
        found = prom.query_range(expr, start, time.time())
        return sum(any(float(v) == 0 for _, v in s["values"]) for s in found) >= series

    _wait(scraped, f"Prometheus to scrape {expr} at zero", cluster, prom, alive=cluster.procs)


def _publish_garbage(cluster: Cluster) -> None:
    """Put one malformed message on the updates key: an aggregator must dead-letter it."""
    from shared.transport import KEY_UPDATE
    from shared.transport.amqp import AmqpTransport

    t = AmqpTransport(cluster.url, cluster.experiment_id)
    try:
        t.publish(KEY_UPDATE, b"\xc1\xc1 this is not msgpack")
    finally:
        t.close()


# -- the tests ---------------------------------------------------------------------------------------
def test_the_run_had_every_event(observed: ObservedRun) -> None:
    """Precondition of the dashboard check: the run really contained rejections, dropouts, dead
    letters and completed rounds (otherwise an empty panel would be the run's fault, not the code's)."""
    assert observed.summary["rounds"] == ROUNDS
    assert [r["outcome"] for r in observed.rounds] == ["completed"] * ROUNDS
    tiers: dict[str, list[dict[str, str]]] = {}
    for d in observed.devices:
        tiers.setdefault(d["tier"], []).append(d)
    assert {t: len(ds) for t, ds in tiers.items()} == TIER_COUNTS
    for tier, column in (("roomy", "completed"), ("flaky", "dropped"), ("tiny", "rejected")):
        assert all(int(d[column]) == ROUNDS for d in tiers[tier]), (tier, tiers[tier])
    assert "malformed" in observed.logs["agg-0"].read_text() + observed.logs["agg-1"].read_text()


def test_prometheus_scraped_every_service_and_the_broker(observed: ObservedRun) -> None:
    """Every process was a healthy target at least once, and the broker's exporter served this
    experiment's own queues (the broker panels would otherwise show only other experiments)."""
    prom = observed.prom
    seen_up = {
        s["metric"].get("process", s["metric"]["job"])
        for s in prom.query_range("up", observed.start, observed.end)
        if any(v == "1" for _, v in s["values"])
    }
    assert set(observed.targets) | {"rabbitmq"} <= seen_up, (
        f"never scraped: {sorted(set(observed.targets) | {'rabbitmq'} - seen_up)}"
    )
    queues = {
        s["metric"]["queue"]
        for s in prom.query_range(
            f'rabbitmq_queue_messages{{queue=~"ff[.]{observed.exp}[.].+"}}', observed.start, observed.end
        )
    }
    exp = observed.exp
    assert {f"ff.{exp}.updates", f"ff.{exp}.server", f"ff.{exp}.dead"} <= queues, queues


def test_prometheus_bytes_equal_summary(observed: ObservedRun) -> None:
    """What Prometheus reports (summed over every service's final scrape) equals summary.json."""
    s, exp = observed.summary, observed.exp
    wire = f'fedfleet_wire_bytes_total{{experiment="{exp}"'
    dense = f'fedfleet_dense_bytes_total{{experiment="{exp}"'
    device = f'fedfleet_device_bytes_total{{experiment="{exp}"'
    assert s["bytes_up"] > 0 and s["bytes_down"] > 0
    # what the emulated devices sent and received, as the dashboard's communication panels show it
    assert observed.last(device + ',direction="up"}') == s["bytes_up"]
    assert observed.last(device + ',direction="down"}') == s["bytes_down"]
    assert observed.last(dense + ',kind="update"}') == s["dense_bytes_up"]
    # (tasks travel as one ``tasks`` message per host and round, with the dense bytes of its entries)
    assert observed.last(dense + ',kind=~"tasks?"}') == s["dense_bytes_down"]
    # what crossed the broker: an update is one message per device; the global model travels once
    # per host as a payload, so the broker carries far less downlink than the devices were charged
    # an update on the broker is the device's upload plus its telemetry (metrics, timings)
    telemetry = observed.last(f'fedfleet_telemetry_bytes_total{{experiment="{exp}"}}')
    assert telemetry == s["telemetry_bytes_up"] > 0
    assert observed.last(wire + ',kind="update"}') == s["bytes_up"] + telemetry
    broker_down = observed.last(wire + ',kind=~"tasks?"}') + observed.last(wire + ',kind="payload"}')
    assert 0 < broker_down < s["bytes_down"]


def test_prometheus_counts_equal_the_run_files(observed: ObservedRun) -> None:
    """Rounds, rejections, dropouts and participants as Prometheus saw them equal rounds.csv."""
    exp, rows = observed.exp, observed.rounds
    sel = f'{{experiment="{exp}"}}'
    assert observed.last(f'fedfleet_rounds_total{{experiment="{exp}",outcome="completed"}}') == ROUNDS
    assert observed.last(f"fedfleet_round{sel}") == ROUNDS
    assert observed.last(f"fedfleet_rejections_total{{experiment='{exp}',reason='memory'}}") == sum(
        int(r["rejected"]) for r in rows
    )
    assert observed.last(f"fedfleet_dropouts_total{{experiment='{exp}',reason='dropout'}}") == sum(
        int(r["dropped"]) for r in rows
    )
    assert observed.last(f"fedfleet_participants_total{sel}") == sum(int(r["participants"]) for r in rows)
    assert observed.last(f"fedfleet_selected_total{sel}") == sum(int(r["selected"]) for r in rows)
    assert observed.last(f"fedfleet_dead_letters_total{{experiment='{exp}',reason='malformed'}}") >= 1
    dead = observed.prom.query_range(
        f'rabbitmq_queue_messages{{queue="ff.{exp}.dead"}}', observed.start, observed.end
    )
    held = [float(v) for series in dead for _, v in series["values"]]
    assert held and max(held) >= 1, "the broker never held the dead letter"


def test_rules_evaluate_without_errors(observed: ObservedRun) -> None:
    """deploy/prometheus/rules.yml loaded into the real server and every rule evaluated cleanly."""
    groups = observed.prom.api("rules")["groups"]
    shipped = yaml.safe_load(RULES.read_text())["groups"]
    assert {g["name"] for g in groups} == {g["name"] for g in shipped}
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not bad, bad
    rate = observed.prom.query_range(
        f'fedfleet:wire_bytes:rate5m{{experiment="{observed.exp}"}}', observed.start, observed.end
    )
    assert rate, "the recording rule fedfleet:wire_bytes:rate5m produced nothing for the run"
    # a healthy run (its rejections, dropouts and one dead letter are all expected) raises none of the
    # alerts that fire without a `for:` delay
    alerts = observed.prom.query_range(
        'ALERTS{alertname=~"FedfleetHandlerErrors|FedfleetRoundsBelowQuorum"}', observed.start, observed.end
    )
    assert not alerts, [a["metric"] for a in alerts]


def _has_data(series: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(v)) for s in series for _, v in s["values"])


def test_every_dashboard_query_returns_data(observed: ObservedRun) -> None:
    """Every panel target and template variable of the dashboard, with the variables set to this
    run's experiment, returns at least one non-NaN point over the run's time range."""
    exp = observed.exp
    variables = {"experiment": exp, "algorithm": "fedavg"}
    empty: list[str] = []
    queries = dashboard_queries(load_dashboard())
    assert queries, "the dashboard has no queries"
    for where, query in queries:
        expr = substitute_grafana_vars(query, variables)
        series = observed.prom.query_range(expr, observed.start, observed.end)
        if not _has_data(series):
            empty.append(f"{where}: {expr}")
        elif "by (queue)" in expr:
            # broker panels are not filtered by experiment: this run's own queues must be among them
            assert any(s["metric"].get("queue", "").startswith(f"ff.{exp}.") for s in series), where
        elif where.startswith("variable experiment"):
            assert any(s["metric"].get("experiment") == exp for s in series), where
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_prometheus_bytes_equal_summary_with_a_thousand_devices(
    broker_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """At fleet scale too: 1,000 devices on three elastic hosts (no device arguments), Prometheus
    scraping every second. Each service waits after its work until one scrape has read its final
    counters (``FEDFLEET_LINGER_S`` is only the upper bound of that wait), so Prometheus's totals
    equal ``summary.json`` to the byte even though every process exits at the end of the run."""
    prometheus_bin = tool("prometheus")
    broker_target = _rabbitmq_exporter(broker_url)
    work = tmp_path_factory.mktemp("observability-1000")
    exp = f"obs1k{os.getpid()}{time.time_ns() % 10**8}"
    config = write_config(
        work / "experiment.yaml",
        rounds=3,
        num_devices=1000,
        devices_per_round=60,
        round_timeout_s=ROUND_TIMEOUT_S,
        registration_timeout_s=120,
        dataset={"name": "digits", "partition": "iid", "train_limit": None},
        train={"local_epochs": 1, "batch_size": 16, "lr": 0.3},
        emulation={"over_selection": 1.25},  # first finishers: discarded updates are never sent
        hosts={"min_hosts": 3},  # all three from round 1: a host slow to start finds the run going
    )
    cluster = process_cluster(broker_url, exp, config, work)
    cluster.env["FEDFLEET_LINGER_S"] = "60"
    names = ["server", "agg-0", "c0", "c1", "c2"]
    *ports, prom_port = free_ports(len(names) + 1)
    targets = dict(zip(names, ports, strict=True))
    prom_dir = work / "prometheus"
    prom_dir.mkdir()
    prom_cfg = prom_dir / "prometheus.yml"
    prometheus_config(targets, broker_target, prom_port, prom_cfg)
    prom = Prometheus(prometheus_bin, prom_cfg, prom_dir, prom_port)
    try:
        wait_for(prom.ready, 60, "prometheus to be ready", interval=0.5)
        start = time.time()
        server = cluster.server(metrics_port=targets["server"])
        cluster.aggregator("agg-0", metrics_port=targets["agg-0"])
        for name in ("c0", "c1", "c2"):
            cluster.client(name, metrics_port=targets[name])
        try:
            rc = server.p.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish\n{_logs_tail(cluster.procs, prom)}") from None
        assert rc == 0, _logs_tail(cluster.procs, prom)
        for p in cluster.procs:
            p.p.wait(90)
        end = time.time()
        s = json.loads((cluster.run_dir / "summary.json").read_text())
        assert s["rounds_completed"] == 3 and sum(t["devices"] for t in s["tiers"].values()) == 1000
        run = ObservedRun(exp, cluster.run_dir, s, [], [], prom, start, end, targets)
        wire = f'fedfleet_wire_bytes_total{{experiment="{exp}"'
        device = f'fedfleet_device_bytes_total{{experiment="{exp}"'
        assert run.last(wire + ',kind="update"}') == s["bytes_up"] + s["telemetry_bytes_up"] > 0
        assert run.last(device + ',direction="up"}') == s["bytes_up"]
        assert run.last(device + ',direction="down"}') == s["bytes_down"] > 0
        # every process left as soon as its final counts were scraped, not after the 60 s bound
        assert end - start < 60 + RUN_TIMEOUT / 2
        for p in cluster.procs:
            assert p.p.returncode == 0, p.text()[-2000:]
    finally:
        cluster.stop_all()
        cluster.cleanup_broker()
        prom.stop()
        shutil.rmtree(prom_dir / "tsdb", ignore_errors=True)
