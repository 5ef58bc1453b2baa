"""The server's checkpoint: the state after a finished round, replaced atomically.

A directory holds a whole checkpoint once its ``state.json`` (written last) exists. A save writes
``checkpoint.tmp``, then renames ``checkpoint`` → ``checkpoint.old`` and ``checkpoint.tmp`` →
``checkpoint``. A kill between the two renames leaves only ``checkpoint.old`` whole; :func:`load`
restores it (that round is then run again, with the same seeds). ``checkpoint.tmp`` is never trusted:
a kill can leave it half written.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.algorithms.base import ServerState
from shared.algorithms.device_state import atomic_savez

log = logging.getLogger("fedfleet.server")


@dataclass
class Checkpoint:
    round: int
    state: ServerState
    #: the run ledger's part (``RunLedger.to_checkpoint``)
    ledger: dict[str, Any]


def save(run_dir: Path, ckpt: Checkpoint) -> None:
    ckpt_dir = run_dir / "checkpoint"
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    atomic_savez(tmp / "state.npz", ckpt.state.arrays)
    meta = {
        "round": ckpt.round,
        "state_meta": ckpt.state.meta,
        **ckpt.ledger,
    }
    (tmp / "state.json").write_text(json.dumps(meta))
    old = run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if ckpt_dir.exists():
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)


def load(run_dir: Path) -> Checkpoint | None:
    """The last whole checkpoint in ``run_dir``, or None when there is none."""
    ckpt_dir = run_dir / "checkpoint"
    old = run_dir / "checkpoint.old"
    if not (ckpt_dir / "state.json").exists() and (old / "state.json").exists():
        log.warning(
            "no checkpoint at %s (the server was stopped while replacing it); restoring %s",
            ckpt_dir,
            old,
            extra={"event": "checkpoint_fallback"},
        )
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        old.rename(ckpt_dir)  # so the next save cannot delete the only whole checkpoint
    if not (ckpt_dir / "state.json").exists():
        return None
    meta = json.loads((ckpt_dir / "state.json").read_text())
    with np.load(ckpt_dir / "state.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta.pop("registry", None)  # written by checkpoints before the fleet was leased
    return Checkpoint(
        round=int(meta.pop("round")), state=ServerState(arrays, meta.pop("state_meta")), ledger=meta
    )
