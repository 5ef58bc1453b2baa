"""The machine's fedfleet cache directory (``FEDFLEET_CACHE_DIR``, see ``Settings.cache_dir``).

Why a cache at all: every process of a run builds the same experiment. Decoding a dataset once and
memory-mapping the result lets the processes share one copy of it in the page cache instead of each
holding its own (issue 16, lean processes); the same goes for a model's layout (``shared.statespec``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The cache directory (not created here; writers create it and tolerate failing to)."""
    from shared.config import Settings

    configured = Settings().cache_dir
    if configured is not None:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # no home directory (a container's arbitrary user id)
            base = os.path.join(tempfile.gettempdir(), "fedfleet-cache")
    return Path(base) / "fedfleet"
