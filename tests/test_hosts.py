"""The device table: leases, balancing, expiry and the device store (services/server/hosts.py)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from services.server.hosts import DeviceStore, HostTable


def _ack_all(table: HostTable, now: float) -> None:
    for h in list(table.hosts.values()):
        table.heartbeat(h.host_id, now, epoch=table.epoch)


def _invariants(table: HostTable) -> None:
    holders: dict[int, str] = {}
    for h in table.hosts.values():
        for d in h.devices:
            assert d not in holders, f"device {d} leased to {holders[d]} and {h.host_id}"
            holders[d] = h.host_id
            if h.capacity is not None:
                assert len(h.devices) <= h.capacity
            if h.memory_bytes is not None:
                assert table.need.get(d, 0) <= h.memory_bytes
    assert holders == table.lease


hosts_spec = st.lists(
    st.tuples(st.one_of(st.none(), st.integers(1, 30)), st.booleans()), min_size=1, max_size=6
)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), hosts=hosts_spec, events=st.lists(st.integers(0, 2), max_size=8))
def test_every_device_is_leased_once_within_capacity_and_balanced(
    n: int, hosts: list[tuple[int | None, bool]], events: list[int]
) -> None:
    table = HostTable(range(n))
    for i, (capacity, _) in enumerate(hosts):
        table.heartbeat(f"h{i}", 0.0, capacity=capacity)
    table.rebalance()
    _invariants(table)
    # joins, leaves and crashes, then a rebalance each time
    for k, event in enumerate(events):
        live = [h for h in table.hosts.values() if not h.draining]
        if event == 0 or not live:
            table.heartbeat(f"new{k}", float(k), capacity=None)
        elif event == 1:
            table.heartbeat(live[k % len(live)].host_id, float(k), leaving=True)
        else:
            table.remove(live[k % len(live)].host_id)
        table.rebalance()
        _invariants(table)
    live = [h for h in table.hosts.values() if not h.draining]
    uncapped = [h for h in live if h.capacity is None]
    if uncapped:  # room for everyone: every device is served, by the live hosts only
        assert set(table.lease) == set(range(n))
        assert all(not h.devices for h in table.hosts.values() if h.draining)
    if live and all(h.capacity is None for h in live):  # equal hosts differ by at most one device
        sizes = [len(h.devices) for h in live]
        assert max(sizes) - min(sizes) <= 1


def test_pinned_hosts_serve_exactly_their_devices_and_others_share_the_rest() -> None:
    table = HostTable(range(10))
    table.heartbeat("pinned", 0.0, pinned=[0, 1, 2])
    table.heartbeat("a", 0.0)
    table.heartbeat("b", 0.0)
    table.rebalance()
    assert table.hosts["pinned"].devices == {0, 1, 2}
    assert table.hosts["a"].devices | table.hosts["b"].devices == set(range(3, 10))
    assert abs(len(table.hosts["a"].devices) - len(table.hosts["b"].devices)) <= 1


def test_a_joining_host_takes_a_share_and_the_others_keep_the_rest() -> None:
    table = HostTable(range(8))
    table.heartbeat("a", 0.0)
    table.heartbeat("b", 0.0)
    table.rebalance()
    before = {h: set(table.hosts[h].devices) for h in ("a", "b")}
    table.heartbeat("c", 1.0)
    plan = table.rebalance()
    assert len(table.hosts["c"].devices) >= 2
    for h in ("a", "b"):  # nothing moves between the old hosts: they only give to the newcomer
        assert table.hosts[h].devices <= before[h]
    assert plan.changed["c"] == table.hosts["c"].devices  # all of its devices are new to it


def test_devices_count_as_available_only_once_their_host_applied_the_lease() -> None:
    table = HostTable(range(4))
    table.heartbeat("a", 0.0)
    table.rebalance()
    assert table.available() == [] and not table.settled()
    table.heartbeat("a", 0.1, epoch=table.epoch)
    assert table.available() == [0, 1, 2, 3] and table.settled()


def test_a_silent_host_expires_and_its_devices_go_to_the_others() -> None:
    table = HostTable(range(6))
    table.heartbeat("a", 0.0)
    table.heartbeat("b", 0.0)
    table.rebalance()
    _ack_all(table, 0.0)
    table.heartbeat("a", 5.0)  # b stays silent
    gone = table.expire(now=5.0, timeout_s=3.0)
    assert [h.host_id for h in gone] == ["b"] and table.dirty
    assert table.available() == sorted(table.hosts["a"].devices)
    table.rebalance()
    _ack_all(table, 5.0)
    assert table.hosts["a"].devices == set(range(6)) and table.available() == list(range(6))


def test_a_leaving_host_gets_an_empty_lease_and_is_done_once_it_applied_it() -> None:
    table = HostTable(range(4))
    table.heartbeat("a", 0.0)
    table.heartbeat("b", 0.0)
    table.rebalance()
    _ack_all(table, 0.0)
    table.heartbeat("b", 1.0, leaving=True)
    assert table.done_draining() == []
    table.rebalance()
    assert table.hosts["b"].devices == set() and table.hosts["a"].devices == set(range(4))
    assert table.done_draining() == []  # not before it applied the empty lease
    _ack_all(table, 1.0)
    assert [h.host_id for h in table.done_draining()] == ["b"]


def test_devices_too_large_for_every_host_stay_unplaced() -> None:
    table = HostTable(range(4), need={0: 100, 1: 100, 2: 5_000, 3: 100})
    table.heartbeat("small", 0.0, memory_bytes=1_000)
    plan = table.rebalance()
    assert plan.unplaced == [2] and table.hosts["small"].devices == {0, 1, 3}


def test_a_host_that_held_devices_before_a_server_restart_keeps_them_and_must_acknowledge() -> None:
    table = HostTable(range(4))  # a fresh server: empty table
    table.heartbeat("a", 0.0, holding=[0, 1], epoch=-1)
    table.heartbeat("b", 0.0, holding=[2, 3], epoch=-1)
    plan = table.rebalance()
    assert table.hosts["a"].devices == {0, 1} and table.hosts["b"].devices == {2, 3}
    assert set(plan.changed) == {"a", "b"}  # unchanged sets, but this server's lease is new to them
    assert not table.settled()


def test_the_device_store_replaces_a_devices_files(tmp_path: Path) -> None:
    store = DeviceStore(tmp_path / "device-state")
    assert store.load(3) == {}
    store.save(3, {"spafl-1.npz": b"one", "spafl.first": b"1"})
    store.save(3, {"spafl-2.npz": b"two", "spafl.first": b"1"})
    assert store.load(3) == {"spafl-2.npz": b"two", "spafl.first": b"1"}


class _Admin:
    """Stands in for RabbitMQ's management API (``shared.provision.BrokerAdmin``): records the users."""

    def __init__(self) -> None:
        self.users: set[str] = set()

    def create_host_user(self, experiment: str, host_id: str, password: str) -> str:
        self.users.add(host_id)
        return f"fedfleet-host-{host_id}"

    def delete_host(self, experiment: str, host_id: str) -> None:
        self.users.discard(host_id)

    def host_ids(self, experiment: str) -> list[str]:
        return sorted(self.users)


def test_a_host_killed_between_its_join_answer_and_its_first_heartbeat_loses_its_broker_user(
    tmp_path: Path,
) -> None:
    """A host user the server made lives as long as its host heartbeats. One whose host never did
    (a SIGKILL right after the join answer) is deleted once ``FIRST_HEARTBEAT_GRACE_S`` has passed:
    before, it lived, with its permissions, until the run's end; one whose host heartbeats stays."""
    import time
    from typing import Any

    from services.server.service import FIRST_HEARTBEAT_GRACE_S, Server
    from shared.config import load_config
    from shared.experiment import Experiment
    from shared.schemas import Join, Kind, decode, encode
    from shared.transport import KEY_JOIN, Delivery
    from shared.transport.inproc import InprocBroker, InprocTransport
    from tests.conftest import write_config

    cfg = load_config(write_config(tmp_path / "c.yaml"))
    admin = _Admin()
    (tmp_path / "run").mkdir()
    transport = InprocTransport(InprocBroker(), "joins", "fedfleet-server")
    server = Server(transport, Experiment.build(cfg), tmp_path / "run", experiment_id="joins", admin=admin)  # type: ignore[arg-type]
    replies: list[Any] = []
    server.transport.publish_reply = lambda reply_to, body: replies.append(decode(body, max_bytes=1 << 20)[1])  # type: ignore[method-assign]
    for hint in ("killed", "alive"):
        data = encode(Kind.JOIN, Join(hint=hint), exp="joins", round=0, sender="")
        env, msg = decode(data, max_bytes=1 << 20, exp="joins")
        server.on_join(
            env,
            msg,
            Delivery(body=data, routing_key=KEY_JOIN, redelivered=False, reply_to="amq.rabbitmq.reply-to.x"),
        )
    killed, alive = (r.host_id for r in replies)
    assert admin.users == {killed, alive}
    now = time.time()
    server._check_hosts(now + FIRST_HEARTBEAT_GRACE_S / 2)
    assert admin.users == {killed, alive}  # a host may take a while to connect and heartbeat
    late = now + FIRST_HEARTBEAT_GRACE_S + 1
    server.leases.table.heartbeat(alive, late)
    server._check_hosts(late)
    assert admin.users == {alive}
    assert set(server.provisioned) == {alive}


def test_a_server_stopped_mid_run_leaves_its_host_users_to_its_successor(tmp_path: Path) -> None:
    """As ``fedfleet server`` ends: a run stopped mid-way (SIGTERM) keeps its hosts' broker users,
    since its hosts go on and the next server takes the users over; a run that is over deletes
    them. (Before, every exit deleted them, cutting live hosts off in an upgrade.)"""
    from services.server.round import Phase
    from services.server.service import Server
    from shared.config import load_config
    from shared.experiment import Experiment
    from shared.transport.inproc import InprocBroker, InprocTransport
    from tests.conftest import write_config

    cfg = load_config(write_config(tmp_path / "c.yaml"))
    admin = _Admin()
    admin.users = {"h1", "h2"}  # made by this server or one before it
    (tmp_path / "run").mkdir()
    transport = InprocTransport(InprocBroker(), "stops", "fedfleet-server")
    server = Server(transport, Experiment.build(cfg), tmp_path / "run", experiment_id="stops", admin=admin)  # type: ignore[arg-type]
    assert set(server.provisioned) == {"h1", "h2"}  # taken over at start
    server.stopped = True  # SIGTERM, mid-registration
    server.release_host_users()
    assert admin.users == {"h1", "h2"}
    server.phase = Phase.DONE  # a run that is over (finished, or failed: ``_fail``)
    server.release_host_users()
    assert admin.users == set()


def test_host_users_found_at_start_count_towards_the_hosts_cap_once_their_hosts_heartbeat(
    tmp_path: Path,
) -> None:
    """A server refuses a join when it already has a host per device (``too-many-hosts``). Users
    it found on the broker at start (``_adopt_host_users``) count only once their hosts heartbeat:
    until then they may be those of hosts that died with the old server, and a host that joins
    meanwhile must not be turned away for them."""
    from typing import Any

    from services.server.service import Server
    from shared.config import load_config
    from shared.experiment import Experiment
    from shared.schemas import Join, Kind, decode, encode
    from shared.transport import KEY_JOIN, Delivery
    from shared.transport.inproc import InprocBroker, InprocTransport
    from tests.conftest import write_config

    cfg = load_config(write_config(tmp_path / "c.yaml"))  # 8 devices
    admin = _Admin()
    admin.users = {f"old{i}" for i in range(cfg.num_devices)}  # a host per device, before a restart
    (tmp_path / "run").mkdir()
    transport = InprocTransport(InprocBroker(), "cap", "fedfleet-server")
    server = Server(transport, Experiment.build(cfg), tmp_path / "run", experiment_id="cap", admin=admin)  # type: ignore[arg-type]
    replies: list[Any] = []
    server.transport.publish_reply = lambda reply_to, body: replies.append(decode(body, max_bytes=1 << 20)[1])  # type: ignore[method-assign]

    def join() -> bool:
        before = len(replies)
        data = encode(Kind.JOIN, Join(hint="new"), exp="cap", round=0, sender="")
        env, msg = decode(data, max_bytes=1 << 20, exp="cap")
        d = Delivery(body=data, routing_key=KEY_JOIN, redelivered=False, reply_to="amq.rabbitmq.reply-to.x")
        server.on_join(env, msg, d)
        return len(replies) > before

    assert join()  # no found user's host has heartbeat: the new host gets a user
    for i in range(cfg.num_devices - 1):
        server.leases.table.heartbeat(f"old{i}", 0.0)
    assert not join()  # 7 found hosts heartbeat, and the new one joined: a host per device
    assert len(admin.users) == cfg.num_devices + 1
