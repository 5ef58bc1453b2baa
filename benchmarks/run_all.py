"""Run every benchmark (codec, mac, envelope, recv, rounds, transfer, broker, checkpoint); write one report.

``make bench`` calls this.

Usage: ``python benchmarks/run_all.py --out benchmarks/results.md
[--only codec mac envelope recv rounds transfer broker checkpoint] [--rounds 40] [--clients 2]
[--aggregators 1] [--rounds-repeats 3] [--runs-dir runs]``.

Why one report that starts with its own provenance: benchmark numbers are only comparable with the
command, the date and the machine (cores, CPU, and how busy it was: the load average at the start
and the end) that produced them, so those lead the file. The report is written even when one
benchmark fails (its section says why), so a broken broker does not hide the codec numbers.
Takes 4-9 minutes on 2 cores (most of it in the ``fedfleet run`` subprocesses of the rounds
benchmark); a rich progress bar on stderr shows where it is.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for path in (str(REPO), str(BENCH_DIR)):  # the bench modules, and `shared` from a plain checkout
    if path not in sys.path:
        sys.path.insert(0, path)

import bench_broker  # noqa: E402
import bench_checkpoint  # noqa: E402
import bench_codec  # noqa: E402
import bench_dead_letters  # noqa: E402
import bench_envelope  # noqa: E402
import bench_mac  # noqa: E402
import bench_recv  # noqa: E402
import bench_rounds  # noqa: E402
import bench_transfer  # noqa: E402

BENCHMARKS = (
    "codec",
    "mac",
    "envelope",
    "recv",
    "dead-letters",
    "rounds",
    "transfer",
    "broker",
    "checkpoint",
)


def _redact(url: str) -> str:
    """An AMQP URL with its password replaced, so the report can be shared."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def command_line() -> str:
    """The command that is running, as a person would retype it from the repository root."""
    exe = sys.executable
    rel = os.path.relpath(exe, Path.cwd())
    argv = [rel if not rel.startswith("..") else exe, *sys.argv]
    env = os.environ.get("RABBITMQ_URL")
    prefix = f"RABBITMQ_URL={shlex.quote(_redact(env))} " if env else ""
    return prefix + shlex.join(argv)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit(ignore: Path | None = None) -> str:
    """HEAD's short hash, and whether tracked files differ from it (read-only git plumbing).

    ``ignore``: a file whose changes do not count, the report being appended to (a second run of
    ``make bench-scale`` would otherwise call the code of the first "uncommitted changes")."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        inside = ignore is not None and ignore.resolve().is_relative_to(REPO)
        spec = [f":(exclude){ignore.resolve().relative_to(REPO)}"] if ignore is not None and inside else []
        diff = subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--", *spec], cwd=REPO)
        dirty = diff.returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes" if dirty else "")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def header(started: datetime) -> list[str]:
    """Provenance: command, date, machine and load, versions."""
    import numpy as np
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    via_make = " (via `make bench`)" if os.environ.get("MAKELEVEL") else ""
    return [
        f"Command{via_make}: `{command_line()}`",
        "",
        "# fedfleet benchmarks",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {cores} cores (nproc), CPU `{_cpu_model()}`, {platform.system()} "
        f"{platform.release()} {platform.machine()}",
        f"- load average at start: {_load()}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}; "
        f"commit {_git_commit()}",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="the markdown report to write")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--rounds", type=int, default=40, help="rounds per fedfleet run (round 1 skipped)")
    parser.add_argument("--clients", type=int, default=2, help="client processes in the rounds benchmark")
    parser.add_argument("--aggregators", type=int, default=1, help="aggregator processes (rounds)")
    parser.add_argument(
        "--rounds-repeats",
        type=int,
        default=3,
        help="fedfleet runs of each transport at each size in the rounds benchmark (verdicts: their median)",
    )
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs", help="where benchmark runs are kept")
    args = parser.parse_args(argv)

    started = datetime.now().astimezone()
    t0 = time.monotonic()
    lines = header(started)
    console = Console(stderr=True)
    steps = {
        "codec": 1,
        "mac": 1,
        "envelope": 1,
        "recv": 1,
        "dead-letters": 1,
        "rounds": bench_rounds.step_count((10, 50), bench_rounds.TRANSPORTS, args.rounds_repeats),
        "transfer": bench_transfer.step_count(),
        "broker": bench_broker.step_count(),
        "checkpoint": 1,
    }

    def _envelope(say: Callable[[str], None]) -> str:
        say("envelope: every message of every algorithm")
        return bench_envelope.run(2)

    def recv(say: Callable[[str], None]) -> str:
        say("recv: pika's socket reads")
        return bench_recv.run(3)

    def dead_letters(say: Callable[[str], None]) -> str:
        say("dead letters: one by one and together")
        return bench_dead_letters.run(3)

    def checkpoint_job(say: Callable[[str], None]) -> str:
        say("checkpoint: rounds.csv and the checkpoint as a run grows")
        return bench_checkpoint.run()

    def codec(say: Callable[[str], None]) -> str:
        say("codec: encode/decode throughput")
        return bench_codec.run(5)

    def mac(say: Callable[[str], None]) -> str:
        say("mac: each schema version's MAC of an update")
        return bench_mac.run(5)

    jobs: dict[str, tuple[str, Callable[[Callable[[str], None]], str]]] = {
        "codec": ("Codec throughput", codec),
        "mac": ("A device message's MAC", mac),
        "envelope": (
            "Message overhead by algorithm and kind",
            lambda say: _envelope(say),
        ),
        "recv": ("Reading large messages", recv),
        "dead-letters": ("A burst of bad messages", dead_letters),
        "rounds": (
            "Round wall time vs the compute floor",
            lambda say: bench_rounds.run(
                (10, 50),
                args.rounds,
                clients=args.clients,
                aggregators=args.aggregators,
                runs_dir=args.runs_dir,
                progress=say,
                repeats=args.rounds_repeats,
            ),
        ),
        "transfer": (
            "Real-mode transfer durations",
            lambda say: bench_transfer.run(3, runs_dir=args.runs_dir, progress=say),
        ),
        "broker": (
            "Classic vs quorum queues, one node vs a 3-node cluster",
            lambda say: bench_broker.run(50, 8, runs_dir=args.runs_dir, progress=say),
        ),
        "checkpoint": ("The server's bookkeeping per round", checkpoint_job),
    }
    failed = []
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("starting", total=sum(steps[name] for name in args.only))
        first = True

        def say(message: str) -> None:
            nonlocal first
            if not first:  # a new step starts: the previous one is done
                progress.advance(task)
            first = False
            progress.update(task, description=message)

        for name in args.only:
            title, job = jobs[name]
            lines += [f"## {title}", ""]
            bench_started = time.monotonic()
            try:
                lines.append(job(say))
            except Exception as err:  # one broken benchmark must not lose the others' numbers
                failed.append(name)
                console.print(f"[red]{name} failed: {err}[/red]")
                lines += [
                    f"**Failed**: `{type(err).__name__}: {err}`",
                    "",
                    "```",
                    traceback.format_exc(),
                    "```",
                ]
            lines.append(f"_({name}: {time.monotonic() - bench_started:.0f} s)_")
            lines.append("")
        progress.update(task, completed=progress.tasks[0].total, description="done")
    lines += [
        "---",
        "",
        f"Finished {datetime.now().astimezone().isoformat(timespec='seconds')} after "
        f"{time.monotonic() - t0:.0f} s; load average at the end: {_load()}.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # repo-relative paths only: the report is committed, and a reader's clone is not this machine's
    args.out.write_text("\n".join(lines).replace(f"{REPO}/", ""))
    console.print(f"wrote {args.out}" + (f" ([red]failed: {', '.join(failed)}[/red])" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
