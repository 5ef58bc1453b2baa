"""Idle registered devices cost next to nothing (issue 16): memory bounds on per-device state.

Each process keeps something per registered device: the server its lease table, a client host the
ids it serves, an aggregator each device's sample limit. These tests measure what that state holds
for many devices (``tracemalloc``: Python objects and numpy buffers alike) and bound it per device,
so a ``dict``/``set`` of Python ints (60-150 bytes per device) coming back fails here. Memory bounds,
not timings.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from services.aggregator.service import registered_samples
from services.server.hosts import HostTable
from services.server.registry import DeviceNeed
from shared.data.partitioning import SampledPartition
from shared.devices import LazyFleet, build_fleet
from shared.experiment import Experiment, HostedData

N = 40_000


def _retained(make: Callable[[], Any]) -> tuple[Any, int]:
    """What ``make()`` returns and the bytes it still holds once made (its temporaries freed)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        made = make()
        gc.collect()
        return made, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_the_lease_table_holds_a_few_bytes_per_device() -> None:
    """The server's table after leasing every device to 4 hosts (as at registration): 4 bytes of
    holder slot and 8 of host membership per device; dicts and sets of ints held ~250."""

    def leased(n: int = N) -> HostTable:
        table = HostTable(range(n))
        for i in range(4):
            table.heartbeat(f"client-{i}", 0.0)
        table.rebalance()
        for h in list(table.hosts.values()):
            table.heartbeat(h.host_id, 0.0, epoch=table.epoch)
        return table

    leased(100)  # the modules balancing imports on first use (numpy's) are not the table's
    table, held = _retained(leased)
    assert held / N <= 24, f"{held / N:.1f} bytes per device"
    # and it is the same table: every device once, balanced, all available
    assert sorted(table.lease) == list(range(N)) and len(table.available()) == N
    assert sorted(len(h.devices) for h in table.hosts.values()) == [N // 4] * 4
    assert table.lease[5] == table.host_of(5) and 5 in table.hosts[table.lease[5]].devices


def test_the_memory_each_device_needs_is_made_on_first_use_as_one_array() -> None:
    fleet = cast(
        LazyFleet,
        build_fleet({"preset": "mobile"}, 300, full_footprint_bytes=3_000_000, seed=1, lazy=True),
    )
    need = DeviceNeed(fleet, 3_000_000)
    assert need._values is None  # nothing made until a host with a memory limit asks
    expected = {d.device_id: min(d.profile.memory_bytes, 3_000_000) for d in fleet}
    assert dict(need) == expected and need.get(10**6, 0) == 0
    assert need._values is not None and need._values.nbytes == 8 * 300


def test_a_host_holds_a_byte_per_fleet_device_for_the_devices_it_serves() -> None:
    """A host serving a quarter of the fleet: one flag per fleet device, not a set of ints."""
    exp = cast(Experiment, SimpleNamespace(cfg=SimpleNamespace(num_devices=4 * N)))

    def serving() -> HostedData:
        hosted = HostedData(exp)
        for d in range(0, 4 * N, 4):
            hosted.add(d)
        return hosted

    hosted, held = _retained(serving)
    assert held / N <= 8, f"{held / N:.1f} bytes per served device"
    assert len(hosted) == N and 8 in hosted and 9 not in hosted and list(hosted)[:3] == [0, 4, 8]


def test_an_aggregator_keeps_no_sample_limit_per_device() -> None:
    partitions = SampledPartition(pool=1000, num_devices=N, per_device=6, seed=0)
    exp = cast(Experiment, SimpleNamespace(partitions=partitions, cfg=SimpleNamespace(num_devices=N)))
    limits, held = _retained(lambda: registered_samples(exp))
    assert held / N <= 1, f"{held / N:.1f} bytes per device"
    assert len(limits) == N and limits[N - 1] == 6 and limits.get(N) is None
    with pytest.raises(KeyError):
        _ = limits[-1]


def test_making_a_device_without_the_cache_gives_the_same_device_and_keeps_none() -> None:
    """A host taking a lease makes each new device's profile once; it must not fill the cache the
    round's devices use (at 100,000 devices: 4,096 idle profiles of ~2 KB in every host)."""
    fleet = cast(
        LazyFleet,
        build_fleet({"preset": "mobile"}, 50, full_footprint_bytes=3_000_000, seed=1, lazy=True),
    )
    made = [fleet.make(d) for d in range(50)]
    assert len(fleet._recent) == 0
    assert made == [fleet[d] for d in range(50)]


def test_the_devices_csv_of_a_large_fleet_is_written_without_an_object_per_device(tmp_path: Path) -> None:
    """At the end of a run the server writes one row per registered device: the rows of untouched
    devices are made as they are written, never all held at once (~300 bytes each as objects)."""
    from services.server.ledger import RunLedger
    from services.server.registry import DeviceRegistry
    from shared.devices.fleet import PRESETS

    tiers = PRESETS["mobile"]
    names = list(tiers)
    fleet = LazyFleet(
        tiers, [names[d % len(names)] for d in range(N)], full_footprint_bytes=3_000_000, seed=0, where="t"
    )
    registry = DeviceRegistry(fleet, SampledPartition(pool=1000, num_devices=N, per_device=6, seed=0))
    ledger = RunLedger("idle", "fedavg")
    ledger.registered(registry)
    ledger.stats(7).selected = 2  # a touched device keeps its statistics
    small = RunLedger("warm-up", "fedavg")  # the first write imports the plotting modules
    (tmp_path / "warm").mkdir()
    small.write(tmp_path / "warm", {}, {}, None, "warm-up")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ledger.write(tmp_path, {}, {}, None, "idle")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak / N <= 60, f"{peak / N:.1f} bytes per device at the peak of the write"
    lines = (tmp_path / "devices.csv").read_text().splitlines()
    assert len(lines) == N + 1 and lines[8].startswith(f"7,{names[7 % len(names)]},2,")
    assert [int(line.split(",")[0]) for line in lines[1:]] == list(range(N))


def test_who_is_online_from_the_kept_chances_is_who_is_online_from_the_profiles() -> None:
    """Selection reads each device's p_online once into an array; the devices it finds online in a
    round are the ones ``is_online`` finds, traced devices (which keep asking it) included."""
    import numpy as np

    from services.server.registry import OnlineChances
    from shared.devices import is_online

    lazy = build_fleet({"preset": "mobile"}, 400, full_footprint_bytes=3_000_000, seed=3, lazy=True)
    listed = list(lazy)
    for d in range(0, 400, 7):  # a few devices with an on/off trace, in a plain list fleet
        listed[d] = listed[d].model_copy(
            update={"profile": listed[d].profile.model_copy(update={"trace": [1, 0, 0]})}
        )
    ids = np.arange(400, dtype=np.int64)
    for fleet in (lazy, listed):
        chances = OnlineChances(fleet)
        for rnd in range(1, 7):
            expected = [is_online(fleet[d], rnd, 11) for d in range(400)]
            assert chances.online(ids, rnd, 11).tolist() == expected
    assert not is_online(listed[7], 2, 11)  # the trace has it offline in round 2: it counted
