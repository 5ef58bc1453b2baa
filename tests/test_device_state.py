"""Per-round device state files: a task of round r starts from the newest state before r."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.algorithms import device_state


def _state(r: int) -> dict[str, np.ndarray]:
    return {"w": np.full(3, r, dtype=np.float32)}


def test_load_before_skips_the_round_itself_and_latest_does_not(tmp_path: Path) -> None:
    assert device_state.load_before(tmp_path / "none", "x", 5) is None
    assert device_state.load_latest(tmp_path / "none", "x") is None
    device_state.save(tmp_path, "x", 2, _state(2))
    device_state.save(tmp_path, "x", 4, _state(4))
    got = device_state.load_before(tmp_path, "x", 4)
    assert got is not None and got["w"][0] == 2  # a replay of round 4 starts where round 4 started
    got = device_state.load_before(tmp_path, "x", 5)
    assert got is not None and got["w"][0] == 4
    assert device_state.load_before(tmp_path, "x", 2) is None
    latest = device_state.load_latest(tmp_path, "x")
    assert latest is not None and latest["w"][0] == 4
    # another prefix in the same directory is another state
    device_state.save(tmp_path, "y", 9, _state(9))
    latest = device_state.load_latest(tmp_path, "x")
    assert latest is not None and latest["w"][0] == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_saving_an_older_round_drops_the_abandoned_later_ones(tmp_path: Path) -> None:
    """The server resumed from a checkpoint older than the device's files: round 3 runs again."""
    for r in (1, 2, 3, 4):
        device_state.save(tmp_path, "x", r, _state(r))
    # round 4's save kept round 3's file (what a replay of 4 needs), not round 2's: a rerun of round 3
    # continues from the oldest state left, with a warning, rather than from the initial model
    assert sorted(p.name for p in tmp_path.glob("x-*.npz")) == ["x-3.npz", "x-4.npz"]
    start = device_state.load_before(tmp_path, "x", 3)
    assert start is not None and start["w"][0] == 3
    device_state.save(tmp_path, "x", 3, _state(30))
    assert sorted(p.name for p in tmp_path.glob("x-*.npz")) == ["x-3.npz"]
    latest = device_state.load_latest(tmp_path, "x")
    assert latest is not None and latest["w"][0] == 30
    # one round back (the server's checkpoint fallback): the replay's exact start is still there
    device_state.save(tmp_path, "x", 5, _state(5))
    start = device_state.load_before(tmp_path, "x", 5)
    assert start is not None and start["w"][0] == 30


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=12))
def test_any_save_order_keeps_what_a_replay_needs(rounds: list[int]) -> None:
    """After any sequence of saves (replays and resumes included) the files are at most two: the last
    round saved and the newest one before it; load_before(last) is that one's state."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        alive: dict[int, int] = {}  # round -> value, as the rule says it should be
        for i, r in enumerate(rounds):
            device_state.save(root, "x", r, _state(100 * r + i))
            alive = {k: v for k, v in alive.items() if k < r}
            if alive:
                newest = max(alive)
                alive = {newest: alive[newest]}
            alive[r] = 100 * r + i
        files = sorted(int(p.stem.split("-")[1]) for p in root.glob("x-*.npz"))
        assert files == sorted(alive)
        last = rounds[-1]
        before = device_state.load_before(root, "x", last)
        earlier = [k for k in alive if k < last]
        if last <= min(rounds):  # the device's first round: the initial model
            assert before is None
        else:  # the exact start if kept, else the oldest state left, never the initial model
            want = alive[max(earlier)] if earlier else alive[min(alive)]
            assert before is not None and before["w"][0] == want
