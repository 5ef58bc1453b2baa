"""Checkpoints you can trust, and configs without inf or nan.

A checkpoint that is missing, truncated, corrupt or holds NaN must never be resumed: the server
falls back to the previous one with a warning, or — when none is usable — stops with one clear
error, never a traceback. A save is verified before it replaces anything, and a NaN state is never
saved. Config values such as ``train.lr: .inf`` are refused wherever they appear.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from services.orchestrator import InprocCluster
from services.server import checkpoint
from services.server.checkpoint import Checkpoint, CheckpointError
from shared.algorithms.base import ServerState
from shared.config import BoundsConfig, ConfigError, RobustConfig, TrainConfig, load_config
from shared.experiment import Experiment
from shared.results import DEVICE_COLUMNS, DeviceStats, device_row
from tests.conftest import write_config


def _ckpt(round: int, value: float = 1.0) -> Checkpoint:
    arrays: dict[str, np.ndarray] = {
        "w": np.full((3, 4), value * round, dtype=np.float32),
        "steps": np.array([round], np.int64),
    }
    return Checkpoint(round, ServerState(arrays, {"round_seen": round}), {"rows": [round]})


def _save(run: Path, ckpt: Checkpoint) -> None:
    """Save with the journal opened where the latest usable checkpoint left it, as a server does."""
    latest = checkpoint.load(run)
    checkpoint.save(run, ckpt, checkpoint.Journal(run, latest.mark if latest else None))


def _two_saved(run: Path) -> None:
    _save(run, _ckpt(1))
    _save(run, _ckpt(2))


def _fallback_warning(caplog: pytest.LogCaptureFixture) -> str:
    events = [r for r in caplog.records if getattr(r, "event", "") == "checkpoint_fallback"]
    assert len(events) == 1, [r.getMessage() for r in caplog.records]
    return events[0].getMessage()


def test_a_save_keeps_the_previous_checkpoint_and_round_trips(tmp_path: Path) -> None:
    _two_saved(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.old", "ledger.jsonl"]
    for name in ("state.npz", "state.json", "checksums.json"):
        assert (tmp_path / "checkpoint" / name).exists()
    got = checkpoint.load(tmp_path)
    assert got is not None and got.round == 2
    np.testing.assert_array_equal(got.state.arrays["w"], _ckpt(2).state.arrays["w"])
    assert got.state.arrays["steps"].dtype == np.int64
    assert got.state.meta == {"round_seen": 2} and got.ledger == {"rows": [2]}
    _save(tmp_path, _ckpt(3))  # one generation back: round 1 is gone, round 2 kept
    previous = json.loads((tmp_path / "checkpoint.old" / "state.json").read_text())
    assert previous["round"] == 2


def test_no_checkpoint_is_a_new_run(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path) is None
    (tmp_path / "checkpoint.tmp").mkdir()  # an unfinished save is never trusted
    (tmp_path / "checkpoint.tmp" / "state.json").write_text('{"round": 3, "sta')
    assert checkpoint.load(tmp_path) is None


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _write_nan_latest(run: Path) -> None:
    """A latest checkpoint whose files and checksums agree, but whose model is NaN (what a bug or a
    poisoned round could have produced before bounds existed)."""
    latest = run / "checkpoint"
    with np.load(latest / "state.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["w"][0, 0] = np.nan
    np.savez(latest / "state.npz", **arrays)
    sums = {n: checkpoint._sha256(latest / n) for n in ("state.npz", "state.json")}
    (latest / "checksums.json").write_text(json.dumps(sums))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda run: _truncate(run / "checkpoint" / "state.npz"), "does not match its checksum"),
        (lambda run: _flip_a_byte(run / "checkpoint" / "state.npz"), "does not match its checksum"),
        (lambda run: _truncate(run / "checkpoint" / "state.json"), "does not match its checksum"),
        (lambda run: (run / "checkpoint" / "state.npz").unlink(), "state.npz missing"),
        (lambda run: (run / "checkpoint" / "checksums.json").unlink(), "unreadable"),  # + truncation below
        (_write_nan_latest, "non-finite values in ['w']"),
        (lambda run: __import__("shutil").rmtree(run / "checkpoint"), "missing"),
    ],
    ids=[
        "truncated-npz",
        "flipped-byte",
        "truncated-json",
        "npz-missing",
        "sums-missing",
        "nan",
        "dir-missing",
    ],
)
def test_an_unusable_latest_falls_back_to_the_previous_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, why: str
) -> None:
    _two_saved(tmp_path)
    damage(tmp_path)
    if why == "unreadable":  # without checksums the file is read unverified: it must still be whole
        _truncate(tmp_path / "checkpoint" / "state.npz")
    with caplog.at_level(logging.WARNING, logger="fedfleet.server"):
        got = checkpoint.load(tmp_path)
    assert got is not None and got.round == 1
    np.testing.assert_array_equal(got.state.arrays["w"], _ckpt(1).state.arrays["w"])
    assert why in _fallback_warning(caplog)
    # the previous one is now the latest, so the next save cannot delete the only good checkpoint
    assert (tmp_path / "checkpoint" / "state.json").exists() and not (tmp_path / "checkpoint.old").exists()
    _save(tmp_path, _ckpt(2))
    again = checkpoint.load(tmp_path)
    assert again is not None and again.round == 2
    assert (checkpoint.load(tmp_path / "nothing")) is None


@pytest.mark.parametrize("previous", ["truncated", "missing", "nan"])
def test_no_usable_checkpoint_is_one_clear_error(tmp_path: Path, previous: str) -> None:
    _two_saved(tmp_path)
    _truncate(tmp_path / "checkpoint" / "state.npz")
    old = tmp_path / "checkpoint.old"
    if previous == "truncated":
        _truncate(old / "state.npz")
    elif previous == "missing":
        __import__("shutil").rmtree(old)
    else:
        (old / "checksums.json").unlink()
        np.savez(old / "state.npz", w=np.full((3, 4), np.inf, np.float32))
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(tmp_path)
    text = str(err.value)
    assert "no usable checkpoint" in text and "checkpoint/ is state.npz does not match its checksum" in text
    assert {"truncated": "checksum", "missing": "is missing", "nan": "non-finite"}[previous] in text
    assert "--run-id" in text  # and what to do about it
    assert (tmp_path / "checkpoint").exists()  # nothing is deleted on the way


def test_a_non_finite_state_is_never_checkpointed(tmp_path: Path) -> None:
    _save(tmp_path, _ckpt(1))
    with pytest.raises(CheckpointError, match="non-finite values in \\['w'\\]"):
        _save(tmp_path, _ckpt(2, value=np.nan))
    with pytest.raises(CheckpointError, match="non-finite metadata"):
        _save(tmp_path, Checkpoint(2, _ckpt(2).state, {"accuracy": float("inf")}))
    with pytest.raises(CheckpointError, match="non-finite metadata"):
        _save(tmp_path, Checkpoint(2, _ckpt(2).state, {}, [{"rows": [{"loss": float("nan")}]}]))
    got = checkpoint.load(tmp_path)
    assert got is not None and got.round == 1
    assert got.mark is not None and (tmp_path / "ledger.jsonl").stat().st_size == got.mark["bytes"]
    assert (
        not (tmp_path / "checkpoint.tmp").exists()
        or not (tmp_path / "checkpoint.tmp/checksums.json").exists()
    )


@pytest.mark.parametrize("compact", [False, True], ids=["journal", "compacting-journal"])
def test_a_server_resumes_from_the_previous_checkpoint_and_ends_like_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compact: bool
) -> None:
    """A truncated latest checkpoint: the restarted server takes the previous one, runs the lost round
    again with the same seeds, and the run ends with the model of a run that was never interrupted.
    ``compacting-journal``: the journal starts a new generation whenever it grew since the last."""
    if compact:
        monkeypatch.setattr(checkpoint, "COMPACT_MIN_BYTES", 1)
        monkeypatch.setattr(checkpoint, "COMPACT_RATIO", 1)
    cfg = write_config(tmp_path / "c.yaml", rounds=3)

    def cluster(run: Path, name: str) -> InprocCluster:
        run.mkdir(exist_ok=True)
        exp = Experiment.build(load_config(cfg))
        return InprocCluster(exp, run, name, aggregators=2, clients=1, state_dir=run / "state")

    clean = cluster(tmp_path / "a", "clean")
    assert clean.run(max_steps=200_000) == 0
    run = tmp_path / "b"
    killed = cluster(run, "killed")
    killed.run(until=lambda: len(killed.server.rows) == 2, max_steps=200_000)
    killed.close()
    _truncate(run / "checkpoint" / "state.npz")
    again = cluster(run, "killed")
    assert again.server.resumed and again.server.round == 1
    assert again.run(max_steps=200_000) == 0
    assert [r["round"] for r in again.server.rows] == [1, 2, 3]
    for name, arr in clean.server.state.arrays.items():
        np.testing.assert_allclose(again.server.state.arrays[name], arr, atol=1e-6, rtol=0)

    # the ledger replayed from the journal: every device's statistics as in the uninterrupted run
    # (the second round's line, beyond the previous checkpoint's mark, was cut and run again)
    def devices(c: InprocCluster) -> dict[int, dict[str, Any]]:
        rows = {d: device_row(s) for d, s in c.server.ledger.devices.items()}
        for r in rows.values():
            r.pop("virtual_seconds")  # a float sum: compared below to rounding
        return rows

    assert devices(again) == devices(clean)
    assert [r["bytes_up"] for r in again.server.rows] == [r["bytes_up"] for r in clean.server.rows]
    assert (run / "rounds.csv").read_text().count("\n") == 4  # header + 3 rows, none twice
    # the per-tier sums of summary.json do not depend on the order the ledger was rebuilt in
    assert again.server.summary()["tiers"] == clean.server.summary()["tiers"]
    if compact:
        # round 2 (both times) started generation 1, round 3 appended to it: once both checkpoints
        # cover generation 1, the first is gone
        assert sorted(p.name for p in run.glob("ledger*.jsonl")) == ["ledger.1.jsonl"]


def _journaled(round: int) -> Checkpoint:
    """A checkpoint whose journal entry adds round ``round``'s row and touches devices ``round``
    and 100 (so device 100's statistics change in every entry: the replay must keep the last)."""
    entry = {
        "rows": [{"round": round, "accuracy": 0.1 * round}],
        "device_columns": DEVICE_COLUMNS,
        "devices": [list(device_row(DeviceStats(d, selected=round)).values()) for d in (round, 100)],
    }
    return Checkpoint(round, _ckpt(round).state, {"totals": {}, "wall_seconds": 1.0}, [entry])


def _replayed(ckpt: Checkpoint | None) -> tuple[list[int], dict[int, int]]:
    """(rows' rounds, device → selected) of a loaded checkpoint's journal, replayed in order."""
    assert ckpt is not None
    rounds = [r["round"] for e in ckpt.journal for r in e["rows"]]
    rows = [dict(zip(e["device_columns"], d, strict=True)) for e in ckpt.journal for d in e["devices"]]
    selected = {d["device_id"]: d["selected"] for d in rows}
    return rounds, selected


def test_the_journal_holds_what_each_checkpoint_added_and_the_checkpoint_stays_small(tmp_path: Path) -> None:
    """Why the journal: with the whole ledger in ``state.json``, a save cost O(rounds + devices)."""
    journal = checkpoint.Journal(tmp_path, None)
    sizes = []
    for r in range(1, 31):
        checkpoint.save(tmp_path, _journaled(r), journal)
        sizes.append((tmp_path / "checkpoint" / "state.json").stat().st_size)
    line = len((tmp_path / "ledger.jsonl").read_bytes().splitlines()[-1])
    # only digits grow (the round's, the mark's byte count), never by a round's history
    assert max(sizes) - min(sizes) <= 6 < line, (sizes, line)
    got = checkpoint.load(tmp_path)
    assert got is not None and got.round == 30
    rounds, selected = _replayed(got)
    assert rounds == list(range(1, 31)) and selected[100] == 30 and selected[7] == 7
    assert len((tmp_path / "ledger.jsonl").read_bytes().splitlines()) == 30


@pytest.mark.parametrize("damage", ["flip-last-line", "truncate-last-line"])
def test_a_damaged_journal_falls_back_to_the_checkpoint_whose_prefix_is_intact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    journal = checkpoint.Journal(tmp_path, None)
    for r in (1, 2):
        checkpoint.save(tmp_path, _journaled(r), journal)
    path = tmp_path / "ledger.jsonl"
    first, second = path.read_bytes().splitlines(keepends=True)
    if damage == "flip-last-line":
        path.write_bytes(first + second.replace(b'"round": 2', b'"round": 9'))
    else:
        path.write_bytes(first + second[:10])
    with caplog.at_level(logging.WARNING, logger="fedfleet.server"):
        got = checkpoint.load(tmp_path)
    assert got is not None and got.round == 1 and _replayed(got) == ([1], {1: 1, 100: 1})
    assert "ledger.jsonl" in _fallback_warning(caplog)
    # the run goes on from round 1's mark: the damaged line is cut, the next save continues the prefix
    assert got.mark is not None
    journal = checkpoint.Journal(tmp_path, got.mark)
    assert path.read_bytes() == first
    checkpoint.save(tmp_path, _journaled(2), journal)
    assert _replayed(checkpoint.load(tmp_path)) == ([1, 2], {1: 1, 2: 2, 100: 2})


def test_a_lost_journal_is_one_clear_error(tmp_path: Path) -> None:
    journal = checkpoint.Journal(tmp_path, None)
    for r in (1, 2):
        checkpoint.save(tmp_path, _journaled(r), journal)
    (tmp_path / "ledger.jsonl").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*ledger\.jsonl"):
        checkpoint.load(tmp_path)


def test_a_save_that_did_not_finish_leaves_nothing_in_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that fails after its append takes the line back; one killed after it leaves a tail
    beyond the latest mark, which the next run's journal cuts off."""
    journal = checkpoint.Journal(tmp_path, None)
    checkpoint.save(tmp_path, _journaled(1), journal)
    size = (tmp_path / "ledger.jsonl").stat().st_size

    def disk_full(*_: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "atomic_savez", disk_full)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save(tmp_path, _journaled(2), journal)
    monkeypatch.undo()
    assert (tmp_path / "ledger.jsonl").stat().st_size == size
    checkpoint.save(tmp_path, _journaled(2), journal)  # the same changes again, once
    assert _replayed(checkpoint.load(tmp_path)) == ([1, 2], {1: 1, 2: 2, 100: 2})
    with (tmp_path / "ledger.jsonl").open("ab") as f:  # killed between its append and its rename
        f.write(b'{"rows": [{"round": 3}], "devices": []}\n')
    got = checkpoint.load(tmp_path)
    assert _replayed(got) == ([1, 2], {1: 1, 2: 2, 100: 2})
    assert got is not None and got.mark is not None
    checkpoint.Journal(tmp_path, got.mark)
    assert (tmp_path / "ledger.jsonl").stat().st_size == got.mark["bytes"]


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.test_checkpoint import _journaled, _replayed
from services.server import checkpoint

run = Path(sys.argv[1])
journal = checkpoint.Journal(run, None)
checkpoint.save(run, _journaled(1), journal)
size = (run / "ledger.jsonl").stat().st_size
# the file may grow by 20 bytes more: the next line's write stops part way (EFBIG), as ENOSPC does
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, resource.RLIM_INFINITY))
try:
    checkpoint.save(run, _journaled(2), journal)
except OSError as err:
    print("failed:", err.errno)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("size:", (run / "ledger.jsonl").stat().st_size == size)
checkpoint.save(run, _journaled(2), journal)
checkpoint.save(run, _journaled(3), journal)
rounds, selected = _replayed(checkpoint.load(run))
print("replay:", rounds, sorted(selected.items()))
"""


def test_a_disk_that_fills_during_the_append_leaves_no_partial_line(tmp_path: Path) -> None:
    """A real short write (a file-size limit, which fails a write part way as a full disk does): the
    bytes that reached the file are cut, so the same process's next saves follow whole lines and
    both checkpoints still replay. In a subprocess: the limit holds for the whole process."""
    import errno

    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path), str(Path(__file__).resolve().parents[1])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out == [
        f"failed: {errno.EFBIG}",
        "size: True",
        "replay: [1, 2, 3] [(1, 1), (2, 2), (3, 3), (100, 3)]",
    ]


def test_a_resume_reads_the_journal_one_line_at_a_time(tmp_path: Path) -> None:
    """A loaded checkpoint's entries come from disk as they are iterated, not as one list (a long
    run's journal parsed whole would take several times its size in memory), and each iteration
    reads them again, whole and in order."""
    journal = checkpoint.Journal(tmp_path, None)
    for r in (1, 2, 3):
        checkpoint.save(tmp_path, _journaled(r), journal)
    got = checkpoint.load(tmp_path)
    assert got is not None
    assert not isinstance(got.journal, list)
    entries = iter(got.journal)
    assert next(entries)["rows"] == [{"round": 1, "accuracy": 0.1}]
    assert _replayed(got) == ([1, 2, 3], {1: 1, 2: 2, 3: 3, 100: 3})
    assert _replayed(got) == ([1, 2, 3], {1: 1, 2: 2, 3: 3, 100: 3})


def test_a_checkpoint_from_before_the_journal_still_resumes_and_its_ledger_is_journaled_whole(
    tmp_path: Path,
) -> None:
    """A run checkpointed by an earlier fedfleet (rows and devices in ``state.json``) resumes, and
    its first new checkpoint's entry holds the whole restored ledger (the journal starts empty)."""
    from services.server.ledger import RunLedger

    old = RunLedger("e", "fedavg")
    old.rows.append({"round": 1, "outcome": "completed"})
    old.stats(3).selected = 1
    legacy = {
        "devices": [device_row(s) for s in old.devices.values()],
        "rows": old.rows,
        "totals": old.totals,
        "wall_seconds": 2.0,
    }
    checkpoint.save(tmp_path, Checkpoint(1, _ckpt(1).state, legacy), checkpoint.Journal(tmp_path, None))
    meta = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    meta.pop("journal")  # what an earlier fedfleet wrote: no mark
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps(meta))
    sums = {n: checkpoint._sha256(tmp_path / "checkpoint" / n) for n in ("state.npz", "state.json")}
    (tmp_path / "checkpoint" / "checksums.json").write_text(json.dumps(sums))
    got = checkpoint.load(tmp_path)
    assert got is not None and got.mark is None and list(got.journal) == []
    ledger = RunLedger("e", "fedavg")
    ledger.restore(got.ledger, got.journal)
    assert ledger.rows == old.rows and ledger.devices[3].selected == 1
    ledger.rows.append({"round": 2, "outcome": "completed"})
    checkpoint.save(
        tmp_path,
        Checkpoint(2, _ckpt(2).state, ledger.to_checkpoint(), ledger.to_journal()),
        checkpoint.Journal(tmp_path, None),
    )
    again = RunLedger("e", "fedavg")
    resumed = checkpoint.load(tmp_path)
    assert resumed is not None
    again.restore(resumed.ledger, resumed.journal)
    assert [r["round"] for r in again.rows] == [1, 2] and again.devices[3].selected == 1


def test_the_ledger_journals_only_the_new_rows_and_the_touched_devices() -> None:
    from services.server.ledger import RunLedger

    ledger = RunLedger("e", "fedavg")
    for d in range(5):
        ledger.stats(d).selected += 1
    ledger.rows.append({"round": 1})
    (first,) = ledger.to_journal()
    assert first["device_columns"] == DEVICE_COLUMNS and first["rows"] == [{"round": 1}]
    assert [d[0] for d in first["devices"]] == [0, 1, 2, 3, 4]
    ledger.journaled()
    ledger.stats(2).completed += 1
    ledger.rows.append({"round": 2})
    (second,) = ledger.to_journal()
    assert second["rows"] == [{"round": 2}]
    assert [dict(zip(DEVICE_COLUMNS, d, strict=True)) for d in second["devices"]] == [
        device_row(DeviceStats(2, selected=1, completed=1))
    ]
    again = RunLedger("e", "fedavg")  # the replay of both entries is the ledger
    again.restore(ledger.to_checkpoint(), [first, second])
    assert again.rows == ledger.rows and again.devices == ledger.devices


def test_the_summary_of_a_replayed_ledger_equals_the_live_one_to_the_last_bit() -> None:
    """Devices are touched in any order during a run, and a replay rebuilds them in the journal's
    order: the per-tier float sums must not depend on which, or a resumed run's summary.json would
    differ from an uninterrupted one's in the last bits (here 1e16 + 1 + 1 ≠ 1 + 1 + 1e16)."""
    from services.server.ledger import RunLedger

    ledger = RunLedger("e", "fedavg")
    for d, seconds in ((5, 1e16), (1, 1.0), (3, 1.0)):
        ledger.stats(d).virtual_seconds = seconds
    again = RunLedger("e", "fedavg")
    again.restore(ledger.to_checkpoint(), ledger.to_journal())
    assert list(again.devices) != list(ledger.devices)  # the orders differ ...
    tiers = ledger.summary({}, None)["tiers"]
    assert again.summary({}, None)["tiers"] == tiers  # ... the sums do not
    assert next(iter(tiers.values()))["virtual_seconds"] == 1e16 + 2


def _save_like_the_server(run_dir: Path, r: int, ledger: Any, journal: checkpoint.Journal) -> bool:
    """Round ``r``'s checkpoint as ``Server._save_checkpoint`` makes it; whether it compacted."""
    whole = journal.compacting()
    ckpt = Checkpoint(
        r, _ckpt(r).state, ledger.to_checkpoint(), ledger.to_journal(whole=whole), snapshot=whole
    )
    checkpoint.save(run_dir, ckpt, journal)
    ledger.journaled()
    return whole


def test_a_compacted_journal_keeps_two_generations_and_replays_like_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With compaction due at every save past the first few hundred bytes, the journal starts a new
    generation with the whole ledger whenever it has grown past 4x that; the files on disk stay the
    two the checkpoints cover, every load replays to the ledger as it was saved, the fallback to the
    previous checkpoint finds its (older) generation, and a resumed journal goes on compacting."""
    from services.server.ledger import RunLedger

    monkeypatch.setattr(checkpoint, "COMPACT_MIN_BYTES", 300)
    ledger = RunLedger("e", "fedavg")
    journal = checkpoint.Journal(tmp_path, None)
    saved: list[tuple[list[dict[str, Any]], dict[int, DeviceStats]]] = []
    rotations = 0
    for r in range(1, 100):
        ledger.rows.append({"round": r, "accuracy": 0.01 * r})
        for d in (r % 7, 100 + r):
            ledger.stats(d).selected += 1
        whole = _save_like_the_server(tmp_path, r, ledger, journal)
        rotations += whole
        saved.append(
            (
                [dict(row) for row in ledger.rows],
                {d: DeviceStats(**asdict(st)) for d, st in ledger.devices.items()},
            )
        )
        files = sorted(p.name for p in tmp_path.glob("ledger*.jsonl"))
        assert len(files) <= 2, files
        got = checkpoint.load(tmp_path)
        assert got is not None
        again = RunLedger("e", "fedavg")
        again.restore(got.ledger, got.journal)
        assert (again.rows, again.devices) == saved[-1]
        if whole and rotations == 3:  # stop where the latest and the previous differ in generation
            break
    assert (
        rotations == 3 and got is not None and got.mark is not None and got.mark["file"] == "ledger.3.jsonl"
    )
    assert max(p.stat().st_size for p in tmp_path.glob("ledger*.jsonl")) < 20 * 300

    # the latest is damaged: the previous checkpoint, one generation back, still loads
    _truncate(tmp_path / "checkpoint" / "state.npz")
    got = checkpoint.load(tmp_path)
    assert got is not None and got.round == r - 1
    assert got.mark is not None and got.mark["file"] == "ledger.2.jsonl"
    again = RunLedger("e", "fedavg")
    again.restore(got.ledger, got.journal)
    assert (again.rows, again.devices) == saved[-2]
    # and the run goes on from it, compacting as before
    assert got.mark is not None
    journal = checkpoint.Journal(tmp_path, got.mark)
    last = r + 40
    for r2 in range(r, last):
        again.rows.append({"round": r2})
        again.stats(r2 % 5).selected += 1
        rotations += _save_like_the_server(tmp_path, r2, again, journal)
    got = checkpoint.load(tmp_path)
    assert got is not None
    final = RunLedger("e", "fedavg")
    final.restore(got.ledger, got.journal)
    assert [row["round"] for row in final.rows] == list(range(1, last))
    assert final.devices == again.devices
    assert rotations >= 5
    assert len(list(tmp_path.glob("ledger*.jsonl"))) <= 2


def test_a_failed_save_takes_its_new_generation_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = checkpoint.Journal(tmp_path, None)
    checkpoint.save(tmp_path, _journaled(1), journal)

    def disk_full(*_: Any) -> None:
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "atomic_savez", disk_full)
        with pytest.raises(OSError, match="No space"):
            checkpoint.save(tmp_path, dataclasses.replace(_journaled(2), snapshot=True), journal)
    assert sorted(p.name for p in tmp_path.glob("ledger*.jsonl")) == ["ledger.jsonl"]
    checkpoint.save(tmp_path, _journaled(2), journal)
    assert _replayed(checkpoint.load(tmp_path)) == ([1, 2], {1: 1, 2: 2, 100: 2})


def test_a_journal_file_named_outside_the_run_directory_is_refused(tmp_path: Path) -> None:
    journal = checkpoint.Journal(tmp_path, None)
    checkpoint.save(tmp_path, _journaled(1), journal)
    state = tmp_path / "checkpoint" / "state.json"
    meta = json.loads(state.read_text())
    meta["journal"]["file"] = "../../etc/passwd"
    state.write_text(json.dumps(meta))
    sums = {n: checkpoint._sha256(tmp_path / "checkpoint" / n) for n in ("state.npz", "state.json")}
    (tmp_path / "checkpoint" / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(CheckpointError, match="no valid journal file"):
        checkpoint.load(tmp_path)


def test_fedfleet_says_why_it_cannot_resume_without_a_traceback(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", rounds=2)
    run = tmp_path / "runs" / "broken"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(load_config(cfg).model_dump(mode="json")))
    _two_saved(run)
    _truncate(run / "checkpoint" / "state.npz")
    _truncate(run / "checkpoint.old" / "state.npz")
    argv = ["run", str(cfg), "--transport", "inproc", "--run-id", "broken", "--runs-dir", str(run.parent)]
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "cannot resume" in text and "no usable checkpoint" in text, text
    assert "Traceback" not in text, text


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"train": {"lr": float("inf")}}, "train.lr"),
        ({"quorum_fraction": float("nan")}, "quorum_fraction"),
        ({"round_timeout_s": float("inf")}, "round_timeout_s"),
        ({"algorithm": {"name": "fedavg", "options": {"x": float("nan")}}}, "algorithm.options.x"),
        ({"fleet": {"preset": "uniform", "memory_mb": float("-inf")}}, "fleet.memory_mb"),
        ({"bounds": {"max_update_norm": float("inf")}}, "bounds.max_update_norm"),
        ({"robust": {"clip_norm": float("nan")}}, "robust.clip_norm"),
    ],
)
def test_inf_and_nan_are_refused_everywhere_in_a_config(tmp_path: Path, override: Any, key: str) -> None:
    path = write_config(tmp_path / "c.yaml", **override)
    assert ".inf" in path.read_text() or ".nan" in path.read_text()  # what a user would type
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"'{key}': must be a finite number" in str(err.value)
    # the models refuse them too when built from Python rather than from a YAML file
    section, _, field = key.partition(".")
    models: dict[str, type[BaseModel]] = {
        "train": TrainConfig,
        "bounds": BoundsConfig,
        "robust": RobustConfig,
    }
    if section in models:
        with pytest.raises(ValidationError, match="finite number"):
            models[section].model_validate({field: float("inf")})


def test_inf_in_the_environment_settings_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import _settings

    monkeypatch.setenv("FEDFLEET_LINGER_S", "inf")
    with pytest.raises(SystemExit) as exit_:
        _settings()
    assert exit_.value.code == 2
    assert "environment: 'linger_s': Input should be a finite number" in capsys.readouterr().err


@given(
    st.builds(
        DeviceStats,
        device_id=st.integers(0, 10**6),
        tier=st.text(max_size=8),
        selected=st.integers(0, 1000),
        bytes_up=st.integers(0, 2**40),
        virtual_seconds=st.floats(allow_nan=True),
        eval_accuracy=st.none() | st.floats(0, 1),
    )
)
def test_device_row_is_asdict_without_the_copy(d: DeviceStats) -> None:
    """The checkpoint's and devices.csv's record of a device: what ``asdict`` gave, key order included."""
    row, expected = device_row(d), asdict(d)
    assert list(row) == list(expected)
    assert json.dumps(row) == json.dumps(expected)  # NaN-safe equality


_extra_columns = st.sampled_from(["m_loss", "m_density", "e_acc_before", "accuracy"])
_row_values = st.one_of(st.none(), st.integers(0, 10**9), st.floats(allow_nan=True, allow_infinity=False))


@given(
    st.lists(
        st.tuples(
            st.dictionaries(_extra_columns, _row_values),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_rounds_csv_written_round_by_round_is_the_file_written_at_once(
    rounds: list[tuple[dict[str, Any], bool]],
) -> None:
    """``write_rounds`` appends while no new column appears and rewrites when one does (or when
    the caller lost track); either way the file equals one written from all rows at once."""
    import tempfile

    from shared.results import write_rounds

    with tempfile.TemporaryDirectory() as d:
        run, whole = Path(d) / "run", Path(d) / "whole"
        run.mkdir()
        whole.mkdir()
        rows: list[dict[str, Any]] = []
        after = None
        for i, (extra, forget) in enumerate(rounds):
            rows.append({"round": i + 1, "outcome": "completed", "bytes_up": 10 * i, **extra})
            after = write_rounds(run, rows, after=None if forget else after)
            write_rounds(whole, rows)
            assert (run / "rounds.csv").read_text() == (whole / "rounds.csv").read_text()
