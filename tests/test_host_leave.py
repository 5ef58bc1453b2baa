"""A client host that leaves: its broker user is deleted under it, which must be its clean end.

The server deletes a leaving host's broker user (and queue) once the host has applied its empty
lease; the broker then force-closes the host's connection, possibly before the host's last ack or
before the confirm of its last heartbeat. A clean-clone CI run saw such a host exit 1 (pika's
``ValueError: Timeout closed before call`` from the next ``process`` on the closed connection), and
reading the transport showed the other outcome: a reconnect loop as a user that no longer exists,
for the whole reconnect budget, then exit 3.

These tests do what the server does, deterministically, over the real broker: a host user made with
``shared.provision.BrokerAdmin`` (as the server makes them in strict mode), a delivery held
unacknowledged, the user deleted, the broker's close frame waited for on the socket, then the ack and
``process``. No timing is asserted: what is asserted is the exception type and the transport's state.

The last tests are about the users' other end: a restarted server takes over the host users made
before it (deleting those whose hosts are gone, keeping the live ones', touching no other
experiment's), and a user whose permissions could not be set is not left on the broker.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import shutil
import signal
import socket
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from services.orchestrator import ProcessCluster, ServiceProcess
from services.server.service import Server
from shared import identity, provision
from shared.config import load_config
from shared.experiment import Experiment
from shared.schemas import Heartbeat, JoinReply, Kind, encode
from shared.transport import KEY_CLIENTS, KEY_SERVER, BrokerUnavailable, Delivery, Departed, key_host
from shared.transport.amqp import AmqpTransport, BrokerOptions
from tests.conftest import log_events, read_rounds, wait_for, write_config
from tests.test_security_e2e import ADMIN_API, Deployment, _ctl, _host_users

pytestmark = pytest.mark.broker


def _admin_url(broker_url: str) -> str:
    """The management API of the test broker, as its AMQP URL's user (guest locally)."""
    p = pika.URLParameters(broker_url)
    creds = p.credentials
    user = urllib.parse.quote(str(creds.username), safe="")
    password = urllib.parse.quote(str(creds.password), safe="")
    return f"http://{user}:{password}@{p.host}:15672"


@dataclass
class Host:
    """A host user of its own (what the server makes for a joining host) and its transport."""

    admin: provision.BrokerAdmin
    owner: AmqpTransport
    transport: AmqpTransport
    host_id: str
    url: str
    got: list[Delivery]

    @property
    def queue(self) -> str:
        return self.transport.names.client_queue(self.host_id)

    def deliver_one(self) -> Delivery:
        """The owner sends the host one message; returns it, received and not yet acknowledged."""
        self.owner.publish(key_host(self.host_id), b"lease")
        for _ in range(200):  # a bound, not a timing: each pass returns as soon as something arrives
            if self.got:
                break
            self.transport.process(0.1)
        assert [d.body for d in self.got] == [b"lease"]
        return self.got[0]

    def await_close_frame(self) -> None:
        """Wait until the broker's answer to the deletion (its connection.close) is on the host's
        socket, unread: the next ack is then sent on a connection the broker has closed."""
        conn = self.transport._conn
        assert conn is not None
        sock = conn._impl._transport._sock
        readable, _, _ = select.select([sock], [], [], 30)
        assert readable, "the broker did not close the deleted user's connection"


@pytest.fixture
def host(broker_url: str, experiment_id: str) -> Iterator[Host]:
    vhost = pika.URLParameters(broker_url).virtual_host
    admin = provision.BrokerAdmin(_admin_url(broker_url), vhost=vhost)
    try:
        admin.tracing()  # the management API answers (a broker test is never skipped: fail if not)
    except provision.ProvisionError as err:
        pytest.fail(f"these tests delete a host's broker user through the management API: {err}")
    owner = AmqpTransport(broker_url, experiment_id, options=BrokerOptions(reconnect_budget_s=30))
    host_id, password = provision.new_host()
    user = admin.create_host_user(experiment_id, host_id, password)
    url = provision.with_user(broker_url, user, password)
    # a short budget and backoff: a test that wrongly reconnected would still end, with BrokerUnavailable
    options = BrokerOptions(reconnect_budget_s=2, backoff_s=0.05, backoff_max_s=0.2)
    transport = AmqpTransport(url, experiment_id, options=options, declare_topology=False)
    got: list[Delivery] = []
    transport.declare_queue(
        transport.names.client_queue(host_id), [KEY_CLIENTS, key_host(host_id)], expires_s=60
    )
    transport.consume(transport.names.client_queue(host_id), got.append, prefetch=2)
    h = Host(admin, owner, transport, host_id, url, got)
    try:
        yield h
    finally:
        transport.close()
        admin.delete_host(experiment_id, host_id)
        owner.delete_experiment([h.queue])
        owner.close()


def _events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "event", "") for r in caplog.records]


@pytest.mark.parametrize("settle", ["ack", "nack"])
def test_a_winding_down_host_whose_user_is_deleted_ends_at_once(
    host: Host, caplog: pytest.LogCaptureFixture, settle: str
) -> None:
    """The leave as the server makes it happen: the ack (or nack) goes with the connection (not
    raised), and ``process`` ends the transport with ``Departed`` after one refused login, no
    reconnect loop."""
    caplog.set_level(logging.INFO, logger="shared.transport.amqp")
    d = host.deliver_one()
    host.transport.winding_down()
    host.admin.delete_host(host.owner.names.experiment, host.host_id)
    host.await_close_frame()
    if settle == "ack":
        d.ack()  # queued, not flushed (``_ack_unflushed``): the next ``process`` meets the loss
    else:
        d.nack(requeue=True)  # flushed at once: was ConnectionClosedByBroker out of the handler
        assert "amqp_settle_lost" in _events(caplog)
    with pytest.raises(Departed):
        host.transport.process(0.1)  # was ValueError: Timeout closed before call
    assert host.transport.departed
    assert host.transport._conn is None
    events = _events(caplog)
    assert "amqp_departed" in events
    assert "amqp_retry" not in events  # one pass over the addresses, no backoff
    assert "amqp_reconnected" not in events
    # and it stays ended: nothing reopens the connection
    with pytest.raises(Departed):
        host.transport.process(0.1)
    with pytest.raises(Departed):
        host.transport.publish(key_host(host.host_id), b"more")


def test_a_host_not_winding_down_still_reconnects(host: Host, caplog: pytest.LogCaptureFixture) -> None:
    """The same loss without ``winding_down`` is a fault to recover from: the transport tries to
    reconnect within its budget (here short, since the user really is gone) and ends with
    ``BrokerUnavailable`` (exit 3 for a service), not ``Departed`` and not pika's ``ValueError``."""
    caplog.set_level(logging.INFO, logger="shared.transport.amqp")
    d = host.deliver_one()
    host.admin.delete_host(host.owner.names.experiment, host.host_id)
    host.await_close_frame()
    d.ack()
    with pytest.raises(BrokerUnavailable) as raised:
        host.transport.process(0.1)
    assert not isinstance(raised.value, Departed)
    assert not host.transport.departed
    assert "amqp_retry" in _events(caplog)  # it kept trying, with backoff


def test_a_winding_down_host_still_gets_through_a_lost_connection(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Winding down is no reason to give up on a connection merely lost (a broker node gone, its user
    still there): one reconnect, and the host's last heartbeat still reaches the server."""
    caplog.set_level(logging.INFO, logger="shared.transport.amqp")
    server_queue = host.owner.names.server_queue
    host.owner.declare_queue(server_queue, [KEY_SERVER])
    heard: list[Delivery] = []
    host.owner.consume(server_queue, heard.append, prefetch=4)
    host.deliver_one().ack()
    host.transport.winding_down()
    conn = host.transport._conn
    assert conn is not None
    conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)  # a dropped TCP connection
    host.transport.publish(KEY_SERVER, b"last heartbeat")  # reconnects once, then publishes
    assert not host.transport.departed
    assert "amqp_reconnected" in _events(caplog)
    for _ in range(200):
        if heard:
            break
        host.owner.process(0.1)
    assert [d.body for d in heard] == [b"last heartbeat"]
    host.owner.delete_queue(server_queue)


def test_a_winding_down_host_whose_queue_is_deleted_does_not_declare_it_again(host: Host) -> None:
    """Its queue deleted (the broker cancels the consumer), a winding-down host ends instead of
    declaring the queue again, which would outlive the host until it expires."""
    host.deliver_one().ack()
    host.transport.winding_down()
    host.owner.delete_queue(host.queue)
    with pytest.raises(Departed):
        for _ in range(200):  # the basic.cancel arrives with the next read
            host.transport.process(0.1)
    probe = pika.BlockingConnection(pika.URLParameters(host.owner.url))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
            probe.channel().queue_declare(host.queue, passive=True)
        assert missing.value.reply_code == 404
    finally:
        if probe.is_open:
            probe.close()


# -- end to end: real processes, strict mode (host users made and deleted by the server) ----------
ROUNDS = 20
RUN_TIMEOUT = 300.0
#: about 0.3 s of emulated compute per task, slept in real mode: the run is still going when we act
FLEET = {"preset": "uniform", "overrides": {"default": {"flops_per_s": "8MFLOP/s"}}}


def _json_events(proc: ServiceProcess) -> list[dict[str, Any]]:
    return log_events(proc.text())


def _has(proc: ServiceProcess, event: str, text: str = "") -> bool:
    return any(e.get("event") == event and text in e.get("msg", "") for e in _json_events(proc))


def _opened(server: ServiceProcess) -> int:
    return sum(e.get("event") == "round_open" for e in _json_events(server))


def _serves(host: ServiceProcess) -> bool:
    return any(
        e.get("event") == "lease_applied" and "serving 0 devices" not in e.get("msg", "")
        for e in _json_events(host)
    )


def _wait(predicate: Any, what: str, procs: list[ServiceProcess]) -> None:
    """``wait_for`` that stops early, with the logs, once any process has exited unexpectedly."""

    def done() -> bool:
        if predicate():
            return True
        dead = [p for p in procs if p.p.poll() is not None]
        if dead:
            tails = "\n".join(f"--- {p.name} (exit {p.p.poll()})\n{p.text()[-2500:]}" for p in procs)
            raise AssertionError(f"{[p.name for p in dead]} exited while waiting for {what}\n{tails}")
        return False

    wait_for(done, RUN_TIMEOUT, what, interval=0.05)


def _leave_with_a_round_held(tmp_path: Path, pins: str | None) -> None:
    """A strict-mode run (host users made by the server over the management API); host ``c1``
    is SIGTERMed while the round in flight is held (its aggregator SIGSTOPped). ``pins``: the devices
    ``c0`` is pinned to (all of them: ``c1`` serves none, so the server deletes its user as soon as
    its leave arrives, while the round is still held); None: both hosts share the fleet, and ``c1``
    hands its devices back once the round ends."""
    _need_admin_api()
    experiment = f"lv{uuid.uuid4().hex[:8]}"
    dep = Deployment(experiment)
    agg: ServiceProcess | None = None
    try:
        config = write_config(
            tmp_path / "c.yaml",
            rounds=ROUNDS,
            num_devices=8,
            devices_per_round=4,
            round_timeout_s=120,
            fleet=FLEET,
            emulation={"time_mode": "real", "time_factor": 1.0},
            hosts={"heartbeat_s": 0.5, "lease_timeout_s": 20, "join_quiet_s": 0.5},
        )
        cluster = ProcessCluster(
            dep.url(identity.server_user()),
            experiment,
            config,
            tmp_path / "run",
            # a short reconnect budget: a host that wrongly reconnects as its deleted user ends in
            # seconds (exit 3) rather than after the default 120 s
            env=dict(
                os.environ,
                FEDFLEET_USER_PREFIX=dep.prefix,
                FEDFLEET_BROKER_ADMIN_URL=ADMIN_API,
                FEDFLEET_RECONNECT_BUDGET_S="15",
                FEDFLEET_LINGER_S="0",
            ),
            fork_server=False,  # the services run as different users: one environment each
        )
        try:
            server = cluster.server()
            cluster.env["RABBITMQ_URL"] = dep.url(identity.aggregator_user())
            agg = cluster.aggregator("agg-0")
            cluster.env["RABBITMQ_URL"] = dep.url(identity.join_user())
            # c0 first: were c1 first, it would be leased the whole fleet until c0 joined
            c0 = cluster.client("c0", pins)
            _wait(lambda: _has(c0, "lease_applied"), "c0's lease", [server, agg, c0])
            c1 = cluster.client("c1")
            procs = [server, agg, c0, c1]
            if pins is not None:  # every device is c0's: c1's first lease is empty, and stays so
                _wait(lambda: _has(c1, "lease_applied", "serving 0 devices"), "c1's empty lease", procs)
            else:  # a share of the fleet, from the next round boundary on
                _wait(lambda: _serves(c1), "c1 to serve devices", procs)
            opened = _opened(server)
            _wait(lambda: _opened(server) > opened, "a round after c1's lease", procs)
            agg.p.send_signal(signal.SIGSTOP)  # the round in flight cannot close
            c1.p.send_signal(signal.SIGTERM)
            _wait(lambda: _has(c1, "host_leaving"), "c1 to start leaving", [server, c0, c1])
            if pins is not None:  # nothing to hand back: the server forgets c1 with the round still held
                code = c1.p.wait(RUN_TIMEOUT)
                assert code == 0, f"c1 exited {code}:\n{c1.text()[-3000:]}"
            agg.p.send_signal(signal.SIGCONT)
            code = c1.p.wait(RUN_TIMEOUT)
            assert code == 0, f"c1 exited {code}:\n{c1.text()[-3000:]}"
            assert _has(c1, "host_left"), c1.text()[-3000:]
            assert not _has(c1, "amqp_retry"), c1.text()[-3000:]  # no reconnect loop as a deleted user
            assert "Traceback" not in c1.text(), c1.text()[-3000:]
            assert server.p.wait(RUN_TIMEOUT) == 0, server.text()[-3000:]
            assert c0.p.wait(60) == 0, c0.text()[-2000:]
            assert _has(server, "host_left"), server.text()[-3000:]  # c1 (its id is the server's)
        finally:
            if agg is not None and agg.p.poll() is None:
                agg.p.send_signal(signal.SIGCONT)
            cluster.stop_all()
            cluster.cleanup_broker()
        assert [r["outcome"] for r in read_rounds(cluster.run_dir)] == ["completed"] * ROUNDS
        wait_for(lambda: not _host_users(dep.prefix), 30, "the run's host users to be deleted")
    finally:
        dep.close()


def _need_admin_api() -> None:
    """rabbitmqctl and the management API, for the scratch vhost and role users (never skipped)."""
    if shutil.which("rabbitmqctl") is None or _ctl("status").returncode != 0:
        pytest.fail("these tests need a local RabbitMQ administrable with rabbitmqctl")
    try:
        provision.BrokerAdmin(ADMIN_API).tracing()
    except provision.ProvisionError as err:
        pytest.fail(f"these tests need RabbitMQ's management API on 127.0.0.1:15672: {err}")


@pytest.mark.slow
def test_a_host_with_nothing_to_hand_back_leaves_with_exit_0_while_a_round_is_held(tmp_path: Path) -> None:
    """Deterministic: ``c1`` serves no device, so its leave is done the moment the server hears it;
    the server deletes its user (the broker force-closes its connection) with the round still held.
    Before the fix the host reconnected as its deleted user until its budget ran out: exit 3."""
    _leave_with_a_round_held(tmp_path, pins="0-7")


@pytest.mark.slow
def test_a_host_that_hands_its_devices_back_leaves_with_exit_0_after_a_held_round(tmp_path: Path) -> None:
    """The scale-down of the clean-clone CI run: ``c1`` is told to leave while the round is held, hands
    its devices back once the round ends, and exits 0 however the deletion of its user races its
    last ack and heartbeat; the run completes."""
    _leave_with_a_round_held(tmp_path, pins=None)


# -- a server restart: the host users made before it ----------------------------------------------
def _users(prefix: str) -> set[str]:
    """The broker's users of a deployment, read from the management API directly (not through the
    code under test; rabbitmqctl would take half a second a call)."""
    parts = urllib.parse.urlsplit(ADMIN_API)
    req = urllib.request.Request(f"{parts.scheme}://{parts.hostname}:{parts.port}/api/users")
    token = base64.b64encode(f"{parts.username}:{parts.password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return {u["name"] for u in json.loads(r.read()) if u["name"].startswith(prefix)}


def test_a_restarted_server_deletes_the_host_users_made_before_it_and_keeps_the_live_ones(
    tmp_path: Path,
) -> None:
    """A strict server makes two hosts' users, then dies without a word (a crash: no
    ``forget_hosts``). Its successor must find them on the broker: the user of the host that died
    with it is deleted once the first-heartbeat grace has passed; the live host, which heartbeats
    again as its own user, keeps its user and gets the new server's lease; the end of the run
    deletes that one too. Another experiment's host user on the same broker is never touched.
    Before the fix the restarted server knew nothing of them: both lived until deleted by hand."""
    _need_admin_api()
    experiment = f"rs{uuid.uuid4().hex[:8]}"
    dep = Deployment(experiment)
    transports: list[AmqpTransport] = []

    def server(run_dir: Path, exp: Experiment, admin: provision.BrokerAdmin) -> Server:
        transport = AmqpTransport(dep.url(identity.server_user()), experiment)
        transports.append(transport)
        return Server(transport, exp, run_dir, experiment_id=experiment, admin=admin)

    try:
        admin = provision.BrokerAdmin(ADMIN_API, vhost=dep.vhost)
        cfg = load_config(write_config(tmp_path / "c.yaml", hosts={"lease_timeout_s": 120}))
        exp = Experiment.build(cfg)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        first = server(run_dir, exp, admin)
        replies: list[JoinReply] = []
        errors: list[BaseException] = []

        def join_two() -> None:
            try:
                for hint in ("gone", "alive"):
                    replies.append(provision.join(dep.url(identity.join_user()), experiment, hint=hint))
            except BaseException as err:
                errors.append(err)

        joining = threading.Thread(target=join_two, daemon=True)
        joining.start()
        while joining.is_alive():
            first.turn(0.05)
        assert not errors, errors
        gone, alive = replies
        transports[0].close()  # the crash: the first server deletes nothing
        assert {gone.user, alive.user} <= _users(dep.prefix)
        # another experiment's host user on the same broker, with the same user prefix
        stranger = admin.create_host_user(f"{experiment}b", "hstranger", uuid.uuid4().hex)

        second = server(run_dir, exp, admin)
        second.first_heartbeat_grace_s = 2.0  # a dead host's user goes after this (5 min in a run)
        host = AmqpTransport(dep.url(alive.user, alive.password), experiment, declare_topology=False)
        transports.append(host)
        queue = host.names.client_queue(alive.host_id)
        got: list[Delivery] = []
        host.declare_queue(queue, [KEY_CLIENTS, key_host(alive.host_id)])
        host.consume(queue, got.append, prefetch=8)
        beat = Heartbeat(host_id=alive.host_id, holding=[], epoch=-1)
        host.publish(KEY_SERVER, encode(Kind.HEARTBEAT, beat, exp=experiment, round=0, sender=alive.host_id))

        def turned(check: Any) -> Any:
            def both() -> bool:
                second.turn(0.05)
                host.process(0.05)
                return bool(check())

            return both

        wait_for(turned(lambda: gone.user not in _users(dep.prefix)), 60, "the dead host's user to go")
        users = _users(dep.prefix)
        assert alive.user in users and stranger in users
        assert alive.host_id in second.leases.table.hosts  # its heartbeat was taken, as its own user
        wait_for(turned(lambda: got), 30, "the live host to get the new server's lease")
        host.close()
        second.forget_hosts()  # the end of the run
        users = _users(dep.prefix)
        assert alive.user not in users and gone.user not in users
        assert stranger in users
    finally:
        for t in transports:
            t.close()
        dep.close()


def test_a_host_user_whose_permissions_cannot_be_set_is_not_left_behind() -> None:
    """A user made half-way (here its vhost does not exist, so its permissions are refused) is deleted
    again: without its topic permission no server would ever find it to delete it
    (``BrokerAdmin.host_ids``), and with vhost permissions but no topic ones it could bind any key."""
    _need_admin_api()
    admin = provision.BrokerAdmin(ADMIN_API, vhost=f"ff-missing-{uuid.uuid4().hex[:8]}")
    host_id, password = provision.new_host()
    with pytest.raises(provision.ProvisionError, match="permissions"):
        admin.create_host_user("t", host_id, password)
    assert identity.host_user(host_id) not in _users(identity.host_user(host_id))
