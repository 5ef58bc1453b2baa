"""Held updates on disk: one append-only file per round, not one file per update.

Why: in first-finishers rounds a host holds each trained update until the server's ``go`` (issue 16:
hundreds per host at 10,000 devices, ~437 KB each), on disk because memory is what a constrained host
lacks. Written one file each, creating and deleting ~1,300 files a round was ~9 % of a client
host's wall time at 10,000 devices (py-spy: ``Path.open`` in ``_hold``), more than the bytes
themselves. Here a round's updates are appended to one file, read back by offset, and the file is
deleted when the last of them is taken or dropped.

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


@dataclass(frozen=True)
class Slot:
    """Where one held message is: its batch's file, offset and length."""

    batch: Hashable
    offset: int
    length: int


@dataclass
class _File:
    path: Path
    fd: int
    size: int = 0
    #: slots put and not yet taken or dropped
    live: int = 0


class Spool:
    """Byte strings kept in ``directory``, one file per batch key, each read back once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)
        self._files: dict[Hashable, _File] = {}
        self._seq = 0

    def put(self, batch: Hashable, data: bytes) -> Slot:
        f = self._files.get(batch)
        if f is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._seq += 1
            path = self.directory / f"{self._seq}.spool"
            f = self._files[batch] = _File(path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
        view = memoryview(data)
        while view:  # a regular file takes it all at once; the loop is for the rare short write
            view = view[os.pwrite(f.fd, view, f.size + len(data) - len(view)) :]
        slot = Slot(batch, f.size, len(data))
        f.size += len(data)
        f.live += 1
        return slot

    def take(self, slot: Slot) -> bytes:
        """The message's bytes, exactly as put; the slot is released."""
        data = self.read(slot)
        self.drop(slot)
        return data

    def read(self, slot: Slot) -> bytes:
        """The message's bytes, the slot kept."""
        f = self._files[slot.batch]
        parts, got = [], 0
        while got < slot.length:
            chunk = os.pread(f.fd, slot.length - got, slot.offset + got)
            if not chunk:
                raise OSError(f"{f.path} ends before its slot at {slot.offset} + {slot.length}")
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def drop(self, slot: Slot) -> None:
        """Release a slot without reading it; the batch's file goes with its last slot."""
        f = self._files.get(slot.batch)
        if f is None:
            return
        f.live -= 1
        if f.live <= 0:
            self._close(slot.batch)

    def clear(self) -> None:
        for batch in list(self._files):
            self._close(batch)

    def files(self) -> int:
        """Batch files open now (what the tests look at)."""
        return len(self._files)

    def _close(self, batch: Hashable) -> None:
        f = self._files.pop(batch)
        os.close(f.fd)
        f.path.unlink(missing_ok=True)
