"""Device profiles: what one emulated device can do, in SI units.

Why a strict model: a profile is a *budget* that the client enforces (memory at admission, bandwidth and
latency on the transfer path, FLOP/s for compute time). A typo that silently became a default would make a
run answer a different question than the one asked, so unknown keys are refused, every budget must be
positive and finite, and nothing required has a default.

Numbers may be written with units where a person would (``"512MiB"``, ``"10Mbit/s"``, ``"50ms"``,
``"2GFLOP/s"``); they are converted to bytes, bit/s, seconds and FLOP/s here, once.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

__all__ = [
    "Device",
    "DeviceProfile",
    "FleetError",
    "OnlineTrace",
    "parse_quantity",
    "trace_allows",
]


class FleetError(ValueError):
    """A fleet that cannot be used; the message names the file (or config key), row and field."""


Kind = Literal["bytes", "bps", "seconds", "flops", "number"]

_UNITS: dict[str, dict[str, float]] = {
    "bytes": {
        "b": 1,
        "byte": 1,
        "bytes": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    },
    "bps": {
        "bps": 1,
        "bit/s": 1,
        "kbps": 1e3,
        "kbit/s": 1e3,
        "mbps": 1e6,
        "mbit/s": 1e6,
        "gbps": 1e9,
        "gbit/s": 1e9,
    },
    "seconds": {"s": 1, "sec": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60},
    "flops": {
        "flop/s": 1,
        "flops": 1,
        "kflop/s": 1e3,
        "kflops": 1e3,
        "mflop/s": 1e6,
        "mflops": 1e6,
        "gflop/s": 1e9,
        "gflops": 1e9,
        "tflop/s": 1e12,
        "tflops": 1e12,
    },
    "number": {},
}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]*)\s*$")

#: which unit family each profile field is written in
FIELD_KINDS: dict[str, Kind] = {
    "memory_bytes": "bytes",
    "uplink_bps": "bps",
    "downlink_bps": "bps",
    "latency_s": "seconds",
    "flops_per_s": "flops",
    "memory_fraction": "number",
    "p_online": "number",
    "p_dropout": "number",
}


def parse_quantity(value: Any, kind: Kind) -> Any:
    """Turn ``"512MiB"``/``"10 Mbit/s"``/``"1e6"`` into a number in the base unit of ``kind``.

    Non-strings pass through untouched so pydantic reports type errors itself. Why bytes vs bits are
    kept apart: ``"MB/s"`` for a link is ambiguous in everyday use (megabytes? megabits?), so it is
    refused rather than guessed.
    """
    if not isinstance(value, str):
        return value
    m = _QUANTITY.match(value)
    if m is None:
        return value  # let pydantic say "not a valid number"
    number, unit = m.group(1), m.group(2).lower()
    if not unit:
        return float(number)
    table = _UNITS[kind]
    if unit not in table:
        allowed = ", ".join(sorted(table)) or "none (a plain number)"
        raise ValueError(f"unknown unit '{m.group(2)}' (allowed: {allowed})")
    return float(number) * table[unit]


def _to_int_bytes(value: Any) -> Any:
    value = parse_quantity(value, "bytes")
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, float) and math.isfinite(value):
        raise ValueError(f"a byte count must be a whole number, got {value}")
    return value


def _unit(kind: Kind) -> BeforeValidator:
    return BeforeValidator(lambda v: parse_quantity(v, kind))


Bytes = Annotated[int, BeforeValidator(_to_int_bytes), Field(gt=0)]
BitsPerSecond = Annotated[float, _unit("bps"), Field(gt=0, allow_inf_nan=False)]
Seconds = Annotated[float, _unit("seconds"), Field(ge=0, allow_inf_nan=False)]
FlopsPerSecond = Annotated[float, _unit("flops"), Field(gt=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]

#: An on/off availability trace. Either a list of ``[start_round, end_round)`` windows in which the device
#: is online (offline outside all of them, also after the last one), or a per-round list of 0/1 flags that
#: repeats with its own length as the period (``[1, 1, 0]`` = online two rounds out of three). Round
#: numbers are the server's round numbers, the ``round`` of the message envelope.
OnlineTrace = list[tuple[int, int]] | list[int]


def trace_allows(trace: OnlineTrace, round_: int) -> bool:
    """Whether ``trace`` has the device online in ``round_`` (see :data:`OnlineTrace`)."""
    if not trace:
        return False
    first = trace[0]
    if isinstance(first, tuple):
        return any(start <= round_ < end for start, end in trace)  # type: ignore[misc]
    return bool(trace[round_ % len(trace)])


def check_trace(trace: OnlineTrace | None) -> OnlineTrace | None:
    """Validate a trace's content (pydantic has already checked its shape)."""
    if trace is None:
        return None
    if not trace:
        raise ValueError("an availability trace must not be empty (leave it out for 'always on')")
    if isinstance(trace[0], tuple):
        for start, end in trace:
            if start < 0 or end <= start:
                raise ValueError(f"window [{start}, {end}) must satisfy 0 <= start < end")
    elif any(bit not in (0, 1) for bit in trace):
        raise ValueError("a per-round trace holds only 0 and 1")
    return trace


TIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class DeviceProfile(BaseModel):
    """One device's budgets. Units: bytes, bit/s, seconds, FLOP/s; probabilities in [0, 1].

    ``p_online`` is the chance of being reachable when the server selects (decided per round), and
    ``p_dropout`` the chance that a selected device vanishes mid-round and never sends its update. A
    ``trace`` is a hard schedule on top of ``p_online``: the device is online only in rounds the trace
    allows *and* when the ``p_online`` draw says so (default 1.0, i.e. the trace alone decides).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: str = Field(pattern=TIER_PATTERN)
    memory_bytes: Bytes
    uplink_bps: BitsPerSecond
    downlink_bps: BitsPerSecond
    latency_s: Seconds
    flops_per_s: FlopsPerSecond
    p_online: Probability = 1.0
    p_dropout: Probability = 0.0
    trace: OnlineTrace | None = None

    @field_validator("trace")
    @classmethod
    def _check_trace(cls, value: OnlineTrace | None) -> OnlineTrace | None:
        return check_trace(value)


class Device(BaseModel):
    """A device of the fleet: a stable id (the data partition index) and its profile."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_id: int = Field(ge=0)
    profile: DeviceProfile

    @property
    def tier(self) -> str:
        return self.profile.tier
