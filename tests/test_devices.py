"""The device layer: fleets, memory accountant, FLOPs, link/compute emulation, availability."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from shared.devices import (
    Device,
    DeviceProfile,
    FleetError,
    LazyFleet,
    TokenBucket,
    VirtualClock,
    admit,
    build_fleet,
    clear_cache,
    compute_seconds,
    drops_out,
    embracingfl_capacity,
    embracingfl_counts,
    emulate_compute,
    emulate_transfer,
    estimate_activation_bytes,
    forward_flops,
    is_online,
    layer_flops,
    load_trace,
    measure_activation_bytes,
    over_select,
    parse_fleet_spec,
    throttle,
    trainable_except,
    training_flops,
    training_footprint,
    transfer_seconds,
    write_trace,
)
from shared.devices import memory as memory_mod
from shared.models import build_model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "fleets.md"
FULL = 1_000_000  # a full-model footprint for fleet tests (bytes)

HEADER = "device_id,tier,memory_bytes,uplink_bps,downlink_bps,latency_s,flops_per_s,p_online,p_dropout,trace"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _doc_block(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(), flags=re.S)


# ---------------------------------------------------------------------------------------------- fleets


def test_uniform_is_the_default_and_resolves_memory_fraction() -> None:
    devices = build_fleet(None, 5, full_footprint_bytes=FULL, seed=0)
    assert [d.device_id for d in devices] == [0, 1, 2, 3, 4]
    assert {d.tier for d in devices} == {"default"}
    assert all(d.profile.memory_bytes == 2 * FULL for d in devices)
    assert devices[0].profile.downlink_bps == 20e6


def test_embracingfl_mix_counts_fractions_and_seeded_assignment() -> None:
    spec = {"preset": "embracingfl-mix"}
    devices = build_fleet(spec, 128, full_footprint_bytes=FULL, seed=1)
    tiers = [d.tier for d in devices]
    assert (tiers.count("strong"), tiers.count("moderate"), tiers.count("weak")) == (32, 32, 64)
    budget = {d.tier: d.profile.memory_bytes for d in devices}
    assert budget == {"strong": FULL, "moderate": 400_000, "weak": 150_000}
    assert [d.tier for d in build_fleet(spec, 128, full_footprint_bytes=FULL, seed=1)] == tiers
    assert [d.tier for d in build_fleet(spec, 128, full_footprint_bytes=FULL, seed=2)] != tiers
    blocks = build_fleet({**spec, "assignment": "blocks"}, 8, full_footprint_bytes=FULL, seed=1)
    assert [d.tier for d in blocks] == ["strong"] * 2 + ["moderate"] * 2 + ["weak"] * 4


def test_preset_overrides_counts_and_fields() -> None:
    spec = {
        "preset": "embracingfl-mix",
        "overrides": {
            "strong": {"count": 16},
            "moderate": {"count": 0},
            "weak": {"count": 112, "memory_fraction": 0.16, "uplink_bps": "1Mbit/s"},
        },
    }
    devices = build_fleet(spec, 128, full_footprint_bytes=FULL, seed=0)
    weak = [d for d in devices if d.tier == "weak"]
    assert len(weak) == 112 and len(devices) - len(weak) == 16
    assert weak[0].profile.memory_bytes == 160_000 and weak[0].profile.uplink_bps == 1e6
    with pytest.raises(FleetError, match=r"overrides: unknown tier 'medium'.*strong, moderate, weak"):
        build_fleet(
            {"preset": "embracingfl-mix", "overrides": {"medium": {"count": 1}}},
            4,
            full_footprint_bytes=FULL,
            seed=0,
        )
    with pytest.raises(FleetError, match="counts for every tier or fractions"):
        build_fleet(
            {"preset": "embracingfl-mix", "overrides": {"weak": {"count": 2}}},
            4,
            full_footprint_bytes=FULL,
            seed=0,
        )


def test_mobile_preset_draws_per_device_within_ranges_deterministically() -> None:
    a = build_fleet({"preset": "mobile"}, 200, full_footprint_bytes=FULL, seed=7)
    b = build_fleet({"preset": "mobile"}, 200, full_footprint_bytes=FULL, seed=7)
    c = build_fleet({"preset": "mobile"}, 200, full_footprint_bytes=FULL, seed=8)
    assert a == b and a != c
    assert sum(d.tier == "lte" for d in a) == 120
    lte = [d.profile for d in a if d.tier == "lte"]
    wifi = [d.profile for d in a if d.tier == "wifi"]
    assert all(5e6 <= p.downlink_bps <= 60e6 and 1e6 <= p.uplink_bps <= 15e6 for p in lte)
    assert all(20e6 <= p.downlink_bps <= 200e6 and 0.01 <= p.latency_s <= 0.04 for p in wifi)
    assert all(256 * 2**20 <= p.memory_bytes <= 2**30 for p in lte + wifi)
    assert len({p.downlink_bps for p in lte}) == len(lte)  # really drawn per device
    # log-uniform: the median sits near the geometric mean of the range, not the arithmetic one
    assert np.median([p.flops_per_s for p in lte + wifi]) == pytest.approx(math.sqrt(0.5e9 * 10e9), rel=0.35)


def test_tier_fractions_are_rounded_to_exact_counts() -> None:
    def spec(fractions: dict[str, float]) -> dict[str, object]:
        base = {
            "memory_bytes": 1000,
            "uplink_bps": 1e6,
            "downlink_bps": 1e6,
            "latency_s": 0,
            "flops_per_s": 1e9,
        }
        return {"tiers": {k: {**base, "fraction": f} for k, f in fractions.items()}}

    for n in range(1, 60):
        devices = build_fleet(spec({"a": 0.5, "b": 0.3, "c": 0.2}), n, full_footprint_bytes=FULL, seed=0)
        assert len(devices) == n
    counts = [
        d.tier for d in build_fleet(spec({"a": 0.5, "b": 0.3, "c": 0.2}), 7, full_footprint_bytes=0, seed=0)
    ]
    assert (counts.count("a"), counts.count("b"), counts.count("c")) == (4, 2, 1)  # 3.5, 2.1, 1.4
    thirds = [
        d.tier
        for d in build_fleet(spec({"x": 1 / 3, "y": 1 / 3, "z": 1 / 3}), 4, full_footprint_bytes=0, seed=0)
    ]
    assert (thirds.count("x"), thirds.count("y"), thirds.count("z")) == (2, 1, 1)  # tie → first declared
    with pytest.raises(FleetError, match=r"fractions sum to 0\.9"):
        build_fleet(spec({"a": 0.5, "b": 0.4}), 10, full_footprint_bytes=FULL, seed=0)


@pytest.mark.parametrize("seed", [0, 3])
def test_online_chances_by_tier_are_each_profiles_own(seed: int) -> None:
    """``LazyFleet.online_chances`` (what the server's first selection reads) gives every device the
    ``p_online`` and trace flag its own profile has: a fixed value, the default, a drawn range."""
    base = {"memory_bytes": 1000, "uplink_bps": 1e6, "downlink_bps": 1e6, "latency_s": 0, "flops_per_s": 1e9}
    spec = {
        "tiers": {
            "fixed": {**base, "fraction": 0.3, "p_online": 0.6},
            "default": {**base, "fraction": 0.2},
            "drawn": {**base, "fraction": 0.3, "p_online": {"min": 0.2, "max": 0.9, "dist": "uniform"}},
            "traced": {**base, "fraction": 0.2, "p_online": {"min": 0.5, "max": 1.0}, "trace": [1, 0]},
        }
    }
    fleet = build_fleet(spec, 97, full_footprint_bytes=FULL, seed=seed, lazy=True)
    assert isinstance(fleet, LazyFleet)
    p, traced = fleet.online_chances()
    profiles = [fleet.make(d).profile for d in range(len(fleet))]
    assert p.tolist() == [q.p_online for q in profiles]
    assert traced.tolist() == [q.trace is not None for q in profiles]
    assert len(set(p.tolist())) > 4  # the ranges were drawn per device


def test_tier_counts_must_sum_and_required_fields_are_never_defaulted() -> None:
    tier = {
        "memory_bytes": "64MiB",
        "uplink_bps": "2Mbps",
        "downlink_bps": "8Mbit/s",
        "latency_s": "80ms",
        "flops_per_s": "1GFLOP/s",
    }
    devices = build_fleet({"tiers": {"t": {**tier, "count": 3}}}, 3, full_footprint_bytes=0, seed=0)
    p = devices[0].profile
    assert (p.memory_bytes, p.uplink_bps, p.downlink_bps, p.latency_s, p.flops_per_s) == (
        64 * 2**20,
        2e6,
        8e6,
        0.08,
        1e9,
    )
    assert (p.p_online, p.p_dropout, p.trace) == (1.0, 0.0, None)  # the documented optional defaults
    with pytest.raises(FleetError, match="counts sum to 3, but num_devices is 4"):
        build_fleet({"tiers": {"t": {**tier, "count": 3}}}, 4, full_footprint_bytes=0, seed=0)
    no_latency = {k: v for k, v in tier.items() if k != "latency_s"}
    with pytest.raises(FleetError, match=r"fleet\.tiers\.t, field 'latency_s': missing; required"):
        build_fleet({"tiers": {"t": {**no_latency, "count": 3}}}, 3, full_footprint_bytes=0, seed=0)
    with pytest.raises(FleetError, match="memory_fraction': needs the full model's training footprint"):
        build_fleet(
            {"tiers": {"t": {**tier, "memory_bytes": None, "memory_fraction": 0.5, "count": 1}}},
            1,
            full_footprint_bytes=0,
            seed=0,
        )
    with pytest.raises(
        FleetError, match=r"fleet\.tiers\.t\.uplnk_bps: unknown key \(did you mean 'uplink_bps'\?\)"
    ):
        parse_fleet_spec({"tiers": {"t": {**tier, "uplnk_bps": 1}}})
    with pytest.raises(FleetError, match="unknown unit 'MB/s'"):
        parse_fleet_spec({"tiers": {"t": {**tier, "uplink_bps": "1MB/s"}}})
    with pytest.raises(FleetError, match="give exactly one of 'preset', 'tiers' or 'trace_file'"):
        parse_fleet_spec({"preset": "uniform", "trace_file": "x.csv"})
    with pytest.raises(FleetError, match="the fleet says 5, the experiment 4"):
        build_fleet({"preset": "uniform", "num_devices": 5}, 4, full_footprint_bytes=FULL, seed=0)


def test_documented_csv_example_loads_and_round_trips(tmp_path: Path) -> None:
    (example,) = _doc_block("csv")
    devices = load_trace(_write(tmp_path, "lab.csv", example), num_devices=4)
    assert [d.tier for d in devices] == ["phone-new", "phone-new", "phone-old", "iot"]
    old, iot = devices[2].profile, devices[3].profile
    assert old.memory_bytes == 256 * 2**20 and old.uplink_bps == 2e6 and old.trace == [(0, 50), (80, 200)]
    assert iot.uplink_bps == 250e3 and iot.downlink_bps == 1e6 and iot.trace == [1, 0]
    out = tmp_path / "resolved.csv"
    write_trace(devices, out)
    assert load_trace(out) == devices
    # the same fleet as JSON
    rows = [
        {"device_id": d.device_id, "tier": d.tier, **d.profile.model_dump(exclude={"tier"})} for d in devices
    ]
    assert load_trace(_write(tmp_path, "lab.json", json.dumps(rows))) == devices


def test_documented_yaml_examples_build(tmp_path: Path) -> None:
    (tmp_path / "fleets").mkdir()
    (tmp_path / "fleets" / "lab.csv").write_text(_doc_block("csv")[0])
    all_blocks = [yaml.safe_load(b) for b in _doc_block("yaml")]
    blocks = [b for b in _doc_block("yaml") if "fleet" in yaml.safe_load(b)]
    assert len(blocks) == 4
    # the other documented blocks are the emulation settings, and they validate too
    from shared.config import EmulationConfig

    others = [b for b in all_blocks if "fleet" not in b]
    assert others and all(EmulationConfig.model_validate(b["emulation"]) for b in others)
    sizes = {0: 128, 1: 10, 2: 4, 3: 4}
    for i, block in enumerate(blocks):
        spec = yaml.safe_load(block)["fleet"]
        devices = build_fleet(spec, sizes[i], full_footprint_bytes=FULL, seed=0, base_dir=tmp_path)
        assert len(devices) == sizes[i]
    small = build_fleet(yaml.safe_load(blocks[1])["fleet"], 10, full_footprint_bytes=FULL, seed=0)
    assert [d.profile.memory_bytes for d in small if d.tier == "small"] == [FULL // 2] * 3


def test_trace_with_declared_tiers_inherits_empty_cells(tmp_path: Path) -> None:
    csv_text = f"{HEADER}\n0,a,1000,1e6,2e6,0.1,,,,\n1,b,2000,1e6,2e6,0.1,3e9,0.5,,\n"
    path = _write(tmp_path, "t.csv", csv_text)
    spec = {
        "trace_file": str(path),
        "tiers": {"a": {"flops_per_s": 7e9}, "b": {"flops_per_s": 1e9, "p_dropout": 0.2}},
    }
    a, b = build_fleet(spec, 2, full_footprint_bytes=0, seed=0)
    assert a.profile.flops_per_s == 7e9  # empty cell: the declared tier's value
    assert (b.profile.flops_per_s, b.profile.p_online, b.profile.p_dropout) == (3e9, 0.5, 0.2)  # row wins
    with pytest.raises(FleetError, match=r"t\.csv: row 1 \(line 2\), field 'flops_per_s': missing"):
        load_trace(path)  # without declared tiers an empty required cell is an error


# ------------------------------------------------------------------------------------- bad trace input


GOOD = "0,x,1000,1e6,2e6,0.1,1e9,1,0,"


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (f"{GOOD}\n1,x,1000,,2e6,0.1,1e9,1,0,", r"row 2 \(line 3\), field 'uplink_bps': missing"),
        (
            f"{GOOD}\n1,x,1000,1e6,-8e6,0.1,1e9,1,0,",
            r"row 2 \(line 3\), field 'downlink_bps': .*greater than 0, got '-8e6'",
        ),
        (
            f"{GOOD}\n1,x,0,1e6,2e6,0.1,1e9,1,0,",
            r"row 2 \(line 3\), field 'memory_bytes': .*greater than 0, got '0'",
        ),
        (f"{GOOD}\n1,x,1000,1e6,2e6,0.1,0,1,0,", r"row 2 \(line 3\), field 'flops_per_s': .*greater than 0"),
        (
            f"{GOOD}\n1,x,1000,1e6,2e6,0.1,1e9,1.5,0,",
            r"row 2 \(line 3\), field 'p_online': .*less than or equal to 1",
        ),
        (
            f"{GOOD}\n0,x,1000,1e6,2e6,0.1,1e9,1,0,",
            r"row 2 \(line 3\), field 'device_id': 0 is already used by row 1",
        ),
        (f"{GOOD}\n7,x,1000,1e6,2e6,0.1,1e9,1,0,", r"row 2 \(line 3\), field 'device_id': 7 is out of range"),
        (
            f'{GOOD}\n1,x,1000,1e6,2e6,0.1,1e9,1,0,"[[5, 2]]"',
            r"row 2 \(line 3\), field 'trace': .*0 <= start < end",
        ),
        (f"{GOOD}\n1,,1000,1e6,2e6,0.1,1e9,1,0,", r"row 2 \(line 3\), field 'tier': missing"),
    ],
)
def test_bad_csv_rows_name_file_row_and_field(tmp_path: Path, rows: str, expected: str) -> None:
    _write(tmp_path, "fleet.csv", f"{HEADER}\n{rows}\n")
    with pytest.raises(FleetError, match=rf"fleet\.csv: {expected}"):
        build_fleet({"trace_file": "fleet.csv"}, 2, full_footprint_bytes=0, seed=0, base_dir=tmp_path)


def test_bad_trace_files_unknown_tier_missing_column_json(tmp_path: Path) -> None:
    path = _write(tmp_path, "f.csv", f"{HEADER}\n{GOOD}\n1,iotx,1000,1e6,2e6,0.1,1e9,1,0,\n")
    with pytest.raises(
        FleetError, match=r"f\.csv: row 2 \(line 3\), field 'tier': unknown tier 'iotx' \(declared: x, iot\)"
    ):
        build_fleet(
            {"trace_file": str(path), "tiers": {"x": {}, "iot": {}}}, 2, full_footprint_bytes=0, seed=0
        )
    no_col = _write(
        tmp_path, "g.csv", "device_id,tier,memory_bytes,downlink_bps,latency_s,flops_per_s\n0,x,1,1,0,1\n"
    )
    with pytest.raises(FleetError, match=r"g\.csv: row 1 \(line 2\), field 'uplink_bps': missing"):
        load_trace(no_col)
    typo = _write(tmp_path, "h.csv", "device_id,tier,memory_bytes,uplnk_bps\n")
    with pytest.raises(
        FleetError,
        match=r"h\.csv: header \(line 1\): unknown column 'uplnk_bps' \(did you mean 'uplink_bps'\?\)",
    ):
        load_trace(typo)
    rows = [
        {
            "device_id": 0,
            "tier": "x",
            "memory_bytes": 10,
            "uplink_bps": 1,
            "downlink_bps": 1,
            "latency_s": 0,
            "flops_per_s": 1,
        },
        {"device_id": 1, "tier": "x", "memory_bytes": 10, "uplink_bps": 1, "latency_s": 0, "flops_per_s": 1},
    ]
    with pytest.raises(FleetError, match=r"j\.json: row 2, field 'downlink_bps': missing"):
        load_trace(_write(tmp_path, "j.json", json.dumps(rows)))
    rows[1]["downlink_bps"] = 1
    rows[0]["memory_bytes"] = 0
    with pytest.raises(FleetError, match=r"j2\.json: row 1, field 'memory_bytes': .*greater than 0"):
        load_trace(_write(tmp_path, "j2.json", json.dumps(rows)))
    with pytest.raises(FleetError, match="has 2 device rows, but num_devices is 3"):
        build_fleet({"trace_file": str(tmp_path / "j.json")}, 3, full_footprint_bytes=0, seed=0)
    with pytest.raises(FleetError, match="no such fleet trace file"):
        build_fleet({"trace_file": "nope.csv"}, 3, full_footprint_bytes=0, seed=0, base_dir=tmp_path)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = _write(tmp_path, "m.csv", f"{HEADER}\n0,x,0,1e6,2e6,0.1,1e9,1,0,\n1,x,1000,-1,2e6,0.1,1e9,1,0,\n")
    with pytest.raises(FleetError) as info:
        load_trace(path)
    assert "row 1 (line 2), field 'memory_bytes'" in str(info.value)
    assert "row 2 (line 3), field 'uplink_bps'" in str(info.value)


# ------------------------------------------------------------------------------------ memory accountant


MODELS = [("mlp", (64,), 10), ("cnn_digits", (1, 8, 8), 10), ("resnet20", (3, 32, 32), 10)]


@pytest.fixture(scope="module")
def resnet20() -> nn.Module:
    return build_model("resnet20", (3, 32, 32), 10, seed=0)


@pytest.mark.parametrize(("name", "shape", "classes"), MODELS)
def test_measured_and_analytic_activation_bytes_agree(
    name: str, shape: tuple[int, ...], classes: int
) -> None:
    model = build_model(name, shape, classes, seed=0)
    measured = measure_activation_bytes(model, torch.zeros(32, *shape))
    estimated = estimate_activation_bytes(model, shape, 32)
    assert measured > 0
    assert abs(estimated - measured) <= 0.05 * measured, (name, measured, estimated)


def test_mlp_activation_bytes_by_hand() -> None:
    # 64-128-64-10 at batch 32: fc1 saves the input (32x64), fc2/fc3 the ReLU outputs (32x128, 32x64),
    # which are also what the ReLUs save: one allocation each.
    model = build_model("mlp", (64,), 10, seed=0)
    assert measure_activation_bytes(model, torch.zeros(32, 64)) == 32 * (64 + 128 + 64) * 4


def test_frozen_prefix_saves_nothing_and_estimate_follows(resnet20: nn.Module) -> None:
    weak = trainable_except(resnet20, ["conv1", "bn1", "layer1", "layer2"])
    full = measure_activation_bytes(resnet20, torch.zeros(32, 3, 32, 32))
    part = measure_activation_bytes(resnet20, torch.zeros(32, 3, 32, 32), trainable=weak)
    assert part < 0.2 * full
    assert estimate_activation_bytes(resnet20, (3, 32, 32), 32, trainable=weak) == pytest.approx(
        part, rel=0.05
    )


def test_probe_leaves_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))
    model.eval()
    model[4].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randn(8, 4)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    assert measure_activation_bytes(model, batch) == estimate_activation_bytes(model, (4,), 8)
    assert torch.equal(torch.rand(1), expected_next)  # the dropout draws did not move the global RNG
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN stats unchanged
    assert not model.training and not model[4].weight.requires_grad and model[0].weight.requires_grad


def test_training_footprint_components(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_cache()
    model = build_model("cnn_digits", (1, 8, 8), 10, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() for b in model.buffers())
    sgd = training_footprint(model, (1, 8, 8), 32)
    assert sgd.params_bytes == 4 * (n_params + n_buffers) + 4 * 3  # 3 x num_batches_tracked: int64, 8 bytes
    assert sgd.grads_bytes == 4 * n_params and sgd.optimizer_bytes == 0
    assert sgd.activations_bytes == measure_activation_bytes(model, torch.zeros(32, 1, 8, 8))
    assert sgd.total == sgd.params_bytes + sgd.grads_bytes + sgd.activations_bytes
    assert training_footprint(model, (1, 8, 8), 32, optimizer="sgd_momentum").optimizer_bytes == 4 * n_params
    n_tensors = len(list(model.parameters()))
    assert (
        training_footprint(model, (1, 8, 8), 32, optimizer="adam").optimizer_bytes
        == 8 * n_params + 4 * n_tensors
    )
    head = {"fc.weight", "fc.bias"}
    part = training_footprint(
        model, (1, 8, 8), 32, optimizer="adam", trainable_params=head, param_bytes_override=123
    )
    assert part.params_bytes == 123 and part.grads_bytes == 4 * (64 * 10 + 10)
    assert part.optimizer_bytes == 2 * part.grads_bytes + 8
    assert part.activations_bytes == 32 * 64 * 4  # only fc's input (the pooled features) is saved
    assert training_footprint(model, (1, 8, 8), 64).activations_bytes > sgd.activations_bytes
    # repeated calls hit the cache, also for a fresh model object of the same architecture
    calls: list[int] = []

    def counting_measure(*args: object, **kwargs: object) -> int:
        calls.append(1)
        return 0

    monkeypatch.setattr(memory_mod, "measure_activation_bytes", counting_measure)
    again = training_footprint(build_model("cnn_digits", (1, 8, 8), 10, seed=1), (1, 8, 8), 32)
    assert again.activations_bytes == sgd.activations_bytes and calls == []
    with pytest.raises(ValueError, match="unknown parameters"):
        training_footprint(model, (1, 8, 8), 32, trainable_params={"fc.wieght"})


def test_admission_refuses_exactly_the_devices_below_the_footprint() -> None:
    model = build_model("mlp", (64,), 10, seed=0)
    task = training_footprint(model, (64,), 32, optimizer="sgd_momentum")
    link = {"uplink_bps": 1e6, "downlink_bps": 1e6, "latency_s": 0.0, "flops_per_s": 1e9}
    spec = {
        "tiers": {
            "tight": {"fraction": 0.3, "memory_fraction": 0.9, **link},
            "ok": {"fraction": 0.7, "memory_fraction": 1.0, **link},
        }
    }
    fleet = build_fleet(spec, 20, full_footprint_bytes=task.total, seed=0)
    decisions = {d.device_id: admit(task, d.profile.memory_bytes, tier=d.tier) for d in fleet}
    refused = {i for i, a in decisions.items() if not a.admitted}
    assert refused == {d.device_id for d in fleet if d.tier == "tight"} and len(refused) == 6
    no = decisions[min(refused)]
    assert no.reason == "memory" and no.footprint_bytes == task.total and no.budget_bytes < task.total
    assert f"({task.total} B = params" in no.detail and "exceeds the memory budget" in no.detail
    assert "tier 'tight'" in no.detail
    assert all(a.reason == "" for i, a in decisions.items() if i not in refused)
    assert "other" not in no.detail  # a zero extra term is not mentioned
    # a named extra term counts toward the total and is named in the refusal
    cached = dataclasses.replace(task, other_bytes=4096, other_label="cached prefix outputs")
    assert cached.total == task.total + 4096 and cached.as_dict()["other_bytes"] == 4096
    tight = admit(cached, task.total)
    assert not tight.admitted and "+ cached prefix outputs 4.0 KiB)" in tight.detail


def test_embracingfl_capacity_ratios_resnet20(resnet20: nn.Module) -> None:
    moderate = trainable_except(resnet20, ["conv1", "bn1", "layer1"])  # first conv + blocks 1-3
    weak = trainable_except(resnet20, ["conv1", "bn1", "layer1", "layer2"])  # first conv + blocks 1-6
    # Table 1 of the paper, exactly: p and a (a = conv + logit outputs, batch 32)
    assert embracingfl_counts(resnet20, (3, 32, 32)) == memory_mod.CapacityCount(272_762, 6_947_136)
    assert embracingfl_counts(resnet20, (3, 32, 32), trainable=moderate) == memory_mod.CapacityCount(
        257_994, 2_752_832
    )
    assert embracingfl_counts(resnet20, (3, 32, 32), trainable=weak) == memory_mod.CapacityCount(
        206_346, 917_824
    )
    assert round(embracingfl_capacity(resnet20, (3, 32, 32), trainable=moderate), 2) == 0.42
    assert round(embracingfl_capacity(resnet20, (3, 32, 32), trainable=weak), 2) == 0.16


def test_embracingfl_capacity_ratios_femnist_per_sample() -> None:
    cnn = build_model("cnn", (1, 28, 28), 62, seed=0)
    moderate = trainable_except(cnn, ["conv1", "conv2"])
    weak = trainable_except(cnn, ["conv1", "conv2", "fc1"])
    assert embracingfl_counts(cnn, (1, 28, 28), per_sample=True) == memory_mod.CapacityCount(
        6_603_710, 39_742
    )
    assert round(embracingfl_capacity(cnn, (1, 28, 28), trainable=moderate, per_sample=True), 2) == 0.99
    assert round(embracingfl_capacity(cnn, (1, 28, 28), trainable=weak, per_sample=True), 2) == 0.02


# ----------------------------------------------------------------------------------------------- FLOPs


def test_linear_flops_by_hand() -> None:
    model = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3))
    # per sample: fc0 2*50 = 100 fwd, fc2 2*15 = 30 fwd. Backward: weights of both, input of fc2 only
    # (fc0's input is the data). 4 samples x 3 batches.
    assert training_flops(model, (10,), 4, 3) == 12 * (100 + 100 + 30 + 30 + 30)
    assert forward_flops(model, (10,), 4) == 4 * 130
    frozen_first = training_flops(model, (10,), 1, 1, trainable_params={"2.weight", "2.bias"})
    assert frozen_first == 100 + 30 + 30  # frozen fc0: forward only; fc2: no input grad needed either


def test_conv_flops_by_hand() -> None:
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2, padding=1))
    rows = layer_flops(conv, (3, 8, 8))
    assert [(r.name, r.forward) for r in rows] == [("0", 2 * 64 * 8 * 3 * 9), ("2", 2 * 16 * 4 * 8 * 9)]
    assert [(r.backward_input, r.backward_weight) for r in rows] == [
        (0, 2 * 64 * 216),
        (2 * 16 * 288, 2 * 16 * 288),
    ]


def test_masks_halve_flops() -> None:
    model = build_model("mlp", (64,), 10, seed=0)
    dense = training_flops(model, (64,), 32, 5)
    masks = {}
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            m = np.zeros(p.numel(), dtype=bool)
            m[::2] = True
            masks[name] = m.reshape(tuple(p.shape))
    assert training_flops(model, (64,), 32, 5, masks=masks) == dense // 2
    torch_masks = {k: torch.from_numpy(v) for k, v in masks.items()}
    assert training_flops(model, (64,), 32, 5, masks=torch_masks) == dense // 2
    with pytest.raises(ValueError, match="has shape"):
        training_flops(model, (64,), 1, 1, masks={"fc1.weight": np.ones((3, 3), dtype=bool)})
    with pytest.raises(ValueError, match="unknown parameters"):
        training_flops(model, (64,), 1, 1, masks={"fc9.weight": np.ones((3, 3), dtype=bool)})


# ------------------------------------------------------------------------------------ link and compute


def _profile(**kw: float) -> DeviceProfile:
    base = {
        "tier": "t",
        "memory_bytes": 1,
        "uplink_bps": 1e6,
        "downlink_bps": 8e6,
        "latency_s": 0.05,
        "flops_per_s": 1e9,
    }
    return DeviceProfile.model_validate({**base, **kw})


def test_transfer_and_compute_formulas() -> None:
    assert transfer_seconds(1_000_000, 8e6, 0.05) == pytest.approx(1.05)
    slow, fast = transfer_seconds(250_000, 1e6, 0.02), transfer_seconds(250_000, 100e6, 0.02)
    assert (slow, fast) == (pytest.approx(2.02), pytest.approx(0.04))
    assert compute_seconds(3e9, 1.5e9) == 2.0
    p = _profile()
    assert emulate_transfer(1_000_000, p, "down") == pytest.approx(1.05)
    assert emulate_transfer(1_000_000, p, "up") == pytest.approx(8.05)
    # a download in 3 messages (EmbracingFL's prefix chunks) pays the latency 3 times
    assert emulate_transfer(1_000_000, p, "down", messages=3) == pytest.approx(1.15)
    with pytest.raises(ValueError, match="messages"):
        emulate_transfer(1_000_000, p, "down", messages=0)
    with pytest.raises(ValueError):
        transfer_seconds(10, 0.0, 0.0)
    with pytest.raises(ValueError):
        transfer_seconds(-1, 1e6, 0.0)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_token_bucket_paces_to_scaled_rate() -> None:
    t = FakeTime()
    emulated = throttle(1_000_000, 8e6, 10.0, latency_s=0.05, clock=t.clock, sleep=t.sleep)
    assert emulated == pytest.approx(1.05)
    assert t.now - 100.0 == pytest.approx(0.105)  # (latency + bytes*8/rate) / time_factor
    # chunked consumption takes the same total time as one call
    t2 = FakeTime()
    bucket = TokenBucket(8e6, 10.0, clock=t2.clock, sleep=t2.sleep)
    for _ in range(100):
        bucket.consume(10_000)
    assert t2.now - 100.0 == pytest.approx(0.1)
    # idle time refills at most burst_bytes
    t3 = FakeTime()
    bucket = TokenBucket(8e6, 1.0, burst_bytes=500_000, clock=t3.clock, sleep=t3.sleep)
    t3.now += 60.0
    assert bucket.consume(500_000) == 0.0
    assert bucket.consume(1_000_000) == pytest.approx(1.0)


def test_real_mode_emulation_sleeps_scaled_and_reports_emulated() -> None:
    t = FakeTime()
    p = _profile()
    assert emulate_transfer(
        1_000_000, p, "down", mode="real", time_factor=2.0, clock=t.clock, sleep=t.sleep
    ) == pytest.approx(1.05)
    assert t.now - 100.0 == pytest.approx(0.525)
    slept: list[float] = []
    assert emulate_compute(4e9, p, mode="real", time_factor=2.0, measured_s=0.5, sleep=slept.append) == 4.0
    assert slept == [pytest.approx(1.5)]
    assert emulate_compute(4e9, p, mode="real", time_factor=2.0, measured_s=3.0, sleep=slept.append) == 4.0
    assert len(slept) == 1  # already slower than the scaled device: no extra sleep
    assert emulate_compute(4e9, p, sleep=slept.append) == 4.0 and len(slept) == 1  # virtual never sleeps


def test_virtual_clock_per_device_deadline_and_monotone() -> None:
    clock = VirtualClock()
    clock.advance(1, 1.0)
    clock.advance(1, 2.5)
    clock.advance(2, 1.5)
    assert (clock.time_of(1), clock.time_of(2), clock.time_of(3)) == (3.5, 1.5, 0.0)
    assert clock.sync() == 3.5  # round ends at the slowest device
    assert clock.elapsed(1) == 0.0
    clock.advance(1, 1.0)
    clock.advance(2, 10.0)
    assert clock.sync(until=5.0) == 5.0  # deadline cuts the round
    assert clock.stragglers() == {2: 13.5}
    assert clock.time_of(1) == 5.0
    with pytest.raises(ValueError):
        clock.sync(until=4.0)
    with pytest.raises(ValueError):
        clock.advance(1, -1.0)


# -------------------------------------------------------------------------------------- availability


def test_availability_is_deterministic_and_matches_rates() -> None:
    devices = [Device(device_id=i, profile=_profile(p_online=0.7, p_dropout=0.1)) for i in range(200)]
    rounds = range(100)
    online = [[is_online(d, r, seed=3) for d in devices] for r in rounds]
    assert online == [[is_online(d, r, seed=3) for d in devices] for r in rounds]
    assert online != [[is_online(d, r, seed=4) for d in devices] for r in rounds]
    assert np.mean(online) == pytest.approx(0.7, abs=0.01)  # 20,000 coins: sd ~0.003
    dropped = [drops_out(d, r, seed=3) for d in devices for r in rounds]
    assert np.mean(dropped) == pytest.approx(0.1, abs=0.01)
    # online and dropout coins are independent
    both = [is_online(d, r, 3) and drops_out(d, r, 3) for d in devices for r in rounds]
    assert np.mean(both) == pytest.approx(0.07, abs=0.01)
    always = Device(device_id=0, profile=_profile())
    assert all(is_online(always, r, 0) and not drops_out(always, r, 0) for r in rounds)


def test_availability_traces() -> None:
    windows = Device(device_id=1, profile=_profile(trace=[[0, 3], [5, 6]]))  # type: ignore[arg-type]
    assert [is_online(windows, r, 0) for r in range(8)] == [
        True,
        True,
        True,
        False,
        False,
        True,
        False,
        False,
    ]
    bits = Device(device_id=2, profile=_profile(trace=[1, 0, 0]))  # type: ignore[arg-type]
    assert [is_online(bits, r, 0) for r in range(6)] == [True, False, False, True, False, False]
    thinned = Device(device_id=3, profile=_profile(trace=[1, 0], p_online=0.5))  # type: ignore[arg-type]
    odd = [is_online(thinned, r, 0) for r in range(1, 400, 2)]
    even = [is_online(thinned, r, 0) for r in range(0, 400, 2)]
    assert not any(odd) and 0.35 < np.mean(even) < 0.65
    with pytest.raises(ValueError):
        _profile(trace=[])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _profile(trace=[1, 2])  # type: ignore[arg-type]


def test_over_select() -> None:
    candidates = list(range(100))
    picked = over_select(candidates, 10, 1.3, np.random.default_rng(0))
    assert len(picked) == 13 and len(set(picked)) == 13 and set(picked) <= set(candidates)
    assert picked == over_select(candidates, 10, 1.3, np.random.default_rng(0))
    assert over_select(candidates, 10, 1.0, np.random.default_rng(0)) != over_select(
        candidates, 10, 1.0, np.random.default_rng(1)
    )
    assert sorted(over_select(candidates[:5], 10, 2.0, np.random.default_rng(0))) == [0, 1, 2, 3, 4]
    assert over_select(candidates, 0, 1.5, np.random.default_rng(0)) == []
    with pytest.raises(ValueError):
        over_select(candidates, 10, 0.5, np.random.default_rng(0))
