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

from shared.results import DEAD_LETTERS_FILE, read_dead_letters, read_rounds, read_summary

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


#: what ``accuracy`` means in a run's files, by the algorithm's kind
ACCURACY_MEANING = {
    "global": "the global model on the central test split",
    "personalised": "each device's own model on its own test split (the round's participants, "
    "weighted by test samples)",
}
ACCURACY_CHOICES = ("auto", "global", "personalised", "both")


def accuracy_kind(summary: dict[str, Any]) -> str:
    """``global`` or ``personalised``: what the run's ``accuracy`` measured.

    Why it matters: a personalised algorithm (SpaFL, Hermes, LG-FedAvg, standalone: every device keeps
    a model of its own) reports each device's own model on its own test split, a global one the
    single global model on the central test split. The two are not the same measurement, so a table
    or plot that puts them in one column invites a wrong conclusion. The algorithm's own
    ``Strategy.personalised`` decides; a run of an algorithm no longer registered is personalised iff
    it has the all-device evaluation.
    """
    if summary.get("accuracy_kind") in ACCURACY_MEANING:
        return str(summary["accuracy_kind"])
    from shared import algorithms

    try:
        return "personalised" if algorithms.get(str(summary.get("algorithm"))).personalised else "global"
    except ValueError:
        return "personalised" if "personal_accuracy_mean" in summary else "global"


def _view(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its accuracies filed under their kind (``global_*`` / ``personal_*``)."""
    kind = accuracy_kind(summary)
    prefix = "global" if kind == "global" else "personal"
    out = dict(summary, accuracy_kind=kind)
    out[f"{prefix}_final_accuracy"] = summary.get("final_accuracy")
    out[f"{prefix}_best_accuracy"] = summary.get("best_accuracy")
    return out


SUMMARY_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("algorithm", "algorithm", str),
    ("transport", "transport", str),
    ("rounds", "rounds", str),
    ("accuracy measured on", "accuracy_kind", lambda k: "global model" if k == "global" else "own models"),
    ("final accuracy, global model", "global_final_accuracy", _fmt),
    ("best accuracy, global model", "global_best_accuracy", _fmt),
    ("final accuracy, personalised (participants)", "personal_final_accuracy", _fmt),
    ("best accuracy, personalised (participants)", "personal_best_accuracy", _fmt),
    ("personalised accuracy, mean over all devices", "personal_accuracy_mean", _fmt),
    ("personalised accuracy, best device", "personal_accuracy_best", _fmt),
    ("devices evaluated", "evaluated_devices", str),
    ("bytes up (wire)", "bytes_up", _fmt_bytes),
    ("bytes down (wire)", "bytes_down", _fmt_bytes),
    ("bytes up (dense-eq.)", "dense_bytes_up", _fmt_bytes),
    ("bytes down (dense-eq.)", "dense_bytes_down", _fmt_bytes),
    ("wall seconds", "wall_seconds", lambda v: _fmt(v, 1)),
    ("virtual seconds", "virtual_seconds", lambda v: _fmt(v, 1)),
    ("final density", "final_density", _fmt),
    ("dead-lettered", "dead_lettered", str),
]


def print_report(run_dir: Path) -> None:
    s = _view(read_summary(run_dir))
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
    out.print(f"accuracy: {ACCURACY_MEANING[s['accuracy_kind']]}")
    st = Table(title=f"summary of {run_dir.name}")
    st.add_column("")
    st.add_column("value", justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        if s.get(key) is not None:
            st.add_row(label, fmt(s[key]))
    out.print(st)
    _print_dead_letters(out, run_dir, s)
    out.print(
        f"files: {run_dir}/{{rounds.csv, devices.csv, summary.json, "
        "accuracy_vs_round.png, accuracy_vs_bytes.png}"
    )


def _print_dead_letters(out: Console, run_dir: Path, summary: dict[str, Any]) -> None:
    """Why messages were refused: counts and bytes by reason, kind and sender, from the run's
    ``dead_letters.jsonl`` (or only the reasons' counts in ``summary.json`` when that is all there is).

    Why here: a non-zero "dead-lettered" with no reason sends the user to the broker, where the
    queue may be gone; the reasons (``oversized``, ``stale-round``, ``forged``, ...) say what to fix.
    """
    records = read_dead_letters(run_dir)
    if not records:
        reasons = summary.get("dead_letter_reasons") or {}
        if reasons:
            out.print("dead letters by reason: " + ", ".join(f"{r} {n}" for r, n in reasons.items()))
        return
    groups: dict[tuple[str, str, str], list[int]] = {}
    for rec in records:
        key = (str(rec.get("reason")), str(rec.get("kind") or "?"), str(rec.get("sender") or "?"))
        groups.setdefault(key, []).append(int(rec.get("size") or 0))
    t = Table(title=f"dead letters of {run_dir.name} ({DEAD_LETTERS_FILE})")
    for col in ("reason", "kind", "sender", "messages", "bytes"):
        t.add_column(col, justify="right" if col in ("messages", "bytes") else "left")
    for (reason, kind, sender), sizes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        t.add_row(reason, kind, sender, str(len(sizes)), _fmt_bytes(sum(sizes)))
    out.print(t)


def report(run: str) -> int:
    """Print one run's rounds and summary; 2 if it is not a finished run."""
    try:
        print_report(Path(run))
    except FileNotFoundError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    return 0


def compare(run_paths: list[str], plot: str | None, accuracy: str = "auto") -> int:
    """Tabulate runs side by side, global and personalised accuracies in rows of their own; with
    ``plot``, draw the runs whose accuracy is of the kind ``accuracy`` chooses (2 on a missing run,
    or when ``auto`` meets runs of both kinds: the user must say which to plot)."""
    out = Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title="comparison")
    t.add_column("")
    summaries = []
    for run in run_paths:
        try:
            summaries.append(_view(read_summary(Path(run))))
        except FileNotFoundError as err:
            console.print(f"[red]{err}[/red]")
            return 2
        t.add_column(Path(run).name, justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        t.add_row(label, *(fmt(s[key]) if s.get(key) is not None else "-" for s in summaries))
    out.print(t)
    kinds = {Path(run).name: s["accuracy_kind"] for run, s in zip(run_paths, summaries, strict=True)}
    for kind in sorted(set(kinds.values())):
        names = ", ".join(n for n, k in kinds.items() if k == kind)
        out.print(f"{names}: accuracy is {ACCURACY_MEANING[kind]}")
    if plot:
        return _plot(run_paths, kinds, Path(plot), accuracy, out)
    return 0


def _plot(run_paths: list[str], kinds: dict[str, str], path: Path, accuracy: str, out: Console) -> int:
    from shared.results import plot_compare

    present = set(kinds.values())
    if accuracy == "auto":
        if len(present) > 1:
            console.print(
                "[red]--plot: these runs measure accuracy in two ways[/red] (global: "
                f"{', '.join(n for n, k in kinds.items() if k == 'global')}; personalised: "
                f"{', '.join(n for n, k in kinds.items() if k == 'personalised')}); choose what to plot "
                "with --accuracy global, personalised or both"
            )
            return 2
        accuracy = present.pop()
    wanted = {"global", "personalised"} if accuracy == "both" else {accuracy}
    runs = {
        f"{name} ({kinds[name]})" if accuracy == "both" else name: read_rounds(Path(run))
        for run, name in ((r, Path(r).name) for r in run_paths)
        if kinds[name] in wanted
    }
    left_out = [n for n, k in kinds.items() if k not in wanted]
    if left_out:
        out.print(f"not plotted (accuracy of another kind): {', '.join(left_out)}")
    ylabel = "accuracy (see legend)" if accuracy == "both" else f"accuracy, {_SHORT[accuracy]}"
    try:
        dashed = frozenset(label for label in runs if label.endswith("(personalised)"))
        drawn = plot_compare(runs, path, ylabel=ylabel, dashed=dashed)
    except ValueError as err:
        console.print(f"[red]--plot: {err}[/red]")
        return 2
    out.print(f"plot: {drawn}")
    return 0


_SHORT = {"global": "global model", "personalised": "each device's own model"}
