"""Reading finished runs back: ``fedfleet report RUN`` and ``fedfleet compare RUN...``.

Why its own module: the tables a person reads are made from the run directory's files alone
(``summary.json``, ``rounds.csv``), never from a live service, so they need nothing of the services.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shared.results import read_rounds, read_summary

console = Console(stderr=True)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


SUMMARY_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("algorithm", "algorithm", str),
    ("transport", "transport", str),
    ("rounds", "rounds", str),
    ("final accuracy", "final_accuracy", _fmt),
    ("best accuracy", "best_accuracy", _fmt),
    ("bytes up (wire)", "bytes_up", _fmt_bytes),
    ("bytes down (wire)", "bytes_down", _fmt_bytes),
    ("bytes up (dense-eq.)", "dense_bytes_up", _fmt_bytes),
    ("bytes down (dense-eq.)", "dense_bytes_down", _fmt_bytes),
    ("wall seconds", "wall_seconds", lambda v: _fmt(v, 1)),
    ("virtual seconds", "virtual_seconds", lambda v: _fmt(v, 1)),
    ("final density", "final_density", _fmt),
    ("personal accuracy, mean over devices", "personal_accuracy_mean", _fmt),
    ("personal accuracy, best device", "personal_accuracy_best", _fmt),
    ("devices evaluated", "evaluated_devices", str),
    ("dead-lettered", "dead_lettered", str),
]


def print_report(run_dir: Path) -> None:
    s = read_summary(run_dir)
    rows = read_rounds(run_dir)
    out = Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title=f"rounds of {run_dir.name}", show_lines=False)
    for col in ("round", "outcome", "accuracy", "loss", "participants", "up", "down", "round s"):
        t.add_column(col, justify="right")
    shown = rows if len(rows) <= 25 else rows[:5] + rows[-20:]
    for r in shown:
        t.add_row(
            str(r["round"]),
            str(r["outcome"]),
            _fmt(r.get("accuracy")),
            _fmt(r.get("loss")),
            f"{r['participants']}/{r['selected']}",
            _fmt_bytes(r["bytes_up"]),
            _fmt_bytes(r["bytes_down"]),
            _fmt(r.get("round_seconds"), 2),
        )
    out.print(t)
    st = Table(title=f"summary of {run_dir.name}")
    st.add_column("")
    st.add_column("value", justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        if key in s:
            st.add_row(label, fmt(s[key]))
    out.print(st)
    out.print(
        f"files: {run_dir}/{{rounds.csv, devices.csv, summary.json, "
        "accuracy_vs_round.png, accuracy_vs_bytes.png}"
    )


def report(run: str) -> int:
    """Print one run's rounds and summary; 2 if it is not a finished run."""
    try:
        print_report(Path(run))
    except FileNotFoundError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    return 0


def compare(run_paths: list[str], plot: str | None) -> int:
    """Tabulate runs side by side (optionally one plot of them all); 2 on a missing run."""
    out = Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title="comparison")
    t.add_column("")
    summaries = []
    for run in run_paths:
        try:
            summaries.append(read_summary(Path(run)))
        except FileNotFoundError as err:
            console.print(f"[red]{err}[/red]")
            return 2
        t.add_column(Path(run).name, justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        t.add_row(label, *(fmt(s[key]) if key in s else "-" for s in summaries))
    out.print(t)
    if plot:
        from shared.results import plot_compare

        runs = {Path(run).name: read_rounds(Path(run)) for run in run_paths}
        try:
            path = plot_compare(runs, Path(plot))
        except ValueError as err:
            console.print(f"[red]--plot: {err}[/red]")
            return 2
        out.print(f"plot: {path}")
    return 0
