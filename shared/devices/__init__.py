"""The device layer: profiles and fleets, the memory accountant, FLOPs, link/compute emulation and
availability. Services import from here; see docs/fleets.md for the user-facing description.

Torch stays out of importing this package: the FLOPs counter and the memory accountant (which run
torch models) load on first use of one of their names (``__getattr__``), so that processes which only
need profiles, links and availability — the aggregators, the ``fedfleet run`` parent — never import
torch (issue 16, lean processes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .availability import dropout_point, drops_out, is_online, online_devices, over_select
from .fleet import (
    PRESETS,
    FleetSpec,
    LazyFleet,
    Range,
    TierSpec,
    build_fleet,
    load_trace,
    parse_fleet_spec,
    write_trace,
)
from .footprint import Optimizer, TrainingFootprint
from .link import (
    TimeMode,
    TokenBucket,
    VirtualClock,
    compute_seconds,
    emulate_compute,
    emulate_transfer,
    throttle,
    transfer_seconds,
)
from .profile import Device, DeviceProfile, FleetError, OnlineTrace, parse_quantity, trace_allows

if TYPE_CHECKING:
    from .flops import LayerFlops, forward_flops, layer_flops, training_flops
    from .memory import (
        Admission,
        CapacityCount,
        admit,
        clear_cache,
        embracingfl_capacity,
        embracingfl_counts,
        estimate_activation_bytes,
        format_bytes,
        measure_activation_bytes,
        trainable_except,
        training_footprint,
    )

#: names loaded on first use, by the module that holds them (both import torch)
_LAZY = {
    **dict.fromkeys(("LayerFlops", "forward_flops", "layer_flops", "training_flops"), ".flops"),
    **dict.fromkeys(
        (
            "Admission",
            "CapacityCount",
            "admit",
            "clear_cache",
            "embracingfl_capacity",
            "embracingfl_counts",
            "estimate_activation_bytes",
            "format_bytes",
            "measure_activation_bytes",
            "trainable_except",
            "training_footprint",
        ),
        ".memory",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "PRESETS",
    "Admission",
    "CapacityCount",
    "Device",
    "DeviceProfile",
    "FleetError",
    "FleetSpec",
    "LayerFlops",
    "LazyFleet",
    "OnlineTrace",
    "Optimizer",
    "Range",
    "TierSpec",
    "TimeMode",
    "TokenBucket",
    "TrainingFootprint",
    "VirtualClock",
    "admit",
    "build_fleet",
    "clear_cache",
    "compute_seconds",
    "dropout_point",
    "drops_out",
    "embracingfl_capacity",
    "embracingfl_counts",
    "emulate_compute",
    "emulate_transfer",
    "estimate_activation_bytes",
    "format_bytes",
    "forward_flops",
    "is_online",
    "layer_flops",
    "load_trace",
    "measure_activation_bytes",
    "online_devices",
    "over_select",
    "parse_fleet_spec",
    "parse_quantity",
    "throttle",
    "trace_allows",
    "trainable_except",
    "training_flops",
    "training_footprint",
    "transfer_seconds",
    "write_trace",
]
