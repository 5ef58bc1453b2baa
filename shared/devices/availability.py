"""Who is online at selection, who vanishes mid-round, and over-selection to absorb both.

Every decision is a coin keyed by (seed, round, device) (see :mod:`.seeding`), never by call order: the
server deciding "online?" and the client deciding "drops out?" run in different processes, and a re-run
with the same seed must lose the same devices in the same rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from .profile import Device, trace_allows
from .seeding import uniform01

__all__ = ["dropout_point", "drops_out", "is_online", "online_devices", "over_select"]

T = TypeVar("T")


def is_online(device: Device, round_: int, seed: int) -> bool:
    """Whether ``device`` can be selected in ``round_``: its trace allows it and its ``p_online`` coin
    (keyed by seed, round, device) comes up."""
    profile = device.profile
    if profile.trace is not None and not trace_allows(profile.trace, round_):
        return False
    if profile.p_online >= 1.0:
        return True
    return uniform01("online", seed, round_, device.device_id) < profile.p_online


def drops_out(device: Device, round_: int, seed: int) -> bool:
    """Whether ``device``, once selected in ``round_``, vanishes before sending its update."""
    p = device.profile.p_dropout
    if p <= 0.0:
        return False
    return uniform01("dropout", seed, round_, device.device_id) < p


def dropout_point(device: Device, round_: int, seed: int) -> float | None:
    """If ``device`` drops out in ``round_``, how far into its task it got (0..1), else None.

    Why: a device that vanishes after downloading has still cost downlink bytes and some compute; the
    client can account for that share before going silent.
    """
    if not drops_out(device, round_, seed):
        return None
    return uniform01("dropout-point", seed, round_, device.device_id)


def online_devices(devices: Sequence[Device], round_: int, seed: int) -> list[Device]:
    """The devices of ``devices`` that are online in ``round_``, in the given order."""
    return [d for d in devices if is_online(d, round_, seed)]


def over_select(candidates: Sequence[T], k: int, factor: float, rng: np.random.Generator) -> list[T]:
    """Pick ``ceil(k x factor)`` of ``candidates`` (all of them if fewer) uniformly without replacement.

    FedScale-style over-commitment: the server invites more devices than it needs and keeps the first
    ``k`` updates, so dropouts and stragglers do not starve the round. Order is the draw order.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not math.isfinite(factor) or factor < 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    want = min(len(candidates), math.ceil(k * factor - 1e-9))
    if want == 0:
        return []
    picks = rng.choice(len(candidates), size=want, replace=False)
    return [candidates[int(i)] for i in picks]
