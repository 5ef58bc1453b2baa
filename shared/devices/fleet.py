"""Fleets: how an experiment's ``fleet:`` section becomes a list of :class:`Device`.

Three ways to describe a fleet (exactly one per experiment), all documented in ``docs/fleets.md``:

- ``preset: uniform | embracingfl-mix | mobile`` plus optional per-tier ``overrides``;
- ``tiers: {name: {profile fields..., count | fraction}}``: a tier mix;
- ``trace_file: path``: one CSV or JSON row per device (optionally with ``tiers`` declaring the allowed
  tier names and the values rows may leave empty).

Why budgets can be relative (``memory_fraction``): the papers describe weak devices as "15% of the full
model's training memory", and that only becomes bytes once the model is known. ``build_fleet`` takes the
full model's footprint and resolves every fraction once, so the rest of the system only sees bytes.

Why ranges: the ``mobile`` preset (and any tier) may give ``{min, max}`` instead of a number; each device
draws its own value from a coin keyed by (seed, device id, field), so the draws do not depend on the order
in which devices are built or on which process builds them (server and clients agree without talking).
"""

from __future__ import annotations

import csv
import difflib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .profile import (
    FIELD_KINDS,
    TIER_PATTERN,
    Device,
    DeviceProfile,
    FleetError,
    OnlineTrace,
    check_trace,
    parse_quantity,
)
from .seeding import rng_for, uniform01

__all__ = [
    "PRESETS",
    "FleetSpec",
    "Range",
    "TierSpec",
    "build_fleet",
    "load_trace",
    "parse_fleet_spec",
    "write_trace",
]

#: profile fields that must come from somewhere (the row, the tier or the preset); never defaulted
REQUIRED_FIELDS = ("memory_bytes", "uplink_bps", "downlink_bps", "latency_s", "flops_per_s")
#: the numeric profile fields in the order they are documented (and drawn)
NUMERIC_FIELDS = (*REQUIRED_FIELDS, "p_online", "p_dropout")
#: the columns a trace file may have, in the order ``write_trace`` writes them
TRACE_COLUMNS = ("device_id", "tier", *NUMERIC_FIELDS, "memory_fraction", "trace")

_MAX_ERRORS = 20


class Range(BaseModel):
    """A per-device random value: ``{min, max}`` drawn log-uniformly (default) or uniformly."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: float = Field(allow_inf_nan=False)
    max: float = Field(allow_inf_nan=False)
    dist: Literal["loguniform", "uniform"] = "loguniform"

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        if self.dist == "loguniform" and self.min <= 0:
            raise ValueError("a loguniform range needs min > 0")
        return self

    def draw(self, u: float) -> float:
        """Map a uniform ``u`` in [0, 1) to this range."""
        if self.dist == "uniform":
            return self.min + u * (self.max - self.min)
        lo, hi = math.log(self.min), math.log(self.max)
        return math.exp(lo + u * (hi - lo))


Value = float | Range


def _convert_units(data: Any) -> Any:
    """Apply unit parsing to known fields, scalars and ``{min, max}`` alike (before validation)."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    for key, kind in FIELD_KINDS.items():
        value = out.get(key)
        if isinstance(value, Mapping):
            out[key] = {k: (parse_quantity(v, kind) if k in ("min", "max") else v) for k, v in value.items()}
        elif value is not None:
            out[key] = parse_quantity(value, kind)
    return out


class TierSpec(BaseModel):
    """A tier in a mix: profile values (numbers or ranges) and its share of the fleet.

    Every field is optional *here* because overrides and trace defaults are partial; completeness is
    checked when a device is built from it, with an error naming the tier and the missing field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int | None = Field(None, ge=0)
    fraction: float | None = Field(None, ge=0, le=1)
    memory_bytes: Value | None = None
    memory_fraction: Value | None = None
    uplink_bps: Value | None = None
    downlink_bps: Value | None = None
    latency_s: Value | None = None
    flops_per_s: Value | None = None
    p_online: Value | None = None
    p_dropout: Value | None = None
    trace: OnlineTrace | None = None

    @model_validator(mode="before")
    @classmethod
    def _units(cls, data: Any) -> Any:
        return _convert_units(data)

    @model_validator(mode="after")
    def _exclusive(self) -> TierSpec:
        if self.count is not None and self.fraction is not None:
            raise ValueError("give either count or fraction, not both")
        if self.memory_bytes is not None and self.memory_fraction is not None:
            raise ValueError("give either memory_bytes or memory_fraction, not both")
        check_trace(self.trace)
        return self

    def merged(self, override: TierSpec) -> TierSpec:
        """This tier with ``override``'s explicitly set fields on top (count replaces fraction etc.)."""
        data = self.model_dump(exclude_none=True)
        new = override.model_dump(exclude_unset=True)
        for a, b in (("count", "fraction"), ("memory_bytes", "memory_fraction")):
            if a in new:
                data.pop(b, None)
            if b in new:
                data.pop(a, None)
        data.update(new)
        return TierSpec.model_validate(data)


def _t(**kw: Any) -> TierSpec:
    return TierSpec.model_validate(kw)


#: Built-in fleets. Sources and caveats for every number are in docs/fleets.md ("Presets").
PRESETS: dict[str, dict[str, TierSpec]] = {
    # One tier, memory with headroom: "uniform" means homogeneous and unconstrained in memory.
    "uniform": {
        "default": _t(
            fraction=1.0,
            memory_fraction=2.0,
            uplink_bps=5e6,
            downlink_bps=20e6,
            latency_s=0.05,
            flops_per_s=2e9,
        ),
    },
    # EmbracingFL (docs/algorithms/embracingfl.md §4): strong/moderate/weak at 100%/40%/15% of the full
    # model's training memory; mix = the paper's case 8 (32/32/64 of 128). Tiers differ in memory only.
    "embracingfl-mix": {
        name: _t(
            fraction=share,
            memory_fraction=mem,
            uplink_bps=5e6,
            downlink_bps=20e6,
            latency_s=0.015,
            flops_per_s=2e9,
        )
        for name, share, mem in (("strong", 0.25, 1.0), ("moderate", 0.25, 0.40), ("weak", 0.5, 0.15))
    },
    # Phones on LTE and Wi-Fi, values drawn per device. Approximate; see docs/fleets.md for sources.
    "mobile": {
        "lte": _t(
            fraction=0.6,
            memory_bytes={"min": 256 * 2**20, "max": 2**30},
            downlink_bps={"min": 5e6, "max": 60e6},
            uplink_bps={"min": 1e6, "max": 15e6},
            latency_s={"min": 0.03, "max": 0.15},
            flops_per_s={"min": 0.5e9, "max": 10e9},
            p_online=0.6,
            p_dropout=0.10,
        ),
        "wifi": _t(
            fraction=0.4,
            memory_bytes={"min": 256 * 2**20, "max": 2**30},
            downlink_bps={"min": 20e6, "max": 200e6},
            uplink_bps={"min": 5e6, "max": 50e6},
            latency_s={"min": 0.01, "max": 0.04},
            flops_per_s={"min": 0.5e9, "max": 10e9},
            p_online=0.8,
            p_dropout=0.06,
        ),
    },
}


class FleetSpec(BaseModel):
    """The ``fleet:`` section of an experiment config (see module docstring and docs/fleets.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: Literal["uniform", "embracingfl-mix", "mobile"] | None = None
    #: per-tier changes to a preset, e.g. ``{weak: {memory_fraction: 0.16}}`` or counts for every tier
    overrides: dict[str, TierSpec] = Field(default_factory=dict)
    tiers: dict[str, TierSpec] | None = None
    trace_file: str | None = None
    #: optional; when given it must equal the experiment's num_devices (a guard against stale files)
    num_devices: int | None = Field(None, ge=1)
    #: how tiers are laid over device ids: a seeded random permutation (default) or contiguous blocks
    assignment: Literal["shuffled", "blocks"] = "shuffled"

    @model_validator(mode="after")
    def _one_source(self) -> FleetSpec:
        if self.preset is not None and (self.tiers is not None or self.trace_file is not None):
            raise ValueError("give exactly one of 'preset', 'tiers' or 'trace_file' (tiers may go with one)")
        if self.preset is None and self.tiers is None and self.trace_file is None:
            raise ValueError("give one of 'preset', 'tiers' or 'trace_file'")
        if self.overrides and self.preset is None:
            raise ValueError("'overrides' apply to a preset; with 'tiers' write the values directly")
        for name in [*(self.tiers or {}), *self.overrides]:
            if not _valid_tier_name(name):
                raise ValueError(f"tier name '{name}' must match {TIER_PATTERN}")
        if self.trace_file is not None and self.tiers is not None:
            for name, tier in self.tiers.items():
                if tier.count is not None or tier.fraction is not None:
                    raise ValueError(
                        f"tier '{name}': with a trace_file the rows decide the counts; drop count/fraction"
                    )
        return self


def _valid_tier_name(name: str) -> bool:
    return re.match(TIER_PATTERN, name) is not None


def parse_fleet_spec(data: Any, source: str = "fleet") -> FleetSpec:
    """Validate a ``fleet:`` mapping (``None`` = the ``uniform`` preset); errors name ``source.key``."""
    if isinstance(data, FleetSpec):
        return data
    if data is None:
        return FleetSpec(preset="uniform")
    if not isinstance(data, Mapping):
        raise FleetError(f"{source}: must be a mapping, got {type(data).__name__}")
    try:
        return FleetSpec.model_validate(dict(data))
    except ValidationError as err:
        raise FleetError(_explain(err, source)) from None


#: how pydantic names the members of the ``number | Range`` and trace unions in an error's location
_UNION_MEMBERS = {"float", "int", "Range", "list[tuple[int, int]]", "list[int]"}


def _explain(err: ValidationError, where: str) -> str:
    """One line per problem, ``where.dotted.key: message``.

    For a field that takes a number *or* a range, pydantic reports a failure for each alternative;
    only the one matching what the user wrote is kept (a mapping → the range's error, else the
    number's), so the message answers the question that was actually asked.
    """
    chosen: dict[str, tuple[str, str]] = {}
    order: list[str] = []
    for e in err.errors():
        raw = [str(p) for p in e["loc"]]
        branch = next((p for p in raw if p in _UNION_MEMBERS), None)
        if any(p.startswith("function-") and "Range" in p for p in raw):
            branch = "Range"  # the range's own validator ("max is below min")
        parts = [
            p for p in raw if p not in _UNION_MEMBERS and not p.startswith(("function-", "tagged-union"))
        ]
        if branch in ("float", "int") and isinstance(e.get("input"), Mapping):
            continue  # a mapping was meant as a range; its own errors say what is wrong with it
        key = ".".join([where, *parts]) if parts else where
        if e["type"] == "extra_forbidden":
            valid = list(TierSpec.model_fields) + list(FleetSpec.model_fields)
            hint = difflib.get_close_matches(parts[-1] if parts else "", valid, n=1)
            text = "unknown key" + (f" (did you mean '{hint[0]}'?)" if hint else "")
        else:
            text = str(e["msg"]).removeprefix("Value error, ")
            got = e.get("input")
            if isinstance(got, str | int | float) and not isinstance(got, bool):
                text += f", got {got!r}"
        wanted = "Range" if isinstance(e.get("input"), Mapping) else None
        if key not in chosen:
            order.append(key)
            chosen[key] = (branch or "", text)
        elif branch is not None and (branch == "Range") == (wanted == "Range"):
            chosen[key] = (branch, text)
    lines = [f"{key}: {chosen[key][1]}" for key in order[:_MAX_ERRORS]]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Resolving values into profiles


def _draw(value: Value, seed: int, device_id: int, field: str) -> float:
    if isinstance(value, Range):
        return value.draw(uniform01("fleet-range", seed, device_id, field))
    return float(value)


def _tier_values(tier: TierSpec, seed: int, device_id: int) -> dict[str, Any]:
    """The tier's profile values for one device (ranges drawn), only the fields the tier sets."""
    out: dict[str, Any] = {}
    for field in (*NUMERIC_FIELDS, "memory_fraction"):
        value = getattr(tier, field)
        if value is not None:
            out[field] = _draw(value, seed, device_id, field)
            if field == "memory_bytes" and isinstance(value, Range):
                out[field] = round(out[field])  # a drawn budget is whole bytes
    if tier.trace is not None:
        out["trace"] = tier.trace
    return out


def _profile(
    values: Mapping[str, Any], tier: str, full_footprint_bytes: int, where: str
) -> tuple[DeviceProfile | None, list[str]]:
    """Build a profile from resolved values, or return the problems (each naming ``where`` and field)."""
    errors: list[str] = []
    data = {k: v for k, v in values.items() if k != "memory_fraction"}
    data["tier"] = tier
    fraction = values.get("memory_fraction")
    if fraction is not None and values.get("memory_bytes") is not None:
        errors.append(f"{where}, field 'memory_bytes': give memory_bytes or memory_fraction, not both")
    elif fraction is not None:
        try:
            f = float(parse_quantity(fraction, "number"))
        except (TypeError, ValueError):
            errors.append(f"{where}, field 'memory_fraction': not a number, got {fraction!r}")
        else:
            if not math.isfinite(f) or f <= 0:
                errors.append(f"{where}, field 'memory_fraction': must be > 0, got {fraction!r}")
            elif full_footprint_bytes <= 0:
                errors.append(
                    f"{where}, field 'memory_fraction': needs the full model's training footprint "
                    "(full_footprint_bytes) to become bytes"
                )
            else:
                data["memory_bytes"] = max(1, round(f * full_footprint_bytes))
    for field in REQUIRED_FIELDS:
        if data.get(field) is None and not (field == "memory_bytes" and fraction is not None):
            alt = " (or memory_fraction)" if field == "memory_bytes" else ""
            errors.append(f"{where}, field '{field}': missing{alt}; required, no default is filled in")
    if errors:
        return None, errors
    try:
        return DeviceProfile.model_validate(data), []
    except ValidationError as err:
        for e in err.errors():
            field = ".".join(str(p) for p in e["loc"]) or "?"
            got = e.get("input")
            lines = f"{where}, field '{field}': {e['msg']}"
            if got is not None and not isinstance(got, Mapping):
                lines += f", got {got!r}"
            errors.append(lines)
        return None, errors


def _raise(errors: Sequence[str]) -> None:
    if errors:
        extra = len(errors) - _MAX_ERRORS
        text = "\n".join(errors[:_MAX_ERRORS])
        if extra > 0:
            text += f"\n... and {extra} more"
        raise FleetError(text)


def _apportion(tiers: Mapping[str, TierSpec], n: int, where: str) -> dict[str, int]:
    """Counts per tier: given counts must sum to ``n``; fractions must sum to 1 and are rounded by the
    largest-remainder rule (ties to the tier declared first) so the counts always sum to ``n``."""
    names = list(tiers)
    kinds = {
        name: ("count" if t.count is not None else "fraction" if t.fraction is not None else None)
        for name, t in tiers.items()
    }
    missing = [name for name, kind in kinds.items() if kind is None]
    if missing:
        _raise([f"{where}.{name}: give 'count' or 'fraction'" for name in missing])
    if len(set(kinds.values())) > 1:
        _raise([f"{where}: use counts for every tier or fractions for every tier, not a mix"])
    if all(kind == "count" for kind in kinds.values()):
        counts = {name: int(tiers[name].count or 0) for name in names}
        if sum(counts.values()) != n:
            _raise([f"{where}: tier counts sum to {sum(counts.values())}, but num_devices is {n}"])
        return counts
    fractions = {name: float(tiers[name].fraction or 0.0) for name in names}
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-6:
        _raise([f"{where}: tier fractions sum to {total:.6g}, they must sum to 1"])
    exact = {name: round(fractions[name] * n, 9) for name in names}
    counts = {name: math.floor(exact[name]) for name in names}
    left = n - sum(counts.values())
    order = sorted(names, key=lambda name: (-(exact[name] - counts[name]), names.index(name)))
    for name in order[:left]:
        counts[name] += 1
    return counts


def _assign(counts: Mapping[str, int], n: int, seed: int, how: str) -> list[str]:
    labels = [name for name, count in counts.items() for _ in range(count)]
    assert len(labels) == n
    if how == "shuffled":
        perm = rng_for("fleet-assignment", seed).permutation(n)
        labels = [labels[i] for i in perm]
    return labels


def _from_tiers(
    tiers: Mapping[str, TierSpec],
    n: int,
    *,
    full_footprint_bytes: int,
    seed: int,
    how: str,
    where: str,
    lazy: bool = False,
) -> Sequence[Device]:
    counts = _apportion(tiers, n, where)
    labels = _assign(counts, n, seed, how)
    devices: list[Device] = []
    errors: list[str] = []
    reported: set[str] = set()
    for device_id, name in enumerate(labels):
        values = _tier_values(tiers[name], seed, device_id)
        profile, problems = _profile(values, name, full_footprint_bytes, f"{where}.{name}")
        if problems:
            if name not in reported:  # one report per tier, not one per device of the tier
                errors.extend(problems)
                reported.add(name)
            continue
        assert profile is not None
        if not lazy:  # a lazy fleet checks every device here, and keeps none of them
            devices.append(Device(device_id=device_id, profile=profile))
    _raise(errors)
    if lazy:
        return LazyFleet(tiers, labels, full_footprint_bytes=full_footprint_bytes, seed=seed, where=where)
    return devices


class LazyFleet(Sequence[Device]):
    """A tiered fleet that makes each device's profile from the seed when asked for it.

    Why: a profile is ~2 KB of Python objects, and every process of a run used to hold one for every
    registered device, though a round touches a thousand of them. This holds each device's tier as
    a small integer (the tier assignment is a permutation of the whole fleet, so it is computed once)
    and draws the rest — the same ``_tier_values`` from ``(seed, device_id)`` — on access, keeping the
    most recently used profiles (``CACHE``). The devices are the ones ``build_fleet`` would list:
    equal values, in id order; ``build_fleet`` checked every one of them before this was made.
    """

    #: profiles kept after use (a round's devices are asked for several times while it runs)
    CACHE = 4096

    def __init__(
        self,
        tiers: Mapping[str, TierSpec],
        labels: Sequence[str],
        *,
        full_footprint_bytes: int,
        seed: int,
        where: str,
    ) -> None:
        self._names = list(tiers)
        self._tiers = [tiers[name] for name in self._names]
        index = {name: i for i, name in enumerate(self._names)}
        self._labels = np.fromiter((index[x] for x in labels), dtype=np.int32, count=len(labels))
        self._full, self._seed, self._where = full_footprint_bytes, seed, where
        self._recent: OrderedDict[int, Device] = OrderedDict()
        self._lock = threading.Lock()  # a host's threads may ask at once

    def __len__(self) -> int:
        return len(self._labels)

    @overload
    def __getitem__(self, device: int) -> Device: ...
    @overload
    def __getitem__(self, device: slice) -> list[Device]: ...
    def __getitem__(self, device: int | slice) -> Device | list[Device]:
        if isinstance(device, slice):
            return [self[d] for d in range(len(self))[device]]
        d = int(device)
        if d < 0:
            d += len(self)
        if not 0 <= d < len(self):
            raise IndexError(f"device {device} is outside the fleet of {len(self)}")
        with self._lock:
            hit = self._recent.get(d)
            if hit is not None:
                self._recent.move_to_end(d)
                return hit
        made = self.make(d)
        with self._lock:
            self._recent[d] = made
            if len(self._recent) > self.CACHE:
                self._recent.popitem(last=False)
        return made

    def __iter__(self) -> Iterator[Device]:
        for d in range(len(self)):
            yield self[d]

    def make(self, device: int) -> Device:
        """Device ``device`` (``0 <= device < len(self)``) made from the seed, not kept.

        Why not ``self[device]``: a pass over many devices that each use once (a host taking a
        25,000-device lease) would fill ``CACHE`` with idle devices' profiles (~2 KB each) and push
        out the round's own ones; with a fleet large enough to have that many, the cache's cost
        would show up as a cost of idle devices (issue 16).
        """
        t = int(self._labels[device])
        name = self._names[t]
        values = _tier_values(self._tiers[t], self._seed, device)
        profile, problems = _profile(values, name, self._full, f"{self._where}.{name}")
        if profile is None:  # build_fleet checked every device: unreachable unless the code changed
            raise FleetError("\n".join(problems))
        return Device(device_id=device, profile=profile)

    def online_chances(self) -> tuple[np.ndarray, np.ndarray]:
        """Every device's ``p_online`` (``float64``) and whether it has an availability trace, as
        ``make(d).profile`` would give them, without making a profile.

        Why: the server's first selection asked it of every registered device by making each one's
        profile, seconds inside round 1 at 100,000 devices (benchmarks/results-scale.md, "After
        batched go"; a millisecond by tier). A tier's fixed
        ``p_online`` is the same for all its devices; only a range is drawn, per device, from the
        same seed and field as ``make`` draws it (``tests/test_devices.py`` compares the two).
        """
        p = np.empty(len(self._labels), dtype=np.float64)
        traced = np.zeros(len(self._labels), dtype=bool)
        for t, tier in enumerate(self._tiers):
            ids = np.flatnonzero(self._labels == t)
            value = tier.p_online
            if isinstance(value, Range):
                p[ids] = [_draw(value, self._seed, int(d), "p_online") for d in ids]
            else:
                # unset: the profile's own default, from the one place it is defined
                p[ids] = DeviceProfile.model_fields["p_online"].default if value is None else float(value)
            traced[ids] = tier.trace is not None
        return p, traced

    def tier(self, device: int) -> str:
        """The device's tier name, without making its profile (the server's registry asks it of every
        registered device at start; making 100,000 profiles for that took seconds)."""
        return self._names[int(self._labels[device])]

    def tier_counts(self) -> dict[str, int]:
        """Devices per tier, tiers in order of their first device (as counting ``self`` in id order)."""
        names, first, counts = np.unique(self._labels, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        return {self._names[int(names[i])]: int(counts[i]) for i in order}


# --------------------------------------------------------------------------------------------------
# Trace files


def _read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, cells) per device row. ``where`` is ``file: row r (line l)`` for CSV, ``file: row r``
    for JSON; rows are counted from 1 as a person counts, the CSV header is not a row."""
    if not path.is_file():
        raise FleetError(f"{path}: no such fleet trace file")
    suffix = path.suffix.lower()
    rows: list[tuple[str, dict[str, Any]]] = []
    if suffix == ".csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            if not header:
                raise FleetError(f"{path}: empty file (expected a header row: {', '.join(TRACE_COLUMNS)})")
            _check_columns(path, [h.strip() for h in header])
            for number, row in enumerate(reader, start=1):
                where = f"{path}: row {number} (line {reader.line_num})"
                if None in row:
                    raise FleetError(f"{where}: more cells than the header has columns")
                cells = {
                    k.strip(): v.strip()
                    for k, v in row.items()
                    if k is not None and v is not None and v.strip() != ""
                }
                rows.append((where, cells))
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise FleetError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, list):
            raise FleetError(f"{path}: the top level must be a list of device objects (one per device)")
        for number, item in enumerate(data, start=1):
            where = f"{path}: row {number}"
            if not isinstance(item, dict):
                raise FleetError(f"{where}: must be an object with the device's fields")
            _check_columns(path, list(item), where)
            rows.append((where, {k: v for k, v in item.items() if v is not None and v != ""}))
    else:
        raise FleetError(f"{path}: unknown trace format '{suffix}' (use .csv or .json)")
    if not rows:
        raise FleetError(f"{path}: no device rows")
    return rows


def _check_columns(path: Path, columns: Sequence[str], where: str | None = None) -> None:
    for col in columns:
        if col not in TRACE_COLUMNS:
            hint = difflib.get_close_matches(col, TRACE_COLUMNS, n=1)
            place = where or f"{path}: header (line 1)"
            raise FleetError(
                f"{place}: unknown column '{col}'"
                + (f" (did you mean '{hint[0]}'?)" if hint else f" (allowed: {', '.join(TRACE_COLUMNS)})")
            )
    if where is None:  # CSV: a required column absent from the header is missing in every row
        for col in ("device_id", "tier"):
            if col not in columns:
                raise FleetError(f"{path}: row 1 (line 2), field '{col}': missing (no such column)")


def _device_id(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if raw >= 0 else None
    if isinstance(raw, float):
        return int(raw) if raw.is_integer() and raw >= 0 else None
    try:
        value = int(str(raw))
    except ValueError:
        return None
    return value if value >= 0 else None


def load_trace(
    path: str | Path,
    *,
    tiers: Mapping[str, TierSpec | Mapping[str, Any]] | None = None,
    full_footprint_bytes: int = 0,
    seed: int = 0,
    num_devices: int | None = None,
) -> list[Device]:
    """Read a CSV or JSON fleet trace (one row per device; format in docs/fleets.md).

    With ``tiers``, every row's tier must be one of them and empty cells take the tier's value; without,
    every row must carry every required field. Nothing required is ever filled in silently. Device ids
    must be unique and, when ``num_devices`` is given, exactly ``0..num_devices-1`` (they index the data
    partitions). All problems are reported at once, each naming the file, the row and the field.
    """
    path = Path(path)
    declared: dict[str, TierSpec] | None = None
    if tiers is not None:
        try:
            declared = {
                k: v if isinstance(v, TierSpec) else TierSpec.model_validate(v) for k, v in tiers.items()
            }
        except ValidationError as err:
            raise FleetError(_explain(err, "tiers")) from None
    rows = _read_rows(path)
    devices: list[Device] = []
    errors: list[str] = []
    if num_devices is not None and len(rows) != num_devices:
        errors.append(f"{path}: has {len(rows)} device rows, but num_devices is {num_devices}")
    seen: dict[int, str] = {}
    for where, cells in rows:
        raw_id = cells.get("device_id")
        device_id = None if raw_id is None else _device_id(raw_id)
        if raw_id is None:
            errors.append(f"{where}, field 'device_id': missing")
        elif device_id is None:
            errors.append(f"{where}, field 'device_id': must be a whole number >= 0, got {raw_id!r}")
        elif device_id in seen:
            errors.append(f"{where}, field 'device_id': {device_id} is already used by {seen[device_id]}")
            device_id = None
        elif num_devices is not None and device_id >= num_devices:
            errors.append(
                f"{where}, field 'device_id': {device_id} is out of range; with {num_devices} devices "
                f"the ids are 0..{num_devices - 1}"
            )
            device_id = None
        else:
            seen[device_id] = where.split(": ", 1)[1]
        tier = cells.get("tier")
        if tier is None:
            errors.append(f"{where}, field 'tier': missing")
            continue
        tier = str(tier)
        values: dict[str, Any] = {}
        if declared is not None:
            if tier not in declared:
                errors.append(
                    f"{where}, field 'tier': unknown tier '{tier}' (declared: {', '.join(declared)})"
                )
                continue
            values.update(_tier_values(declared[tier], seed, device_id if device_id is not None else 0))
        row_values = {k: v for k, v in cells.items() if k not in ("device_id", "tier")}
        if isinstance(row_values.get("trace"), str):
            try:
                row_values["trace"] = json.loads(row_values["trace"])
            except json.JSONDecodeError:
                errors.append(f"{where}, field 'trace': not valid JSON, got {row_values['trace']!r}")
                continue
        # a row's own memory_bytes/memory_fraction replaces the tier's, whichever form either uses
        if "memory_bytes" in row_values or "memory_fraction" in row_values:
            values.pop("memory_bytes", None)
            values.pop("memory_fraction", None)
        values.update(row_values)
        profile, problems = _profile(values, tier, full_footprint_bytes, where)
        errors.extend(problems)
        if profile is not None and device_id is not None:
            devices.append(Device(device_id=device_id, profile=profile))
    _raise(errors)
    return sorted(devices, key=lambda d: d.device_id)


def write_trace(devices: Sequence[Device], path: str | Path) -> None:
    """Write ``devices`` as a CSV trace that :func:`load_trace` reads back identically.

    Why: a run saves its *resolved* fleet (presets drawn, fractions turned into bytes) so it can be
    inspected and re-run with exactly the same budgets.
    """
    columns = [c for c in TRACE_COLUMNS if c != "memory_fraction"]
    with Path(path).open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for d in sorted(devices, key=lambda d: d.device_id):
            p = d.profile
            trace = (
                ""
                if p.trace is None
                else json.dumps([list(w) if isinstance(w, tuple) else w for w in p.trace])
            )
            writer.writerow(
                [d.device_id, p.tier, p.memory_bytes]
                + [repr(float(getattr(p, f))) for f in NUMERIC_FIELDS[1:]]
                + [trace]
            )


# --------------------------------------------------------------------------------------------------


def build_fleet(
    spec: FleetSpec | Mapping[str, Any] | None,
    num_devices: int,
    *,
    full_footprint_bytes: int,
    seed: int,
    base_dir: Path | None = None,
    source: str = "fleet",
    lazy: bool = False,
) -> Sequence[Device]:
    """Resolve a fleet description into ``num_devices`` devices with ids ``0..num_devices-1``.

    ``lazy``: a fleet of tiers (a preset or ``tiers``) comes back as a :class:`LazyFleet`, whose
    profiles are made from the seed on access instead of held (a trace file's rows are data, and
    stay a list either way).

    ``full_footprint_bytes`` is the full model's training footprint (see :mod:`.memory`); it turns every
    ``memory_fraction`` into bytes. ``base_dir`` is where a relative ``trace_file`` is looked up (the
    config file's directory). Deterministic for a seed. Raises :class:`FleetError` on any bad input.
    """
    if num_devices < 1:
        raise FleetError(f"{source}: num_devices must be >= 1, got {num_devices}")
    fs = parse_fleet_spec(spec, source)
    if fs.num_devices is not None and fs.num_devices != num_devices:
        raise FleetError(
            f"{source}.num_devices: the fleet says {fs.num_devices}, the experiment {num_devices}"
        )
    if fs.preset is not None:
        base = PRESETS[fs.preset]
        unknown = [name for name in fs.overrides if name not in base]
        if unknown:
            raise FleetError(
                f"{source}.overrides: unknown tier '{unknown[0]}' "
                f"(the preset '{fs.preset}' has tiers: {', '.join(base)})"
            )
        tiers = {
            name: (t.merged(fs.overrides[name]) if name in fs.overrides else t) for name, t in base.items()
        }
        return _from_tiers(
            tiers,
            num_devices,
            full_footprint_bytes=full_footprint_bytes,
            seed=seed,
            how=fs.assignment,
            where=f"{source}.overrides" if fs.overrides else f"{source}.preset",
            lazy=lazy,
        )
    if fs.trace_file is None:
        assert fs.tiers is not None
        return _from_tiers(
            fs.tiers,
            num_devices,
            full_footprint_bytes=full_footprint_bytes,
            seed=seed,
            how=fs.assignment,
            where=f"{source}.tiers",
            lazy=lazy,
        )
    path = Path(fs.trace_file)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return load_trace(
        path, tiers=fs.tiers, full_footprint_bytes=full_footprint_bytes, seed=seed, num_devices=num_devices
    )
