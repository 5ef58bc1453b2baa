"""Lean processes (issue 16): what each process holds, checked by what it imports and keeps.

An aggregator only adds arrays, so it must not import torch (hundreds of MiB per process); the checks
run in a fresh interpreter, since this test process has long imported torch itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.config import load_config
from shared.experiment import Experiment

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _python(code: str, cache: Path) -> str:
    """Run ``code`` in a fresh interpreter (this repository on its path, ``cache`` as the fedfleet
    cache) and return what it printed."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "FEDFLEET_CACHE_DIR": str(cache),
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_the_aggregator_imports_no_torch(tmp_path: Path) -> None:
    out = _python(
        """
        import sys
        import services.aggregator.service
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """,
        tmp_path,
    )
    assert out.strip() == "[]"


def test_a_fedavg_aggregator_builds_and_reduces_without_torch(tmp_path: Path) -> None:
    """What ``fedfleet aggregator`` builds (``services.cli._aggregation``) for FedAvg: a strategy that
    validates and reduces a model-shaped update, with torch never imported in that process."""
    out = _python(
        f"""
        import json, sys
        import numpy as np
        from services.aggregator.service import registered_samples
        from services.cli import _aggregation
        from shared import codec
        from shared.algorithms.base import Partial, UpdateSpec
        from shared.config import load_config

        exp, strategy = _aggregation(load_config({str(QUICKSTART)!r}), "quickstart")
        shapes = strategy.ctx.layout().shapes(floats_only=True)
        update = UpdateSpec({{k: codec.Dense(np.ones(s, np.float32)) for k, s in shapes.items()}}, 3)
        strategy.validate_update(update)
        partial = strategy.reduce(Partial(), update)
        print(json.dumps({{
            "torch": "torch" in sys.modules,
            "shapes": {{k: list(s) for k, s in shapes.items()}},
            "weight": partial.scalars["weight"],
            "sum": float(sum(a.sum() for a in partial.arrays.values())),
            "limits": len(registered_samples(exp)),
        }}))
        """,
        tmp_path,
    )
    got = json.loads(out)
    assert got["torch"] is False
    # the same layout as the model the other processes build with torch
    full = Experiment.build(load_config(QUICKSTART)).strategy.ctx.layout().shapes(floats_only=True)
    assert {k: tuple(s) for k, s in got["shapes"].items()} == full
    assert got["weight"] == 3.0
    assert got["sum"] == pytest.approx(3.0 * sum(int(np.prod(s)) for s in full.values()))
    assert got["limits"] == 20
    assert list((tmp_path / "state-spec").glob("*.json")), "the layout is cached for the next process"


def test_an_aggregation_only_strategy_refuses_to_build_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDFLEET_CACHE_DIR", str(tmp_path))
    strategy = Experiment.build(load_config(QUICKSTART)).aggregation_strategy
    with pytest.raises(RuntimeError, match="aggregation only"):
        strategy.ctx.model_factory()


# -- the dataset: decoded once, memory-mapped read-only -------------------------------------------
def _idx_dataset(directory: Path, n_train: int = 40, n_test: int = 10) -> Path:
    """Four small Fashion-MNIST-format IDX files."""
    from shared.data import encode_idx

    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        (directory / f"{split}-images-idx3-ubyte").write_bytes(encode_idx(images))
        (directory / f"{split}-labels-idx1-ubyte").write_bytes(encode_idx(labels))
    return directory


def test_a_file_dataset_is_decoded_once_and_mapped_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.data import datasets

    source = _idx_dataset(tmp_path / "fmnist")
    monkeypatch.setenv("FEDFLEET_CACHE_DIR", str(tmp_path / "cache"))
    plain = datasets.load_dataset("fashion-mnist", source, cache=False)
    first = datasets.load_dataset("fashion-mnist", source)

    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached dataset must not be decoded again")

    monkeypatch.setattr(datasets, "_load_idx_dataset", no_decoding)
    again = datasets.load_dataset("fashion-mnist", source)
    for ds in (first, again):
        for name in ("x_train", "y_train", "x_test", "y_test"):
            arr = getattr(ds, name)
            assert isinstance(arr, np.memmap) and not arr.flags.writeable, name
            np.testing.assert_array_equal(arr, getattr(plain, name))
            assert arr.dtype == getattr(plain, name).dtype
        assert ds.num_classes == plain.num_classes
    assert len(list((tmp_path / "cache" / "datasets").iterdir())) == 1


def test_a_changed_source_file_is_decoded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.data import encode_idx, load_dataset

    source = _idx_dataset(tmp_path / "fmnist")
    monkeypatch.setenv("FEDFLEET_CACHE_DIR", str(tmp_path / "cache"))
    before = load_dataset("fashion-mnist", source)
    labels = np.zeros(40, dtype=np.uint8)
    (source / "train-labels-idx1-ubyte").write_bytes(encode_idx(labels))
    after = load_dataset("fashion-mnist", source)
    assert before.y_train.any() and not after.y_train.any()


def test_an_unwritable_cache_still_loads_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache that cannot be written is not an error (the dataset is decoded in memory), but the
    user is told why every process now holds its own copy."""
    from shared.data import load_dataset

    source = _idx_dataset(tmp_path / "fmnist")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # the cache directory cannot be created below a file
    monkeypatch.setenv("FEDFLEET_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level("WARNING", logger="shared.data.datasets"):
        ds = load_dataset("fashion-mnist", source)
    assert len(ds.y_train) == 40 and not isinstance(ds.x_train, np.memmap)
    assert "not writable" in caplog.text and "FEDFLEET_CACHE_DIR" in caplog.text


def test_stale_cache_entries_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries whose sources changed or are gone (a test's temporary files, a deleted clone's venv)
    can never be hit again: the next write removes them, so the cache does not grow without end."""
    import shutil

    from shared.data import encode_idx, load_dataset

    monkeypatch.setenv("FEDFLEET_CACHE_DIR", str(tmp_path / "cache"))
    entries = tmp_path / "cache" / "datasets"
    changed = _idx_dataset(tmp_path / "changed")
    gone = _idx_dataset(tmp_path / "gone")
    kept = _idx_dataset(tmp_path / "kept")
    for source in (changed, gone, kept):
        load_dataset("fashion-mnist", source)
    assert len(list(entries.iterdir())) == 3
    (changed / "train-labels-idx1-ubyte").write_bytes(encode_idx(np.zeros(40, dtype=np.uint8)))
    shutil.rmtree(gone)
    (stray := entries / "fashion-mnist-from-an-older-version").mkdir()  # no sources file
    load_dataset("fashion-mnist", changed)  # a new entry: the stale ones go
    left = sorted(e.name for e in entries.iterdir())
    assert len(left) == 2 and stray.name not in left
    assert not load_dataset("fashion-mnist", changed).y_train.any()
    assert load_dataset("fashion-mnist", kept).y_train.any()  # the live entry survived, still a hit
    assert len(list(entries.iterdir())) == 2


# -- partitions: the same indices, held compactly; hosted devices hold ids only --------------------
@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes", "shards"])
def test_the_packed_partition_has_the_same_indices(scheme: str) -> None:
    from shared.data import IndexPartition, partition

    labels = np.random.default_rng(1).integers(0, 10, 500)
    parts = partition(labels, 37, scheme, seed=5)
    packed = IndexPartition(parts)
    assert len(packed) == 37
    for d, p in enumerate(parts):
        np.testing.assert_array_equal(packed[d], p)
        assert packed.size(d) == len(p)
        assert not packed[d].flags.writeable
    np.testing.assert_array_equal(packed[-1], parts[-1])
    with pytest.raises(IndexError):
        _ = packed[37]


def test_hosted_data_keeps_ids_and_slices_on_demand() -> None:
    from shared.experiment import HostedData

    exp = Experiment.build(load_config(QUICKSTART))
    hosted = HostedData(exp)
    hosted.add(3)
    hosted.add(7)
    assert sorted(hosted) == [3, 7] and 3 in hosted and 4 not in hosted and len(hosted) == 2
    expected = exp.device_data(3)
    np.testing.assert_array_equal(hosted[3].x_train, expected.x_train)
    np.testing.assert_array_equal(hosted[3].y_train, expected.y_train)
    del hosted[3]
    with pytest.raises(KeyError):
        _ = hosted[3]
    hosted.clear()
    assert not hosted


# -- the sampled scheme: more devices than samples ------------------------------------------------
def test_sampled_devices_draw_distinct_samples_from_their_seed() -> None:
    from shared.data import SampledPartition

    p = SampledPartition(pool=50, num_devices=1000, per_device=8, seed=2)
    assert len(p) == 1000
    draws = [p[d] for d in range(1000)]
    for d in draws:
        assert len(d) == 8 and len(np.unique(d)) == 8  # distinct within a device
        assert d.min() >= 0 and d.max() < 50
    np.testing.assert_array_equal(p[123], SampledPartition(50, 1000, 8, 2)[123])  # from the seed
    assert any(not np.array_equal(draws[0], d) for d in draws[1:])
    assert len(np.unique(np.concatenate(draws))) == 50  # a thousand devices share the 50 samples
    assert p.size(999) == 8


def test_a_sampled_device_draws_with_replacement_only_when_it_must() -> None:
    from shared.data import SampledPartition

    d = SampledPartition(pool=5, num_devices=3, per_device=12, seed=0)[1]
    assert len(d) == 12 and set(d.tolist()) <= set(range(5))


def test_a_sampled_fleet_may_be_larger_than_the_dataset() -> None:
    from shared.config import parse_config

    raw = load_config(QUICKSTART).model_dump(mode="json")
    raw.update(num_devices=5000, devices_per_round=10)
    raw["dataset"] = {**raw["dataset"], "partition": "sampled", "samples_per_device": 6}
    exp = Experiment.build(parse_config(raw))
    assert exp.cfg.num_devices > len(exp.train_y)
    data = exp.device_data(4321)
    assert len(data.y_train) == 6
    np.testing.assert_array_equal(data.x_train, exp.train_x[exp.partitions[4321]])


def test_samples_per_device_belongs_to_the_sampled_scheme() -> None:
    from shared.config import ConfigError, parse_config

    raw = load_config(QUICKSTART).model_dump(mode="json")
    raw["dataset"] = {**raw["dataset"], "samples_per_device": 6}
    with pytest.raises(ConfigError, match="sampled only"):
        parse_config(raw)


# -- device profiles made from the seed on demand -------------------------------------------------
@pytest.mark.parametrize("spec", [{"preset": "mobile"}, {"preset": "mobile", "assignment": "blocks"}])
def test_a_lazy_fleet_has_the_devices_the_list_has(spec: dict[str, str]) -> None:
    from shared.devices import LazyFleet, build_fleet

    listed = build_fleet(spec, 3000, full_footprint_bytes=10**7, seed=4)
    lazy = build_fleet(spec, 3000, full_footprint_bytes=10**7, seed=4, lazy=True)
    assert isinstance(lazy, LazyFleet) and len(lazy) == 3000
    assert list(lazy) == list(listed)  # equal profiles, in id order
    assert lazy[2999] == listed[2999] and lazy[-1] == listed[-1] and lazy[10:13] == list(listed[10:13])
    assert len(lazy._recent) <= LazyFleet.CACHE  # it keeps only the recently used ones


def test_the_experiment_fleet_is_lazy() -> None:
    from shared.config import parse_config
    from shared.devices import LazyFleet

    raw = load_config(QUICKSTART).model_dump(mode="json")
    raw["fleet"] = {"preset": "mobile"}
    exp = Experiment.build(parse_config(raw))
    assert isinstance(exp.fleet, LazyFleet)


def test_a_hosted_device_keeps_at_most_its_declared_resident_bytes() -> None:
    """What a host tells the server a device costs (``per_device_bytes``, which sizes its capacity
    under a memory limit) bounds what serving one more device really takes: measured over 20,000."""
    import tracemalloc

    from services.client.service import per_device_bytes
    from shared.experiment import HostedData

    exp = Experiment.build(load_config(QUICKSTART))
    hosted = HostedData(exp)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for device in range(100_000, 120_000):
        hosted.add(device)
    per_device = (tracemalloc.get_traced_memory()[0] - before) / 20_000
    tracemalloc.stop()
    assert 0 < per_device <= per_device_bytes(exp)


# -- held updates: on disk until the server's go ---------------------------------------------------
def test_held_updates_wait_on_disk_and_go_out_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With over-selection a host holds every trained update until the round's ``go`` (hundreds per
    host at 10,000 devices). It keeps only where each one's encoded message is; on ``go`` it sends
    exactly those bytes, once, and deletes them; a discarded one is deleted unsent. (FedAvg would
    report ``ready`` before training, ``test_deferred_training_...``: here it must train first.)"""
    from services.common import PublishItem, ServiceBase
    from services.orchestrator import InprocCluster
    from shared.algorithms.fedavg import FedAvg
    from shared.schemas import Kind, Updates, decode
    from tests.conftest import write_config

    monkeypatch.setattr(FedAvg, "update_before_training", lambda self, task, n: None)

    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", num_devices=12, devices_per_round=4, emulation={"over_selection": 2.0}
        )
    )
    (tmp_path / "run").mkdir()
    cluster = InprocCluster(Experiment.build(cfg), tmp_path / "run", "held", state_dir=tmp_path / "state")
    written: dict[Any, bytes] = {}  # each held update's bytes, read while it waited
    uploaded: list[bytes] = []
    publish_raw = ServiceBase.publish_raw

    def publish(self: ServiceBase, key: str, kind: Kind, data: bytes, *, dense_bytes: int = 0) -> int:
        if kind is Kind.UPDATE:
            uploaded.append(data)
        return publish_raw(self, key, kind, data, dense_bytes=dense_bytes)

    publish_many = ServiceBase._publish_many

    def batch(self: ServiceBase, items: list[PublishItem]) -> set[str]:
        # in virtual time a flush's uploads go out together (``publish_soon``), as one ``updates``
        for item in items:
            if item.kind is Kind.UPDATE:
                uploaded.append(item.data)
            elif item.kind is Kind.UPDATES:
                updates = decode(item.data, max_bytes=len(item.data))[1]
                assert isinstance(updates, Updates)
                uploaded.extend(updates.messages)
        return publish_many(self, items)

    def look() -> None:
        for client in cluster.clients:
            for held in client.held.values():
                fields = vars(held).values()
                assert not any(isinstance(v, (bytes, bytearray, memoryview)) for v in fields)
                written.setdefault((client.client_id, held.slot), client.spool.read(held.slot))

    monkeypatch.setattr(ServiceBase, "publish_raw", publish)
    monkeypatch.setattr(ServiceBase, "_publish_many", batch)
    try:
        assert cluster.run(on_step=look, max_steps=200_000) == 0
    finally:
        cluster.close()
    participants = sum(int(row["participants"]) for row in cluster.server.rows)
    assert written and 0 < participants == len(uploaded) < len(written)  # the surplus was never sent
    assert set(uploaded) <= set(written.values())  # sent as written
    assert len(set(uploaded)) == len(uploaded)  # each once
    for client in cluster.clients:  # nothing left behind: sent, discarded, or dropped at the stop
        assert not client.held and client.spool.files() == 0 and not any(client.spool.directory.glob("*"))


def _over_selected_run(tmp_path: Path, name: str, **emulation: Any) -> tuple[Any, list[int]]:
    """A FedAvg run with over-selection 2 (in process); the cluster after it and every trained device."""
    from services.orchestrator import InprocCluster
    from shared.algorithms.fedavg import FedAvg
    from tests.conftest import write_config

    cfg = load_config(
        write_config(
            tmp_path / f"{name}.yaml",
            num_devices=12,
            devices_per_round=4,
            rounds=3,
            emulation={"over_selection": 2.0, **emulation},
        )
    )
    (tmp_path / name).mkdir()
    cluster = InprocCluster(Experiment.build(cfg), tmp_path / name, "over", state_dir=tmp_path / f"{name}-s")
    trained: list[int] = []
    train = FedAvg.train

    def counting(self: FedAvg, task: Any, device: Any) -> Any:
        trained.append(device.device_id)
        return train(self, task, device)

    FedAvg.train = counting  # type: ignore[method-assign]
    try:
        assert cluster.run(max_steps=200_000) == 0
    finally:
        FedAvg.train = train  # type: ignore[method-assign]
        cluster.close()
    return cluster, trained


def test_deferred_training_trains_only_the_kept_devices_and_changes_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """FedAvg knows its update's size and FLOPs from the task, so in first-finishers rounds a host
    reports ``ready`` first and trains only the devices the ``go`` keeps. Against the same run with
    training first (every invited device trains, the surplus updates are thrown away): the same
    global model, the same rows (finish times, bytes, participants), fewer trainings."""
    from services.client.spool import Spool
    from shared.algorithms.fedavg import FedAvg

    spooled: list[object] = []  # every update written to a host's spool (held until its go)
    put = Spool.put

    def counting_put(self: Spool, *args: Any) -> Any:
        spooled.append(args)
        return put(self, *args)

    monkeypatch.setattr(Spool, "put", counting_put)
    with caplog.at_level("ERROR"):
        deferred, trained = _over_selected_run(tmp_path, "deferred")
    # every update was as large, and cost as many FLOPs, as its ready said
    assert not [r for r in caplog.records if "in ready" in r.getMessage()]
    assert not spooled  # nothing was trained ahead of its go, so nothing waited on disk
    with monkeypatch.context() as m:
        m.setattr(FedAvg, "update_before_training", lambda self, task, n: None)
        eager, trained_eagerly = _over_selected_run(tmp_path, "eager")
    participants = sum(int(row["participants"]) for row in deferred.server.rows)
    assert participants == len(trained) < len(trained_eagerly) == len(spooled)  # the surplus did not train
    for name, array in eager.server.state.arrays.items():
        np.testing.assert_array_equal(deferred.server.state.arrays[name], array, err_msg=name)
    # the wall clock, and the broker's bytes (hosts' heartbeats follow the wall clock): differ in any two runs
    drop = {"wall_seconds", "round_seconds", "broker_bytes"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in deferred.server.rows] == [
        {k: v for k, v in r.items() if k not in drop} for r in eager.server.rows
    ]


def test_real_time_rounds_still_train_before_ready(tmp_path: Path) -> None:
    """In real time a device's training duration is part of its finish time: nothing is deferred."""
    cluster, trained = _over_selected_run(tmp_path, "real", time_mode="real", time_factor=1000.0)
    selected = sum(int(row["selected"]) for row in cluster.server.rows)
    assert len(trained) == selected - sum(int(r["dropped"]) + int(r["rejected"]) for r in cluster.server.rows)


# -- the server's registry: views made on access ----------------------------------------------------
def _mobile_experiment(devices: int) -> Experiment:
    from shared.config import parse_config

    raw = load_config(QUICKSTART).model_dump(mode="json")
    raw["fleet"] = {"preset": "mobile"}
    raw["num_devices"] = devices
    raw["dataset"] = {**raw["dataset"], "partition": "sampled", "samples_per_device": 6}
    return Experiment.build(parse_config(raw))


def test_the_server_registry_makes_no_device_info_for_idle_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dict of ``DeviceInfo`` cost ~1.5 KB per registered device in the server (150 MiB at 100,000)
    and made every lazy profile; the registry makes one only when a device is looked up."""
    from services.server.service import Server
    from shared.schemas import DeviceInfo
    from shared.transport.inproc import InprocBroker, InprocTransport

    made: list[int] = []
    init = DeviceInfo.__init__

    def counting(self: DeviceInfo, **data: object) -> None:
        made.append(int(data["device_id"]))  # type: ignore[call-overload]
        init(self, **data)

    monkeypatch.setattr(DeviceInfo, "__init__", counting)
    exp = _mobile_experiment(3000)
    server = Server(InprocTransport(InprocBroker(), "registry"), exp, tmp_path, experiment_id="registry")
    assert made == [] and len(server.registry) == 3000
    assert server.ledger.devices == {} and server.ledger.stats(2999).tier == exp.fleet[2999].tier
    tasks = server.strategy.plan(server.state, 1, [3, 1500], server.registry)
    assert sorted(tasks) == [3, 1500] and len(made) <= 2


def test_the_registry_has_the_values_the_dict_had() -> None:
    """Equal ``DeviceInfo`` values, in id order, to the dict the server built before (the same plans)."""
    from collections import Counter

    from services.server.service import Server
    from shared.schemas import DeviceInfo

    exp = _mobile_experiment(700)
    registry = Server._device_infos(exp)
    before = {
        d.device_id: DeviceInfo(
            device_id=d.device_id,
            tier=d.tier,
            num_samples=len(exp.partitions[d.device_id]),
            profile=d.profile.model_dump(mode="json"),
        )
        for d in exp.fleet
    }
    assert list(registry) == list(before) and dict(registry) == before
    assert registry[np.int64(5)] == before[5]  # type: ignore[index]
    assert registry.get(700) is None and -1 not in registry
    assert registry.tier_counts() == dict(Counter(info.tier for info in before.values()))
    assert [registry.tier(d) for d in registry] == [info.tier for info in before.values()]


def test_the_ledger_writes_every_registered_device_but_holds_only_touched_ones(tmp_path: Path) -> None:
    """``devices.csv`` and the per-tier summary still list every registered device (untouched ones
    with zeros), while the ledger keeps statistics only for devices something happened to."""
    import csv
    from collections import Counter

    from services.server.service import Server
    from shared.transport.inproc import InprocBroker, InprocTransport

    exp = _mobile_experiment(500)
    server = Server(InprocTransport(InprocBroker(), "ledger"), exp, tmp_path, experiment_id="ledger")
    ledger = server.ledger
    ledger.stats(7).selected += 1
    ledger.task_sent(7, 1000)
    assert sorted(ledger.devices) == [7]
    ledger.write(tmp_path, {}, {"w": np.zeros(2)}, None, "t")
    with (tmp_path / "devices.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["device_id"]) for r in rows] == list(range(500))
    assert [r["tier"] for r in rows] == [exp.fleet[d].tier for d in range(500)]
    assert rows[7]["selected"] == "1" and rows[7]["bytes_down"] == "1000" and rows[8]["selected"] == "0"
    tiers = json.loads((tmp_path / "summary.json").read_text())["tiers"]
    assert {t: v["devices"] for t, v in tiers.items()} == dict(Counter(exp.fleet[d].tier for d in range(500)))
    assert sum(v["selected"] for v in tiers.values()) == 1
    assert sum(v["bytes_down"] for v in tiers.values()) == 1000
    assert list(ledger.devices) == [7]  # writing made the others' rows, not their objects


def test_partial_add_sums_in_place_only_into_arrays_it_owns() -> None:
    """``Partial.add`` adds into the partial's own float64 arrays (no temporary per update) with the
    values ``mine + arr`` gives, bit for bit; it never writes into the other side, nor into an array
    it does not own (a view of a message, as ``from_wire`` makes)."""
    from shared import codec
    from shared.algorithms.base import Partial

    rng = np.random.default_rng(0)
    updates = [rng.standard_normal((5, 7)).astype(np.float32) * 10.0**k for k in range(-3, 4)]
    partial, reference = Partial(), updates[0].astype(np.float64)
    partial.add(Partial({"w": updates[0]}))
    own = partial.arrays["w"]
    for u in updates[1:]:
        before = u.copy()
        partial.add(Partial({"w": u}))
        reference = reference + u
        np.testing.assert_array_equal(u, before)
    assert partial.arrays["w"] is own  # summed where it lies
    assert partial.arrays["w"].tobytes() == reference.tobytes()

    message = bytearray(np.ones(6, np.float64).tobytes())
    view = np.frombuffer(message, np.float64)
    wired = Partial.from_wire({"w": codec.Dense(view)}, {})
    wired.add(Partial({"w": np.full(6, 2.0)}))
    assert np.frombuffer(message, np.float64).tolist() == [1.0] * 6  # the message is untouched
    assert wired.arrays["w"].tolist() == [3.0] * 6
