"""Rewrite the quickstart's sample output in README.md and docs/getting-started.md from a real run.

Runs ``fedfleet run experiments/quickstart.yaml`` over RabbitMQ (``RABBITMQ_URL``, as ``make run``
does) with the sample's run id, as a plain pipe shows it, and puts what it printed between the
``quickstart-output`` markers: rounds 1-3 and the last, the rounds between elided as ``  ...``.
``tests/test_ux.py`` runs the same command and compares it with both documents line by line.

    RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/%2F .venv/bin/python scripts/quickstart_sample.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_ID = "qs-amqp"
DOCS = ("README.md", "docs/getting-started.md")
BEGIN, END = "<!-- quickstart-output:begin -->", "<!-- quickstart-output:end -->"


def _round(line: str) -> int | None:
    cells = line.split("│")
    return int(cells[1]) if len(cells) > 2 and cells[1].strip().isdigit() else None


def main() -> int:
    layout = ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {k: v for k, v in os.environ.items() if k not in layout}
    shutil.rmtree(ROOT / "runs" / RUN_ID, ignore_errors=True)
    cmd = [sys.executable, "-m", "services.cli", "run", "experiments/quickstart.yaml", "--run-id", RUN_ID]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    printed = [line.rstrip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    last = max(r for line in printed if (r := _round(line)) is not None)
    sample: list[str] = []
    for line in printed:
        r = _round(line)
        if r is not None and 3 < r < last:
            if sample[-1] != "  ...":
                sample.append("  ...")
            continue
        sample.append(line)
    block = "\n".join([BEGIN, "```", *sample, "```", END])
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + block + rest.split(END, 1)[1])
        print(f"rewrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
