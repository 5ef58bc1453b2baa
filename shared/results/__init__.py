"""Run results: ``rounds.csv``, ``devices.csv``, ``summary.json`` and plots under ``runs/<run-id>/``.

Why files a person can read and plot: an emulator is judged by the curves it produces (accuracy vs
round, accuracy vs bytes), so every run leaves CSVs any tool can open, a JSON summary for scripts, and
PNG plots — and ``fedfleet report`` / ``compare`` re-read exactly these files.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

ROUND_COLUMNS = [
    "round",
    "outcome",
    "accuracy",
    "loss",
    "bytes_up",
    "bytes_down",
    "dense_bytes_up",
    "dense_bytes_down",
    "compression_ratio_up",
    "compression_ratio_down",
    "broker_bytes",
    "cum_bytes_up",
    "cum_bytes_down",
    "participants",
    "selected",
    "rejected",
    "dropped",
    "offline",
    "wall_seconds",
    "round_seconds",
    "virtual_seconds",
    "density",
    "train_flops",
    "train_loss",
]


def compression_ratio(dense_bytes: float, wire_bytes: float) -> float | None:
    """fedfleet's one definition of compression: dense-equivalent bytes / wire bytes.

    Above 1, the payload encoding (sparse tensors, masks, index slices, thresholds) saved bytes; 1 is
    no compression; below 1, the message headers outweigh any saving (dense FedAvg sits just under
    1). Why one definition: ``summary.json`` once reported wire/dense while the dashboard showed
    dense/wire under the same word, so a reader could not tell a saving from a cost. The same ratio,
    under the name ``compression_ratio``, is in ``rounds.csv`` and ``summary.json``
    (``compression_ratio_up`` / ``_down``), the Prometheus recording rule ``fedfleet:compression_ratio``
    and the dashboard's "Compression ratio (dense-equivalent / wire)" panels. None when nothing
    crossed the wire.
    """
    return dense_bytes / wire_bytes if wire_bytes else None


def _with_compression(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its compression ratios (from its own byte counts, by the one definition)."""
    out = dict(row)
    for d in ("up", "down"):
        if f"bytes_{d}" in row and f"dense_bytes_{d}" in row:
            out[f"compression_ratio_{d}"] = compression_ratio(row[f"dense_bytes_{d}"], row[f"bytes_{d}"])
    return out


@dataclass
class DeviceStats:
    device_id: int
    tier: str = "default"
    selected: int = 0
    completed: int = 0
    rejected: int = 0
    dropped: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    virtual_seconds: float = 0.0
    #: the personalised model's accuracy on the device's own test split after the last round
    eval_accuracy: float | None = None


DEVICE_COLUMNS = [f.name for f in fields(DeviceStats)]


def device_row(d: DeviceStats) -> dict[str, Any]:
    """``dataclasses.asdict(d)`` for this flat record, without its deep copy of every field (about a
    tenth of the time: benchmarks/results-scale.md, "After batched go"). The server converts the
    record of every device that has taken part for each round's checkpoint: up to 10,000 a round at
    10,000 devices."""
    return {name: getattr(d, name) for name in DEVICE_COLUMNS}


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return "" if v is None else v


def write_rounds(
    run_dir: Path, rows: list[dict[str, Any]], *, after: tuple[int, list[str]] | None = None
) -> tuple[int, list[str]]:
    """The fixed columns, then any ``m_<metric>`` columns (device-reported metrics an algorithm adds)
    and ``e_<metric>`` columns (extra numbers of the server-side evaluation). The compression ratios
    are derived here from each row's bytes, so no caller can define them another way.

    ``after``: what an earlier call returned for the same file, (rows written, columns). When the
    rows since then bring no new column, they are appended instead of the file being rewritten: the
    server writes ``rounds.csv`` after every round, and rewriting it made each round of a long run
    cost O(rounds) (``benchmarks/bench_checkpoint.py``). Returns (rows written, columns) for the next call.
    """
    done, columns = after if after is not None else (0, [])
    if not 0 < done <= len(rows) or not (run_dir / "rounds.csv").exists():
        done, columns = 0, []
    extra = {k for row in rows[done:] for k in row if k.startswith(("m_", "e_"))}
    if done and extra <= set(columns):
        mode = "a"
    else:  # the first write, or a new column: the whole file
        extra |= {k for row in rows[:done] for k in row if k.startswith(("m_", "e_"))}
        mode, done, columns = "w", 0, ROUND_COLUMNS + sorted(extra)
    with (run_dir / "rounds.csv").open(mode, newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if mode == "w":
            w.writeheader()
        for row in map(_with_compression, rows[done:]):
            w.writerow({k: _fmt(row.get(k)) for k in columns})
    return len(rows), columns


def write_devices(run_dir: Path, devices: Iterable[DeviceStats], *, in_id_order: bool = False) -> None:
    """``devices.csv``, one row per device in id order. ``in_id_order``: ``devices`` already comes
    in that order, and is written as it comes (a generator over 100,000 devices is then never held
    whole, issue 16)."""
    rows = devices if in_id_order else sorted(devices, key=lambda d: d.device_id)
    with (run_dir / "devices.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=DEVICE_COLUMNS)
        w.writeheader()
        for d in rows:
            w.writerow({k: _fmt(v) for k, v in device_row(d).items()})


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")


#: columns that stay floats when their value happens to be whole
_FLOAT_COLUMNS = {"accuracy", "loss", "density", "compression_ratio_up", "compression_ratio_down"}


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "rounds.csv"
    if not path.exists():
        return []
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            parsed: dict[str, Any] = {}
            for k, v in row.items():
                if k == "outcome":
                    parsed[k] = v
                elif v == "" or v is None:
                    parsed[k] = None
                else:
                    num = float(v)
                    parsed[k] = int(num) if num.is_integer() and k not in _FLOAT_COLUMNS else num
            out.append(parsed)
    return out


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{run_dir}: no summary.json (the run did not finish, or this is not a run dir)"
        )
    data: dict[str, Any] = json.loads(path.read_text())
    return data


#: one JSON object per message the run's dead-letter queue held at the end (``fedfleet run``)
DEAD_LETTERS_FILE = "dead_letters.jsonl"


def write_dead_letters(run_dir: Path, records: list[dict[str, Any]]) -> Path:
    """``dead_letters.jsonl``: per dead letter its reason, detail, kind, sender and size in bytes.

    Why a file: the broker's dead-letter queue outlives neither a ``make down`` nor a purge, and a
    queue is not where a person looks for a run's results; the run directory is.
    """
    path = run_dir / DEAD_LETTERS_FILE
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return path


def read_dead_letters(run_dir: Path) -> list[dict[str, Any]] | None:
    """The exported dead letters (None: the run exported none, e.g. an in-process run)."""
    path = run_dir / DEAD_LETTERS_FILE
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_compare(
    runs: dict[str, list[dict[str, Any]]],
    out: Path,
    *,
    ylabel: str = "accuracy",
    dashed: frozenset[str] = frozenset(),
) -> Path:
    """One figure for several runs: accuracy vs round and accuracy vs cumulative wire bytes.

    Why: the question this tool answers is "what does each algorithm cost in bytes for the accuracy
    it reaches"; two runs' ``accuracy_vs_bytes.png`` side by side have different axes, one overlay
    does not. ``runs`` maps a label to its ``rounds.csv`` rows; the bytes axis is logarithmic because
    algorithms differ by orders of magnitude (threshold-only vs dense models). ``ylabel`` says what
    the accuracy measured (global model or each device's own: the caller keeps the kinds apart);
    the runs in ``dashed`` are drawn dashed (another kind of accuracy in the same figure).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    plotted = 0
    for label, rows in runs.items():
        pts = [r for r in rows if r.get("accuracy") is not None]
        if not pts:
            continue
        plotted += 1
        acc = [r["accuracy"] for r in pts]
        cum = [max((r["cum_bytes_up"] + r["cum_bytes_down"]) / 1e6, 1e-6) for r in pts]
        style = "--" if label in dashed else "-"
        by_round.plot([r["round"] for r in pts], acc, style, marker="o", markersize=2, label=label)
        by_bytes.plot(cum, acc, style, marker="o", markersize=2, label=label)
    if not plotted:
        plt.close(fig)
        raise ValueError("none of the runs has an accuracy to plot")
    by_round.set_xlabel("round")
    by_bytes.set_xlabel("cumulative wire bytes, up + down (MB, log scale)")
    by_bytes.set_xscale("log")
    for ax in (by_round, by_bytes):
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_run(run_dir: Path, rows: list[dict[str, Any]], title: str) -> list[Path]:
    """accuracy vs round and accuracy vs cumulative wire bytes (up + down), as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("accuracy") is not None]
    if not pts:
        return []
    rounds = [r["round"] for r in pts]
    acc = [r["accuracy"] for r in pts]
    cum = [(r["cum_bytes_up"] + r["cum_bytes_down"]) / 1e6 for r in pts]
    paths = []
    for name, xs, xlabel in (
        ("accuracy_vs_round.png", rounds, "round"),
        ("accuracy_vs_bytes.png", cum, "cumulative wire bytes, up + down (MB)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        ax.plot(xs, acc, marker="o", markersize=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.set_title(title)
        fig.tight_layout()
        path = run_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def replace_doc_block(doc: Path, marker: str, text: str) -> None:
    """Replace what lies between ``<!-- {marker}:begin -->`` and ``<!-- {marker}:end -->`` in ``doc``.

    Why: the algorithm docs quote result tables that benchmark scripts regenerate from real runs;
    writing them between markers keeps the prose around a table hand-written and the numbers
    machine-written, so a rerun cannot leave a stale number behind. A doc without the markers is an
    error, not a silent no-op (the table would otherwise never reach the doc).
    """
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    current = doc.read_text()
    if current.count(begin) != 1 or current.count(end) != 1:
        raise ValueError(f"{doc} needs exactly one {begin} ... {end} block")
    head, rest = current.split(begin, 1)
    tail = rest.split(end, 1)[1]
    doc.write_text(f"{head}{begin}\n{text.rstrip()}\n{end}{tail}")
