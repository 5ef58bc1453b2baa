"""A device's private state between tasks, one file per round, so that a replayed task is not trained twice.

Why by round: a task can run twice. The client may die after saving the device's new state but before
its update is confirmed (the broker then redelivers the task), or the server may resume from a
checkpoint older than the clients' files. With a single state file the second run would start from the
state the first run already advanced, and the device's local work would count twice. With one file
per round, a task of round r always starts from the newest state of a round *before* r, and running it
again rewrites the same file with the same result.

Files are ``<prefix>-<round>.npz`` in the device's ``state_dir``, and ``<prefix>.first`` records the
round of the device's first task (a replay of it starts from the initial model). Saving round r keeps
the newest earlier file (a replay of round r needs it) and removes older ones and any of a round after
r (a timeline the server abandoned when it resumed from an older checkpoint).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

log = logging.getLogger(__name__)


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        write(f)
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see ``_atomic_write``)."""
    _atomic_write(path, lambda f: f.write(data))


def atomic_savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write an ``.npz`` atomically (see ``_atomic_write``)."""
    _atomic_write(path, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]


def _files(state_dir: Path, prefix: str) -> list[tuple[int, Path]]:
    """(round, path) of every saved state, oldest first."""
    if not state_dir.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)\.npz$")
    return sorted((int(m.group(1)), p) for p in state_dir.iterdir() if (m := pattern.match(p.name)))


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_before(state_dir: Path, prefix: str, round: int) -> dict[str, np.ndarray] | None:
    """The newest state saved by a task of a round before ``round`` (None: the device has none).

    If only states of ``round`` or later exist (the server resumed from a checkpoint older than the
    last round before this device's previous task, whose file is gone), the oldest of them is used
    and a warning logged: the exact start is lost either way, and a device that has trained must
    never silently restart from the initial model.
    """
    found = _files(state_dir, prefix)
    if not found or round <= _first_round(state_dir, prefix):
        return None  # the device's first task (or a replay of it) starts from the initial model
    earlier = [p for r, p in found if r < round]
    if earlier:
        return _load(earlier[-1])
    log.warning(
        "%s: no %s state before round %d; continuing from round %d's",
        state_dir,
        prefix,
        round,
        found[0][0],
        extra={"event": "device_state_fallback"},
    )
    return _load(found[0][1])


def load_latest(state_dir: Path, prefix: str) -> dict[str, np.ndarray] | None:
    """The newest saved state of any round: what the device holds now (for evaluation)."""
    found = _files(state_dir, prefix)
    return _load(found[-1][1]) if found else None


def _first_round(state_dir: Path, prefix: str) -> int:
    """The round of the device's first saved task (pruning removes its file, not this record)."""
    path = state_dir / f"{prefix}.first"
    return int(path.read_text()) if path.exists() else 0


def save(state_dir: Path, prefix: str, round: int, arrays: dict[str, np.ndarray]) -> None:
    """Save the state a task of ``round`` produced; keep only what a replay of it could need."""
    first = _first_round(state_dir, prefix)
    if first == 0 or round < first:
        _atomic_write(state_dir / f"{prefix}.first", lambda f: f.write(str(round).encode()))
    atomic_savez(state_dir / f"{prefix}-{round}.npz", arrays)
    found = _files(state_dir, prefix)
    earlier = [r for r, _ in found if r < round]
    for r, p in found:
        if r > round or (r < round and r != earlier[-1]):
            p.unlink(missing_ok=True)
