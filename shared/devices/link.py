"""Link and compute emulation: how long a transfer or a training task takes on a device.

Two time modes (docs/architecture.md, "Devices and budgets"):

- ``virtual`` (default): durations are *computed* (latency + bytes x 8 / bandwidth; FLOPs / FLOP/s) and
  advance a :class:`VirtualClock`; nothing sleeps, so runs go as fast as the CPU allows and the same
  seed gives the same round times on any machine;
- ``real``: the client really slows down, by a time factor (factor 10 = ten times faster than the
  emulated device), with a :class:`TokenBucket` pacing the bytes, so live dashboards show real dynamics.

Clock and sleep functions are injectable everywhere, so tests never sleep.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Literal

from .profile import DeviceProfile

__all__ = [
    "TimeMode",
    "TokenBucket",
    "VirtualClock",
    "compute_seconds",
    "emulate_compute",
    "emulate_transfer",
    "throttle",
    "transfer_seconds",
]

TimeMode = Literal["virtual", "real"]
Direction = Literal["up", "down"]


def _check_finite(name: str, value: float, *, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} and finite, got {value}")


def transfer_seconds(bytes_: int, bandwidth_bps: float, latency_s: float = 0.0) -> float:
    """Emulated duration of one transfer: ``latency + bytes x 8 / bandwidth`` (bandwidth in bit/s).

    One latency per message: a task sent as several messages (EmbracingFL's prefix chunks) pays it once
    per message, which is the point of modelling it.
    """
    _check_finite("bytes_", bytes_)
    _check_finite("bandwidth_bps", bandwidth_bps, positive=True)
    _check_finite("latency_s", latency_s)
    return latency_s + bytes_ * 8.0 / bandwidth_bps


def compute_seconds(flops: float, flops_per_s: float) -> float:
    """Emulated compute time: FLOPs / device speed."""
    _check_finite("flops", flops)
    _check_finite("flops_per_s", flops_per_s, positive=True)
    return flops / flops_per_s


class VirtualClock:
    """A deterministic clock: a global ``now`` plus one timeline per device.

    A round starts at ``now``; each device's download, compute and upload ``advance`` its own timeline
    from there (devices work in parallel, so their times do not add up). ``sync`` closes the round by
    moving ``now`` to the slowest device, or to a deadline, and brings every device up to it. Time never
    goes backwards; no wall clock is read, so the same inputs give the same times.
    """

    def __init__(self, start: float = 0.0) -> None:
        _check_finite("start", start)
        self._now = float(start)
        self._devices: dict[int, float] = {}
        self._lock = threading.Lock()

    @property
    def now(self) -> float:
        return self._now

    def time_of(self, device_id: int) -> float:
        """Where ``device_id``'s timeline is (``now`` if it has not advanced since the last sync)."""
        with self._lock:
            return max(self._now, self._devices.get(device_id, self._now))

    def advance(self, device_id: int, seconds: float) -> float:
        """Spend ``seconds`` on ``device_id``; returns its new time."""
        _check_finite("seconds", seconds)
        with self._lock:
            t = max(self._now, self._devices.get(device_id, self._now)) + seconds
            self._devices[device_id] = t
            return t

    def elapsed(self, device_id: int) -> float:
        """Seconds ``device_id`` has spent since the last sync (its contribution to the round)."""
        return self.time_of(device_id) - self._now

    def sync(self, until: float | None = None) -> float:
        """Move ``now`` to ``until`` (a deadline) or, if None, to the latest device; returns ``now``.

        Devices still behind are brought up to ``now``; devices beyond a deadline keep their time (a
        straggler still busy) and are reported by :meth:`stragglers` until the clock catches up.
        """
        with self._lock:
            target = max(self._devices.values(), default=self._now) if until is None else float(until)
            if not math.isfinite(target) or target < self._now:
                raise ValueError(f"the clock is at {self._now}; cannot move it to {target}")
            self._now = target
            self._devices = {d: t for d, t in self._devices.items() if t > target}
            return self._now

    def stragglers(self) -> dict[int, float]:
        """Devices whose timeline is ahead of ``now`` (still busy after a deadline), with their times."""
        with self._lock:
            return {d: t for d, t in self._devices.items() if t > self._now}


class TokenBucket:
    """Paces bytes to ``rate_bps x time_factor`` bits per real second (real time mode).

    Tokens are bytes. The bucket starts empty and holds at most ``burst_bytes``, so a transfer of n bytes
    from idle takes ``(n x 8 / rate) / time_factor`` seconds (plus whatever ``burst_bytes`` allows to go
    at once). Consuming more than is available creates a debt that is slept off, so pacing a transfer in
    many small chunks or in one call gives the same total time.
    """

    def __init__(
        self,
        rate_bps: float,
        time_factor: float = 1.0,
        *,
        burst_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        _check_finite("rate_bps", rate_bps, positive=True)
        _check_finite("time_factor", time_factor, positive=True)
        _check_finite("burst_bytes", burst_bytes)
        self.bytes_per_s = rate_bps * time_factor / 8.0
        self.burst_bytes = float(burst_bytes)
        self._clock = clock
        self._sleep = sleep
        self._tokens = 0.0
        self._last = clock()
        self._lock = threading.Lock()

    def consume(self, nbytes: int) -> float:
        """Take ``nbytes`` through the bucket, sleeping as needed; returns the seconds slept."""
        _check_finite("nbytes", nbytes)
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.bytes_per_s if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait


def throttle(
    nbytes: int,
    rate_bps: float,
    time_factor: float = 1.0,
    *,
    latency_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Make one transfer take ``(latency + nbytes x 8 / rate) / time_factor`` real seconds.

    Returns the emulated (unscaled) duration, the number the metrics and results report.
    """
    emulated = transfer_seconds(nbytes, rate_bps, latency_s)
    if latency_s > 0:
        sleep(latency_s / time_factor)
    TokenBucket(rate_bps, time_factor, clock=clock, sleep=sleep).consume(nbytes)
    return emulated


def emulate_transfer(
    nbytes: int,
    profile: DeviceProfile,
    direction: Direction,
    *,
    mode: TimeMode = "virtual",
    time_factor: float = 1.0,
    messages: int = 1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """The emulated seconds of sending ``nbytes`` over ``profile``'s link (``up`` or ``down``).

    In ``virtual`` mode this only computes; in ``real`` mode it also paces the caller (see
    :func:`throttle`). Either way the returned number is the emulated duration. ``messages``: how
    many messages the bytes travel in on the device's link; each pays the latency once.
    """
    if messages < 1:
        raise ValueError(f"messages must be ≥ 1, got {messages}")
    rate = profile.uplink_bps if direction == "up" else profile.downlink_bps
    latency = profile.latency_s * messages
    if mode == "virtual":
        return transfer_seconds(nbytes, rate, latency)
    return throttle(nbytes, rate, time_factor, latency_s=latency, clock=clock, sleep=sleep)


def emulate_compute(
    flops: float,
    profile: DeviceProfile,
    *,
    mode: TimeMode = "virtual",
    time_factor: float = 1.0,
    measured_s: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """The emulated seconds of ``flops`` on ``profile``'s processor.

    In ``real`` mode the caller has already trained for ``measured_s`` wall seconds; this sleeps the
    rest so the task takes ``emulated / time_factor`` in total. (If this machine was slower than the
    scaled device, nothing is slept; the emulated number is still what is reported.)
    """
    emulated = compute_seconds(flops, profile.flops_per_s)
    if mode == "real":
        _check_finite("time_factor", time_factor, positive=True)
        remaining = emulated / time_factor - measured_s
        if remaining > 0:
            sleep(remaining)
    return emulated
