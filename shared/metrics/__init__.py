"""Every Prometheus metric fedfleet exports, defined once.

Why one module: the Grafana dashboard, the alert rules and the tests all refer to metric names, and a
name that exists in two places drifts. Services import the objects below; nothing else creates a
metric. Labels are deliberately low-cardinality (experiment, algorithm, service, direction, kind,
tier, reason) — never a device id: a 10k-device fleet would explode Prometheus. Per-device detail goes
to ``runs/<id>/devices.csv`` instead.

Units are in the names (``_bytes_total``, ``_seconds``) as Prometheus conventions ask.
"""

from __future__ import annotations

import errno
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

#: Label sets reused below. ``direction`` is ``down`` (server→device), ``up`` (device→aggregator),
#: ``partial`` (aggregator→server) or ``control`` (small coordination messages).
TRAFFIC_LABELS = ("experiment", "algorithm", "service", "direction", "kind")
#: one series per experiment run
RUN_LABELS = ("experiment", "algorithm")
#: per device tier (a fleet's tiers are few; device ids never become labels)
TIER_LABELS = ("experiment", "algorithm", "tier")

_ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_FAST_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(8, 34, 2))

# -- traffic -------------------------------------------------------------------------------------------
WIRE_BYTES = Counter(
    "fedfleet_wire_bytes_total",
    "Message body bytes actually published to the broker (what crossed the wire).",
    TRAFFIC_LABELS,
)
DEVICE_BYTES = Counter(
    "fedfleet_device_bytes_total",
    "Bytes the emulated devices downloaded (task plus the payload it refers to) and uploaded: what a "
    "real fleet's links would carry, the figure the papers compare. What crossed the broker is "
    "fedfleet_wire_bytes_total. direction: down, up, eval_down (evaluation tasks after the run).",
    ("experiment", "algorithm", "direction", "tier"),
)
TELEMETRY_BYTES = Counter(
    "fedfleet_telemetry_bytes_total",
    "Bytes of the metrics and timings that rode with the devices' updates over the broker. They are "
    "the emulator's reporting, not what a real device would upload, so they are not in "
    'fedfleet_device_bytes_total; fedfleet_wire_bytes_total{kind="update"} is the two together.',
    ("experiment", "algorithm"),
)
DENSE_BYTES = Counter(
    "fedfleet_dense_bytes_total",
    "Dense-equivalent bytes of the tensors in published messages (float32 dense, no compression).",
    TRAFFIC_LABELS,
)
MESSAGES = Counter(
    "fedfleet_messages_total",
    "Messages published to the broker.",
    TRAFFIC_LABELS,
)
RECEIVED_BYTES = Counter(
    "fedfleet_received_bytes_total",
    "Message body bytes consumed from the broker.",
    ("experiment", "service", "kind"),
)
DEAD_LETTERS = Counter(
    "fedfleet_dead_letters_total",
    "Messages sent to the dead-letter queue, by reason (malformed, schema, tensor, unknown-round, ...).",
    ("experiment", "service", "reason"),
)
UNROUTABLE = Counter(
    "fedfleet_unroutable_messages_total",
    "Messages the broker returned because no queue was bound for their routing key (a host or server "
    "that is gone). Not published, so not in fedfleet_messages_total; a task answered by one is "
    "dead-lettered 'unroutable' as well.",
    ("experiment", "service", "kind"),
)
UPDATES = Counter(
    "fedfleet_updates_total",
    "Client updates handled by aggregators and the server, by result (accepted, duplicate, ...).",
    ("experiment", "algorithm", "service", "result"),
)
# -- rounds --------------------------------------------------------------------------------------------
ROUND = Gauge("fedfleet_round", "Current (last opened) round number.", RUN_LABELS)
ROUND_STARTED = Gauge(
    "fedfleet_round_started_timestamp_seconds",
    "Unix time the current round was opened.",
    RUN_LABELS,
)
ROUND_DEADLINE = Gauge(
    "fedfleet_round_deadline_timestamp_seconds",
    "Unix time by which the current round must close (deadline in wall time).",
    RUN_LABELS,
)
ROUND_OPEN = Gauge(
    "fedfleet_round_open",
    "1 while a round is open (waiting for updates), 0 between rounds.",
    RUN_LABELS,
)
ROUND_DURATION = Histogram(
    "fedfleet_round_duration_seconds",
    "Wall time from opening a round to finalizing it.",
    RUN_LABELS,
    buckets=_ROUND_BUCKETS,
)
ROUND_VIRTUAL_DURATION = Histogram(
    "fedfleet_round_virtual_duration_seconds",
    "Emulated (virtual clock) duration of a round: slowest accepted device's download+compute+upload.",
    RUN_LABELS,
    buckets=_ROUND_BUCKETS,
)
ROUNDS_COMPLETED = Counter(
    "fedfleet_rounds_total",
    "Rounds finished, by outcome (completed, below-quorum; lost: an attempt the broker lost, repeated).",
    ("experiment", "algorithm", "outcome"),
)
ACCURACY = Gauge("fedfleet_accuracy_ratio", "Latest evaluation accuracy (0..1).", RUN_LABELS)
LOSS = Gauge("fedfleet_loss", "Latest evaluation loss.", RUN_LABELS)
DENSITY = Gauge(
    "fedfleet_model_density_ratio",
    "Fraction of model parameters that are non-zero / kept (1.0 for dense algorithms).",
    RUN_LABELS,
)
# -- devices -------------------------------------------------------------------------------------------
PARTICIPANTS = Counter(
    "fedfleet_participants_total",
    "Device updates that were aggregated into a round.",
    TIER_LABELS,
)
SELECTED = Counter(
    "fedfleet_selected_total",
    "Devices selected for a round.",
    TIER_LABELS,
)
REJECTIONS = Counter(
    "fedfleet_rejections_total",
    "Tasks refused by a device before training, by reason (memory, ...).",
    (*TIER_LABELS, "reason"),
)
DROPOUTS = Counter(
    "fedfleet_dropouts_total",
    "Selected devices that did not deliver an update in time, by reason (offline, dropped, deadline).",
    (*TIER_LABELS, "reason"),
)
HOSTS = Gauge("fedfleet_hosts", "Client processes (hosts) the server knows as alive.", ("experiment",))
HOSTED_DEVICES = Gauge(
    "fedfleet_hosted_devices", "Devices leased to a host (the rest cannot be selected).", ("experiment",)
)
HOSTS_LOST = Counter(
    "fedfleet_hosts_lost_total",
    "Hosts whose lease expired (no heartbeat for hosts.lease_timeout_s): crashed or cut off.",
    ("experiment",),
)
REGISTERED_DEVICES = Gauge(
    "fedfleet_registered_devices", "Devices known to the server.", ("experiment", "tier")
)
DEVICE_ROUND_BYTES = Histogram(
    "fedfleet_device_round_bytes",
    "Wire bytes one device moved in one round, by direction and tier.",
    ("experiment", "algorithm", "direction", "tier"),
    buckets=_BYTES_BUCKETS,
)
# -- clients, aggregators, services ---------------------------------------------------------------------
CLIENT_TRAIN_SECONDS = Histogram(
    "fedfleet_client_train_seconds",
    "Real (measured) local training time of one task.",
    TIER_LABELS,
    buckets=_FAST_BUCKETS,
)
CLIENT_TRANSFER_SECONDS = Histogram(
    "fedfleet_client_transfer_seconds",
    "Emulated link time of one transfer (latency + bytes/bandwidth), by direction and clock.",
    ("experiment", "algorithm", "tier", "direction", "clock"),
    buckets=_FAST_BUCKETS,
)
CLIENT_COMPUTE_SECONDS = Histogram(
    "fedfleet_client_compute_seconds",
    "Emulated compute time of one task (FLOPs / device speed), by clock.",
    ("experiment", "algorithm", "tier", "clock"),
    buckets=_FAST_BUCKETS,
)
MEMORY_BUDGET_BYTES = Gauge(
    "fedfleet_memory_budget_bytes", "Memory budget of a device tier.", ("experiment", "tier")
)
MEMORY_FOOTPRINT_BYTES = Gauge(
    "fedfleet_memory_footprint_bytes",
    "Training footprint of the last task admitted or refused on a tier.",
    TIER_LABELS,
)
AGGREGATION_SECONDS = Histogram(
    "fedfleet_aggregation_seconds",
    "Time to validate, decode and reduce one update into an aggregator's partial.",
    RUN_LABELS,
    buckets=_FAST_BUCKETS,
)
HANDLER_ERRORS = Counter(
    "fedfleet_handler_errors_total",
    "Unexpected exceptions in a message handler (the message is dead-lettered, the service lives on).",
    ("experiment", "service", "kind"),
)
# -- bounded updates and robust aggregation ----------------------------------------------------------
UPDATE_BOUNDS = Counter(
    "fedfleet_update_bounds_total",
    "Updates an aggregator found out of bounds, by what it did: nonfinite, num-samples, "
    "update-norm (rejected) or clipped (scaled down to bounds.max_update_norm and merged).",
    ("experiment", "algorithm", "outcome"),
)
ROBUST_UPDATES = Counter(
    "fedfleet_robust_updates_total",
    "Updates the server's robust aggregation handled, by what it did with them: clipped "
    "(robust.clip_norm), excluded (left out by Krum / multi-Krum) or used.",
    ("experiment", "algorithm", "outcome"),
)

BROKER_PUBLISH_RETRIES = Counter(
    "fedfleet_broker_publish_retries_total",
    "Publishes the broker refused (a NACK, e.g. during a quorum leader election, or a closed channel) "
    "and that were sent again on a fresh channel.",
    ("experiment", "reason"),
)
BROKER_RECONNECTS = Counter(
    "fedfleet_broker_reconnects_total",
    "Connections to the broker re-opened after a loss (possibly to another node's address).",
    ("experiment",),
)
BROKER_CONSUMER_CANCELS = Counter(
    "fedfleet_broker_consumer_cancels_total",
    "Consumers the broker cancelled (its queue's node or leader went away); each was re-subscribed.",
    ("experiment",),
)


def all_metric_names(registry: CollectorRegistry = REGISTRY) -> set[str]:
    """Every sample name the registry can export (``_total``, ``_bucket``... included).

    The dashboard lint compares PromQL against this set, so it is computed from the live registry
    rather than kept by hand.
    """
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
    }
    names: set[str] = set()
    for collector in list(registry._collector_to_names):  # prometheus_client has no public listing
        describe = getattr(collector, "describe", None)
        for metric in describe() if describe else []:
            names.update(metric.name + sfx for sfx in suffixes.get(metric.type, ("",)))
    return names


_started: set[int] = set()
_lock = threading.Lock()
#: wall time at which the newest ``/metrics`` exposition began being generated (0: never scraped)
_last_scrape = 0.0
_scraped = threading.Condition()


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: scrapes every few seconds would drown the service's own log."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


#: the share of Prometheus's scrape timeout within which a served page counts as read: Prometheus
#: starts its clock before the request reaches this process and stops it after the last byte reaches
#: it, so a page served in more than this share of the timeout may have been dropped unread
SCRAPE_TIMEOUT_SHARE = 0.5


class _Served:
    """A response body that records its scrape once the server has written all of it (WSGI servers
    call ``close`` after the last byte): a service that exits as soon as it was scraped must not cut
    its last page short.

    A page that took longer than ``SCRAPE_TIMEOUT_SHARE`` of the scrape timeout Prometheus sent
    (``X-Prometheus-Scrape-Timeout-Seconds``) is not recorded. Why: Prometheus discards a scrape that
    overran its timeout, so the service, believing its final counts read, would exit and they would
    never land (a busy 2-core machine easily takes 200 ms to answer). The next scrape counts instead.
    """

    def __init__(self, body: Iterable[bytes], began: float, timeout_s: float | None) -> None:
        self.body, self.began, self.timeout_s = body, began, timeout_s
        self.started = time.monotonic()
        self.written = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.body
        self.written = True  # the server asks for more only after writing what it had

    def close(self) -> None:
        global _last_scrape
        if not self.written:  # the write failed (WSGI servers call ``close`` then too)
            return
        took = time.monotonic() - self.started
        if self.timeout_s is not None and took > SCRAPE_TIMEOUT_SHARE * self.timeout_s:
            return
        with _scraped:
            _last_scrape = max(_last_scrape, self.began)
            _scraped.notify_all()


def _scrape_timeout(environ: dict[str, Any]) -> float | None:
    """The scrape timeout a Prometheus request states (seconds), None from anyone else."""
    try:
        timeout = float(environ.get("HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS", ""))
    except ValueError:
        return None
    return timeout if timeout > 0 and math.isfinite(timeout) else None


def _recording_app(registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    """The exposition app, noting when each scrape read the counters (see ``wait_for_scrape``)."""
    inner = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        began = time.time()
        # the counters are read here, whole
        return _Served(inner(environ, start_response), began, _scrape_timeout(environ))

    return app


def wait_for_scrape(after: float, timeout: float, stop: threading.Event | None = None) -> bool:
    """Wait until a scrape has read the counters at or after ``after`` (True), at most ``timeout``
    seconds, or until ``stop`` is set.

    Why: a service that exits right after its work loses whatever changed since the last scrape —
    the final round's bytes, the last updates — and a Prometheus total then falls short of the run's
    own record. Waiting for one scrape that began after the work ended makes the final counts land.
    """
    deadline = time.time() + timeout
    with _scraped:
        while _last_scrape < after:
            left = deadline - time.time()
            if left <= 0 or (stop is not None and stop.is_set()):
                return False
            _scraped.wait(min(left, 0.2))
    return True


class MetricsPortInUse(RuntimeError):
    """The metrics port is taken: said in one line that names the port and how to choose another."""


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose ``/metrics`` on ``port`` (0 disables). Idempotent per port within a process."""
    if port <= 0:
        return
    with _lock:
        if port in _started:
            return
        try:
            httpd = make_server(
                addr, port, _recording_app(REGISTRY), ThreadingWSGIServer, handler_class=_QuietHandler
            )
            threading.Thread(target=httpd.serve_forever, daemon=True, name=f"metrics:{port}").start()
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise MetricsPortInUse(
                f"metrics port {addr}:{port} is already in use (another fedfleet service on this "
                "machine?); choose another with --metrics-port or FEDFLEET_METRICS_PORT, or 0 for none"
            ) from err
        _started.add(port)
