"""Held updates on disk: appended to a round's spool files, not one file per update.

Why: in first-finishers rounds a host holds each trained update until the server's ``go`` (issue 16:
hundreds per host at 10,000 devices, ~437 KB each), on disk because memory is what a constrained host
lacks. Written one file each (~325 per host and round), creating and deleting a file per update
was ~11 % of a client host's main-thread samples at 10,000 devices (py-spy,
benchmarks/results-scale.md), more than the bytes themselves. Here a round's updates are appended
to one file, read back by offset, and a file is deleted when the last of its updates is taken or
dropped.

A file takes at most :data:`FILE_BYTES`; the round's next update starts a new one. Why: an update the
server never asks for (one trained after the round's ``go`` went out) is dropped only when the next
round's first ``go`` comes, and until then it keeps its whole file on disk — with one file per round,
every update of the round already uploaded (~142 MB per host at 10,000 devices), on a pod whose
``data`` volume is 256 MiB.

Nothing is fsynced and nothing survives the process: after a crash the directory is emptied at
start, and a restarted host has forgotten which tasks it answered, so the server's ``go`` for one finds
nothing and that update is never sent twice.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

#: the most one spool file takes before the batch's next message starts another
FILE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Slot:
    """Where one held message is: its file (by number), offset and length."""

    file: int
    offset: int
    length: int


@dataclass
class _File:
    batch: Hashable
    path: Path
    fd: int
    size: int = 0
    #: slots put and not yet taken or dropped
    live: int = 0


class Spool:
    """Byte strings kept in ``directory``, appended to files per batch key, each read back once."""

    def __init__(self, directory: Path, file_bytes: int = FILE_BYTES) -> None:
        self.directory = directory
        self.file_bytes = file_bytes
        shutil.rmtree(directory, ignore_errors=True)
        self._files: dict[int, _File] = {}
        #: the file each batch appends to now
        self._current: dict[Hashable, int] = {}
        self._seq = 0

    def put(self, batch: Hashable, data: bytes) -> Slot:
        number = self._current.get(batch)
        if number not in self._files or self._files[number].size >= self.file_bytes:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._seq += 1
            number = self._current[batch] = self._seq
            path = self.directory / f"{number}.spool"
            self._files[number] = _File(
                batch, path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            )
        f = self._files[number]
        view = memoryview(data)
        while view:  # a regular file takes it all at once; the loop is for the rare short write
            view = view[os.pwrite(f.fd, view, f.size + len(data) - len(view)) :]
        slot = Slot(number, f.size, len(data))
        f.size += len(data)
        f.live += 1
        return slot

    def take(self, slot: Slot) -> bytes:
        """The message's bytes, exactly as put; the slot is released (also if reading fails)."""
        try:
            return self.read(slot)
        finally:
            self.drop(slot)

    def read(self, slot: Slot) -> bytes:
        """The message's bytes, the slot kept."""
        f = self._files[slot.file]
        parts, got = [], 0
        while got < slot.length:
            chunk = os.pread(f.fd, slot.length - got, slot.offset + got)
            if not chunk:
                raise OSError(f"{f.path} ends before its slot at {slot.offset} + {slot.length}")
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def drop(self, slot: Slot) -> None:
        """Release a slot without reading it; a file goes with its last slot."""
        f = self._files.get(slot.file)
        if f is None:
            return
        f.live -= 1
        if f.live <= 0:
            self._close(slot.file)

    def clear(self) -> None:
        for number in list(self._files):
            self._close(number)

    def files(self) -> int:
        """Spool files open now (what the tests look at)."""
        return len(self._files)

    def _close(self, number: int) -> None:
        f = self._files.pop(number)
        if self._current.get(f.batch) == number:
            del self._current[f.batch]
        os.close(f.fd)
        f.path.unlink(missing_ok=True)
