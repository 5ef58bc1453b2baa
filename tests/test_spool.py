"""The client's spool of held updates (``services/client/spool.py``): bytes come back exactly as put,
once, and a round's file goes with its last update."""

from __future__ import annotations

from pathlib import Path

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
        spool = Spool(Path(tmp) / "held")
        slots: list[tuple[Slot, bytes, bool]] = [(spool.put(b, data), data, take) for b, data, take in ops]
        for slot, data, take in reversed(slots):
            if take:
                assert spool.take(slot) == data
            else:
                spool.drop(slot)
        assert spool.files() == 0
