"""The client's spool of held updates (``services/client/spool.py``): bytes come back exactly as put,
once, and a file goes with its last update."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.client.spool import Slot, Spool


def test_a_rounds_updates_share_one_file_that_goes_with_the_last(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "held")
    a = spool.put(("inc", 1), b"first")
    b = spool.put(("inc", 1), b"")
    c = spool.put(("inc", 1), bytes(range(256)) * 1000)
    d = spool.put(("inc", 2), b"next round")
    assert spool.files() == 2 and len(list((tmp_path / "held").iterdir())) == 2
    assert spool.take(c) == bytes(range(256)) * 1000
    assert spool.read(a) == b"first" == spool.take(a)
    assert spool.files() == 2  # ``b`` still waits in round 1's file
    spool.drop(b)
    assert spool.files() == 1 and spool.take(d) == b"next round"
    assert spool.files() == 0 and not any((tmp_path / "held").iterdir())


def test_a_full_file_starts_another_and_each_goes_with_its_own_last_slot(tmp_path: Path) -> None:
    """One update the server never asks for keeps only its own file, not the round's others."""
    spool = Spool(tmp_path / "held", file_bytes=10)
    first = [spool.put("r1", b"0123456789") for _ in range(3)]  # each fills a file
    assert spool.files() == 3 and len({s.file for s in first}) == 3
    small = [spool.put("r1", b"ab"), spool.put("r1", b"cd")]  # these two share the fourth
    assert spool.files() == 4 and small[0].file == small[1].file
    for s in first[1:] + small:
        spool.take(s)
    assert spool.files() == 1  # only the straggler's file is left
    spool.drop(first[0])
    assert spool.files() == 0


def test_a_closed_files_slot_cannot_release_a_newer_file(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "held")
    old = spool.put("r", b"old")
    spool.drop(old)  # the file goes; the batch's next put opens another
    new = spool.put("r", b"new")
    spool.drop(old)  # a second release of the old slot: nothing
    assert spool.files() == 1 and spool.take(new) == b"new" and spool.files() == 0


def test_a_failed_read_still_releases_the_slot(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "held")
    slot = spool.put("r", b"abc")
    broken = Slot(slot.file, slot.offset, slot.length + 10)  # past the end of its file
    with pytest.raises(OSError, match="ends before its slot"):
        spool.take(broken)
    assert spool.files() == 0


def test_start_empties_the_directory_and_clear_removes_everything(tmp_path: Path) -> None:
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "left-by-a-crash.spool").write_bytes(b"x")
    spool = Spool(tmp_path / "held")
    assert not (tmp_path / "held").exists()
    spool.put(1, b"a")
    spool.put(2, b"b")
    spool.clear()
    assert spool.files() == 0 and not any((tmp_path / "held").iterdir())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=300), st.booleans()), max_size=40))
def test_every_put_reads_back_exactly_whatever_else_was_taken(
    tmp_path_factory: object, ops: list[tuple[int, bytes, bool]]
) -> None:
    """Puts across batches, each later taken or dropped in an order of their own: every taken slot
    gives its bytes, and no file outlives its last slot."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(Path(tmp) / "held", file_bytes=256)
        slots: list[tuple[Slot, bytes, bool]] = [(spool.put(b, data), data, take) for b, data, take in ops]
        for slot, data, take in reversed(slots):
            if take:
                assert spool.take(slot) == data
            else:
                spool.drop(slot)
        assert spool.files() == 0
