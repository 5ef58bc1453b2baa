"""How many devices, and how large, a client host can take: from its memory limit.

Why the host says it: on Kubernetes a pod's memory limit is the hard truth (the kernel kills a pod
that crosses it), and only the pod can read it (its cgroup). The server then never leases a host
more devices than fit, nor a device whose largest task would not fit beside them.

A host trains one task at a time, so memory is: the process itself (interpreter, torch, the mapped
dataset) + every hosted device's resident part (at most its data split, sliced while it trains; its
state is on disk) + the largest task it may train. ``--max-devices`` caps the count further.
"""

from __future__ import annotations

import os
from pathlib import Path

#: memory kept free for allocator slack, message buffers and the broker connection
HEADROOM_BYTES = 64 * 1024 * 1024
_CGROUP_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)
#: cgroup v1 reports "no limit" as a huge number
_NO_LIMIT = 1 << 60


def memory_limit() -> int | None:
    """The container's memory limit in bytes (None: none set)."""
    for path in _CGROUP_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= _NO_LIMIT else value
    return None


def resident_bytes() -> int:
    """This process's resident set size now."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def host_budget(
    limit: int | None, per_device_bytes: int, largest_task_bytes: int, max_devices: int | None
) -> tuple[int | None, int | None]:
    """(capacity in devices, memory for one task in bytes) of a host with ``limit`` bytes.

    Without a limit the capacity is ``max_devices`` (None: any) and the memory unknown (None). With
    one, the devices' resident parts and the largest task must fit beside the process as it is now.
    """
    if limit is None:
        return max_devices, None
    free = max(0, limit - resident_bytes() - HEADROOM_BYTES)
    room = max(0, free - largest_task_bytes)
    fit = room // max(1, per_device_bytes)
    capacity = int(fit) if max_devices is None else min(int(fit), max_devices)
    return capacity, free
