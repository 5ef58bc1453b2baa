"""The server's checkpoint: the state after a finished round, verified before it replaces anything.

Layout of ``<run_dir>``: ``checkpoint/`` (the latest), ``checkpoint.old/`` (the one before it),
``checkpoint.tmp/`` (a save in progress, never trusted: a kill can leave it half written).

A checkpoint directory holds ``state.npz`` (the global arrays), ``state.json`` (round, strategy meta,
the ledger) and ``checksums.json`` (SHA-256 of both, written last: a directory without it is not
whole). A save writes ``checkpoint.tmp``, reads it back and checks it — checksums, every array
finite — and only then renames ``checkpoint`` → ``checkpoint.old`` and ``checkpoint.tmp`` →
``checkpoint``. So the previous checkpoint survives until the new one is known good, and one
generation back is always kept.

Why keep one back and check on load too: a disk can truncate or flip a file after it was written,
and a state holding NaN would resume a run that can only produce NaN. :func:`load` therefore tries
the latest, and if it is missing, truncated, corrupt or non-finite, falls back to the previous one
with a warning (the round after it is run again, with the same seeds, and the devices keep the
state one round back for exactly that). When neither is usable it raises :class:`CheckpointError`,
whose message says what is wrong with each and what to do — the CLI prints it, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.algorithms.base import ServerState
from shared.algorithms.device_state import atomic_savez

log = logging.getLogger("fedfleet.server")

LATEST, PREVIOUS, PENDING = "checkpoint", "checkpoint.old", "checkpoint.tmp"
#: a latest checkpoint found unusable is moved here (kept for a post-mortem, never loaded)
REJECTED = "checkpoint.corrupt"
ARRAYS, META, SUMS = "state.npz", "state.json", "checksums.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint (or one that must not be written), said in words a user can act on."""


@dataclass
class Checkpoint:
    round: int
    state: ServerState
    #: the run ledger's part (``RunLedger.to_checkpoint``)
    ledger: dict[str, Any]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _non_finite(arrays: dict[str, np.ndarray]) -> list[str]:
    return [k for k, v in arrays.items() if v.dtype.kind in "fc" and not np.isfinite(v).all()]


def save(run_dir: Path, ckpt: Checkpoint) -> None:
    """Write ``ckpt``, verify it, then make it the latest (the one it replaces becomes the previous).

    Raises :class:`CheckpointError` (and changes nothing) when the state is not finite: a NaN model
    must never replace a good checkpoint.
    """
    if bad := _non_finite(ckpt.state.arrays):
        raise CheckpointError(f"round {ckpt.round}: not checkpointed, non-finite values in {bad[:5]}")
    latest, previous, tmp = run_dir / LATEST, run_dir / PREVIOUS, run_dir / PENDING
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    atomic_savez(tmp / ARRAYS, ckpt.state.arrays)
    meta = {"round": ckpt.round, "state_meta": ckpt.state.meta, **ckpt.ledger}
    try:
        (tmp / META).write_text(json.dumps(meta, allow_nan=False))
    except ValueError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"round {ckpt.round}: not checkpointed, non-finite metadata ({err})") from None
    (tmp / SUMS).write_text(json.dumps({name: _sha256(tmp / name) for name in (ARRAYS, META)}))
    _read(tmp)  # the new checkpoint is verified before the previous one is touched
    if _whole(latest):
        shutil.rmtree(previous, ignore_errors=True)
        latest.rename(previous)
    else:  # a broken latest (or none): keep the previous one as it is
        shutil.rmtree(latest, ignore_errors=True)
    tmp.rename(latest)


def _whole(path: Path) -> bool:
    """Whether ``path`` passes :func:`_read` (without keeping what it read)."""
    try:
        _read(path)
    except CheckpointError:
        return False
    return True


def _read(path: Path) -> Checkpoint:
    """The checkpoint in ``path``, or :class:`CheckpointError` saying what is wrong with it."""
    if not path.is_dir():
        raise CheckpointError("missing")
    sums_path = path / SUMS
    if sums_path.exists():
        try:
            sums = json.loads(sums_path.read_text())
        except (ValueError, OSError) as err:
            raise CheckpointError(f"{SUMS} unreadable ({err})") from None
        for name in (ARRAYS, META):
            if not (path / name).exists():
                raise CheckpointError(f"{name} missing")
            if not isinstance(sums, dict) or sums.get(name) != _sha256(path / name):
                raise CheckpointError(f"{name} does not match its checksum (truncated or corrupt)")
    elif (path / META).exists():  # written before checkpoints had checksums: readable, unverified
        log.warning(
            "checkpoint %s has no checksums; reading it unverified", path, extra={"event": "checkpoint"}
        )
    else:
        raise CheckpointError(f"incomplete (no {SUMS}): its save did not finish")
    try:
        meta = json.loads((path / META).read_text())
        with np.load(path / ARRAYS, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        round_, state_meta = int(meta.pop("round")), meta.pop("state_meta")
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"unreadable ({type(err).__name__}: {err})") from None
    if bad := _non_finite(arrays):
        raise CheckpointError(f"non-finite values in {bad[:5]}")
    meta.pop("registry", None)  # written by checkpoints before the fleet was leased
    return Checkpoint(round=round_, state=ServerState(arrays, state_meta), ledger=meta)


def load(run_dir: Path) -> Checkpoint | None:
    """The latest usable checkpoint in ``run_dir``; None when the run has none (a new run).

    Falls back to the previous checkpoint, with a warning, when the latest is unusable; raises
    :class:`CheckpointError` when checkpoints exist but none is usable.
    """
    latest, previous = run_dir / LATEST, run_dir / PREVIOUS
    if not latest.exists() and not previous.exists():
        return None
    try:
        return _read(latest)
    except CheckpointError as err:
        why_latest = str(err)
    try:
        ckpt = _read(previous)
    except CheckpointError as err:
        raise CheckpointError(
            f"no usable checkpoint in {run_dir}: {LATEST}/ is {why_latest}; {PREVIOUS}/ is {err}. "
            "Resume is impossible; start the run over in a new run directory (--run-id), or move "
            f"{LATEST}/ and {PREVIOUS}/ away to restart this one from round 1."
        ) from None
    log.warning(
        "checkpoint %s is %s; falling back to the previous one (round %d), whose next round runs again",
        latest,
        why_latest,
        ckpt.round,
        extra={"event": "checkpoint_fallback"},
    )
    if latest.exists():  # kept for a post-mortem, out of the way of the next save
        shutil.rmtree(run_dir / REJECTED, ignore_errors=True)
        latest.rename(run_dir / REJECTED)
    previous.rename(latest)  # so the next save cannot delete the only good checkpoint
    return ckpt
