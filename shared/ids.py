"""Device ids as the compact per-device tables take them.

Why one function: the server's registry, its lease sets and a client host's served-ids flags all
index arrays by device id, and each must answer membership for anything a caller passes (numpy
integers, as dict keys took them; never ``True`` as device 1) without raising.
"""

from __future__ import annotations

import operator


def device_id(obj: object) -> int | None:
    """``obj`` as a device id (an ``int``, numpy integers included), else None (``bool`` too)."""
    if isinstance(obj, bool):
        return None
    try:
        return operator.index(obj)  # type: ignore[arg-type]
    except TypeError:
        return None
