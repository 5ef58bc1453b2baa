"""The server's checkpoint: the state after a finished round, verified before it replaces anything.

Layout of ``<run_dir>``: ``checkpoint/`` (the latest), ``checkpoint.old/`` (the one before it),
``checkpoint.tmp/`` (a save in progress, never trusted: a kill can leave it half written).

A checkpoint directory holds ``state.npz`` (the global arrays), ``state.json`` (round, strategy meta,
the ledger) and ``checksums.json`` (SHA-256 of both, written last: a directory without it is not
whole). A save writes ``checkpoint.tmp``, reads it back and checks it — checksums, every array
finite — and only then renames ``checkpoint`` → ``checkpoint.old`` and ``checkpoint.tmp`` →
``checkpoint``. So the previous checkpoint survives until the new one is known good, and one
generation back is always kept.

What grows with the run — the rows of ``rounds.csv`` and the statistics of every device ever
touched — is not rewritten into each checkpoint. Each save appends what changed since the last one
(the new rows, the devices whose statistics moved) to ``<run_dir>/ledger.jsonl``, one JSON line, and
the checkpoint records the journal's length and SHA-256 at that point (its *mark*). Loading a
checkpoint replays the journal's prefix up to its mark, verified, and whatever lies beyond the mark (a
save that did not finish, or the line of a checkpoint that was given up) is cut off when the run goes
on. Why: with the whole ledger in ``state.json`` a save cost O(rounds + devices touched), so a long
run spent more and more of each round writing and re-reading its own history (``python
benchmarks/bench_checkpoint.py`` on the commit before the journal: a round's bookkeeping went from 4
ms at round 10 to 39 ms at round 1,000 with 50 devices, and to 166 ms by round 100 with 1,300 of
10,000 devices a round). Both generations share the journal: a damaged line breaks the
checkpoints whose prefix holds it, and ``load`` falls back to the previous one only if its shorter
prefix is intact. The journal is read one line at a time, and compacted into a new generation once it
outgrows the ledger it rebuilds (:class:`Journal`), so neither a resume's memory nor the disk grows
without bound.

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
import os
import re
import shutil
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np

from services.server.errors import CheckpointError
from shared.algorithms.base import ServerState
from shared.algorithms.device_state import atomic_savez

log = logging.getLogger("fedfleet.server")

LATEST, PREVIOUS, PENDING = "checkpoint", "checkpoint.old", "checkpoint.tmp"
#: a latest checkpoint found unusable is moved here (kept for a post-mortem, never loaded)
REJECTED = "checkpoint.corrupt"
ARRAYS, META, SUMS = "state.npz", "state.json", "checksums.json"
#: in the run directory, beside the checkpoints: see the module's docstring; a compacted journal's
#: generations are ``ledger.<n>.jsonl``, each starting with the whole ledger
JOURNAL = "ledger.jsonl"
_GENERATION = re.compile(r"ledger(?:\.([0-9]+))?\.jsonl")
#: a journal is compacted (a new generation starts with the whole ledger) once it is larger than
#: both of these: a floor, so that short runs never compact, and a multiple of the ledger's own
#: size, so that compacting costs a bounded share of what the journal writes
COMPACT_MIN_BYTES = 16 << 20
COMPACT_RATIO = 4


class Mark(TypedDict):
    """How much of the journal a checkpoint covers: its length in bytes and their SHA-256, and in
    which generation (absent: ``ledger.jsonl``, the only one before a compaction)."""

    bytes: int
    sha256: str
    file: NotRequired[str]


def _generation(mark: Mapping[str, Any] | None) -> str:
    """The journal file ``mark`` covers, checked (a name from ``state.json``, never a path)."""
    name = JOURNAL if mark is None else mark.get("file", JOURNAL)
    if not isinstance(name, str) or not _GENERATION.fullmatch(name):
        raise CheckpointError(f"{META} names no valid journal file ({name!r})")
    return name


@dataclass
class Checkpoint:
    round: int
    state: ServerState
    #: the run ledger's fixed-size part (``RunLedger.to_checkpoint``), kept in ``state.json``
    ledger: dict[str, Any]
    #: on save, what this checkpoint adds to the journal (``RunLedger.to_journal``: usually one
    #: entry); on load, every entry up to the checkpoint's mark, in order (:class:`JournalEntries`,
    #: read from disk as it is iterated)
    journal: Iterable[dict[str, Any]] = field(default_factory=list)
    #: on load, the checkpoint's mark (None: a checkpoint from before the journal, or none)
    mark: Mark | None = None
    #: on save, ``journal`` is the whole ledger and starts a new generation (``Journal.compacting``)
    snapshot: bool = False


class Journal:
    """The run's journal, opened for appending at a checkpoint's mark.

    It keeps the running SHA-256 and length, so a save hashes only what it appends, and can take
    back its last append when the save that made it fails (else the next save would append the
    same changes again and the replay would count them twice).

    Compaction: appends alone grow without end (87 KB a round at 1,300 devices a round, so ~1 GB
    by round 10,000), although the ledger they rebuild is bounded by the devices and rounds it
    holds. Once the journal is larger than ``COMPACT_MIN_BYTES`` and ``COMPACT_RATIO`` times the
    whole ledger it last started from, the server's next save writes the whole ledger as the first
    line of a new generation (``rotate``); ``save`` deletes a generation once neither the latest
    nor the previous checkpoint covers it, so at most two lie on disk.
    """

    def __init__(self, run_dir: Path, mark: Mark | None) -> None:
        """Open ``run_dir``'s journal cut to ``mark`` (None: empty), so that appends continue the
        prefix the resumed checkpoint verified. ``mark`` must be one ``load`` returned."""
        self.run_dir = run_dir
        self.file = _generation(mark)
        self._hash = _verified(self.path, mark, parse=False) if mark is not None else hashlib.sha256()
        self._size = mark["bytes"] if mark is not None else 0
        run_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            f.truncate(self._size)
        #: bytes of the whole ledger this generation starts with (0: ``ledger.jsonl``, which
        #: starts empty)
        self._base = 0
        if self.file != JOURNAL:
            with self.path.open("rb") as f:
                self._base = len(f.readline(self._size))
        self._before: tuple[Any, int, str, int] | None = None

    @property
    def path(self) -> Path:
        return self.run_dir / self.file

    def compacting(self) -> bool:
        """Whether the next save should start a new generation with the whole ledger (``rotate``)."""
        return self._size > max(COMPACT_MIN_BYTES, COMPACT_RATIO * self._base)

    def append(self, data: bytes) -> Mark:
        """Append ``data`` (whole lines); returns the mark of the journal after it."""
        self._before = (self._hash.copy(), self._size, self.file, self._base)
        # unbuffered at the mark: a full disk fails a write after part of it reached the file, and
        # a buffered file would try (and fail) to flush the rest before truncating; the cut is made
        # by path, after the file is closed, so no partial line stays behind
        try:
            with self.path.open("r+b", buffering=0) as f:
                f.seek(self._size)
                view = memoryview(data)
                while view:
                    view = view[f.write(view) or 0 :]
                f.truncate()
        except BaseException:
            os.truncate(self.path, self._size)
            raise
        self._hash.update(data)
        self._size += len(data)
        return self._mark()

    def rotate(self, data: bytes) -> Mark:
        """Start the next generation with ``data`` (the whole ledger); returns its mark. The one
        before stays until no checkpoint covers it (``save``)."""
        match = _GENERATION.fullmatch(self.file)
        number = int(match.group(1) or 0) + 1 if match else 1
        new = f"ledger.{number}.jsonl"
        try:
            with (self.run_dir / new).open("wb") as f:
                f.write(data)
                f.flush()
        except BaseException:
            (self.run_dir / new).unlink(missing_ok=True)
            raise
        self._before = (self._hash, self._size, self.file, self._base)
        self.file, self._hash, self._size, self._base = new, hashlib.sha256(data), len(data), len(data)
        return self._mark()

    def _mark(self) -> Mark:
        mark = Mark(bytes=self._size, sha256=self._hash.hexdigest())
        if self.file != JOURNAL:
            mark["file"] = self.file
        return mark

    def undo(self) -> None:
        """Take back the last ``append`` or ``rotate`` (its save failed)."""
        if self._before is None:
            return
        rotated = self._before[2] != self.file
        if rotated:
            self.path.unlink(missing_ok=True)
        self._hash, self._size, self.file, self._base = self._before
        self._before = None
        if not rotated:
            with self.path.open("ab") as f:
                f.truncate(self._size)


def _prune(run_dir: Path, keep: set[str]) -> None:
    """Delete the journal generations that no checkpoint in ``keep`` covers (``checkpoint.corrupt``,
    kept only for a post-mortem, does not count: its generation may go)."""
    for path in run_dir.glob("ledger*.jsonl"):
        if _GENERATION.fullmatch(path.name) and path.name not in keep:
            path.unlink(missing_ok=True)


def _covered(path: Path) -> str | None:
    """The journal file the checkpoint in ``path`` covers; None if it cannot be told (then no
    generation may be deleted)."""
    try:
        found = json.loads((path / META).read_text()).get("journal")
        return _generation(found) if isinstance(found, dict) else JOURNAL
    except (OSError, ValueError, AttributeError, CheckpointError):
        return None


def _lines(path: Path, nbytes: int) -> Iterator[bytes]:
    """The journal's lines within its first ``nbytes`` bytes, one at a time (never all of it in
    memory: at 1,300 devices a round the journal grows ~87 KB a round, and its parsed entries take
    several times that)."""
    with path.open("rb") as f:
        while nbytes > 0:
            line = f.readline(nbytes)
            if not line:
                return
            nbytes -= len(line)
            yield line


def _verified(path: Path, mark: Mark, *, parse: bool) -> Any:
    """The SHA-256 object of the journal's first ``mark["bytes"]`` bytes once they match ``mark``
    (``parse``: and every line in them is a JSON object), else :class:`CheckpointError`. A line
    that does not parse is reported only after the hash: a flipped byte reads as corrupt."""
    digest, size, bad = hashlib.sha256(), 0, ""
    try:
        for line in _lines(path, mark["bytes"]):
            digest.update(line)
            size += len(line)
            if parse and not bad:
                try:
                    if not isinstance(json.loads(line), dict):
                        bad = "holds a line that is not an object"
                except ValueError as err:
                    bad = f"unreadable ({err})"
    except OSError as err:
        raise CheckpointError(f"{path.name} unreadable ({err})") from None
    if size < mark["bytes"]:
        raise CheckpointError(f"{path.name} is shorter than the checkpoint's mark (truncated)")
    if digest.hexdigest() != mark["sha256"]:
        raise CheckpointError(f"{path.name} does not match the checkpoint's mark (corrupt)")
    if bad:
        raise CheckpointError(f"{path.name} {bad}")
    return digest


class JournalEntries:
    """A verified journal prefix's entries, parsed one line at a time on each iteration, so that a
    resume never holds the whole history at once (``RunLedger.restore`` folds them as they come)."""

    def __init__(self, path: Path, mark: Mark) -> None:
        self.path, self.nbytes = path, mark["bytes"]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for line in _lines(self.path, self.nbytes):
            entry: dict[str, Any] = json.loads(line)
            yield entry


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _non_finite(arrays: dict[str, np.ndarray]) -> list[str]:
    return [k for k, v in arrays.items() if v.dtype.kind in "fc" and not np.isfinite(v).all()]


def save(run_dir: Path, ckpt: Checkpoint, journal: Journal) -> None:
    """Append ``ckpt.journal`` to ``journal``, write ``ckpt`` with the journal's new mark, verify it,
    then make it the latest (the one it replaces becomes the previous).

    Raises :class:`CheckpointError` (and changes nothing, the journal included) when the state or
    the metadata is not finite: a NaN model must never replace a good checkpoint.
    """
    if bad := _non_finite(ckpt.state.arrays):
        raise CheckpointError(f"round {ckpt.round}: not checkpointed, non-finite values in {bad[:5]}")
    meta: dict[str, Any] = {"round": ckpt.round, "state_meta": ckpt.state.meta, **ckpt.ledger}
    try:
        json.dumps(meta, allow_nan=False)
        lines = b"".join(json.dumps(e, allow_nan=False).encode() + b"\n" for e in ckpt.journal)
    except ValueError as err:
        raise CheckpointError(f"round {ckpt.round}: not checkpointed, non-finite metadata ({err})") from None
    latest, previous, tmp = run_dir / LATEST, run_dir / PREVIOUS, run_dir / PENDING
    meta["journal"] = journal.rotate(lines) if ckpt.snapshot else journal.append(lines)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        atomic_savez(tmp / ARRAYS, ckpt.state.arrays)
        (tmp / META).write_text(json.dumps(meta, allow_nan=False))
        (tmp / SUMS).write_text(json.dumps({name: _sha256(tmp / name) for name in (ARRAYS, META)}))
        _read(tmp)  # the new checkpoint is verified before the previous one is touched
    except BaseException:
        journal.undo()
        raise
    if _whole(latest):
        shutil.rmtree(previous, ignore_errors=True)
        latest.rename(previous)
    else:  # a broken latest (or none): keep the previous one as it is
        shutil.rmtree(latest, ignore_errors=True)
    tmp.rename(latest)
    keep = {journal.file, _covered(previous) if previous.exists() else journal.file}
    if None not in keep:
        _prune(run_dir, {k for k in keep if k is not None})


def _whole(path: Path) -> bool:
    """Whether ``path`` passes :func:`_read` (without keeping what it read; the journal is not
    re-read: the checkpoint that replaces it is checked against it when it is loaded)."""
    try:
        _read(path)
    except CheckpointError:
        return False
    return True


def _read(path: Path, *, replay: bool = False) -> Checkpoint:
    """The checkpoint in ``path``, or :class:`CheckpointError` saying what is wrong with it.

    ``replay``: also read and verify the journal up to the checkpoint's mark (``Checkpoint.journal``).
    """
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
    found = meta.pop("journal", None)  # absent in checkpoints from before the journal
    mark: Mark | None = None
    if found is not None:
        if not (
            isinstance(found, dict)
            and isinstance(found.get("bytes"), int)
            and found["bytes"] >= 0
            and isinstance(found.get("sha256"), str)
        ):
            raise CheckpointError(f"{META} holds no valid journal mark")
        mark = Mark(bytes=found["bytes"], sha256=found["sha256"])
        if "file" in found:
            mark["file"] = found["file"]
    entries: Iterable[dict[str, Any]] = []
    if replay and mark is not None:
        journal = path.parent / _generation(mark)
        _verified(journal, mark, parse=True)
        entries = JournalEntries(journal, mark)
    state = ServerState(arrays, state_meta)
    return Checkpoint(round=round_, state=state, ledger=meta, journal=entries, mark=mark)


def load(run_dir: Path) -> Checkpoint | None:
    """The latest usable checkpoint in ``run_dir``; None when the run has none (a new run).

    Falls back to the previous checkpoint, with a warning, when the latest is unusable; raises
    :class:`CheckpointError` when checkpoints exist but none is usable.
    """
    latest, previous = run_dir / LATEST, run_dir / PREVIOUS
    if not latest.exists() and not previous.exists():
        return None
    try:
        return _read(latest, replay=True)
    except CheckpointError as err:
        why_latest = str(err)
    try:
        ckpt = _read(previous, replay=True)
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
