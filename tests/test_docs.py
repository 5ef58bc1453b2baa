"""The repository stands alone: no reference to files outside it, no path of a development machine.

Why: fedfleet was built next to material that a user who clones the project does not have (the
papers' implementation specs, the papers' texts, a design note), and some generated files were
written with the absolute path of the machine that made them. A reader following such a reference
finds nothing, so every reference must point into the repository (``docs/``) or cite a paper by
its title, and generated results must hold repo-relative paths. These checks read exactly what git
tracks (``git ls-files``), so they judge what a clone contains, not a developer's working files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: the sibling directory of the development checkout; written in two pieces so that this file does
#: not mention it itself
OUTSIDE_REFERENCE = ("../" + "shared").encode()

#: an absolute path under a development machine's work, root or home directory (a path that starts
#: there, not one that merely contains the word, e.g. ``docs/work/`` or ``~/home/``)
ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|root|home)/[\w.-]")

#: text files that may hold a path: docs, configs, data, code
TEXT_SUFFIXES = {".md", ".json", ".csv", ".yaml", ".yml", ".py", ".toml", ".txt", ".sh", ".mk", ".cfg"}

#: the CI helper is machinery around the project, not part of it
EXEMPT_PREFIXES = (".ci/",)


def tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    git = shutil.which("git")
    if git is None:
        pytest.fail("git is needed to list the tracked files")
    out = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    files = [f for f in out.split("\0") if f and not f.startswith(EXEMPT_PREFIXES)]
    assert len(files) > 50, f"git ls-files listed only {len(files)} files; is this the project root?"
    return files


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def test_no_tracked_file_refers_outside_the_repository() -> None:
    hits = []
    for name in tracked_files():
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree but still tracked
            continue
        data = path.read_bytes()
        start = data.find(OUTSIDE_REFERENCE)
        while start != -1:
            hits.append(f"{name}:{_line_of(data, start)}")
            start = data.find(OUTSIDE_REFERENCE, start + 1)
    assert not hits, (
        f"{len(hits)} references to {OUTSIDE_REFERENCE.decode()!r}, which a clone does not have; point them "
        f"at docs/ or cite the paper by title: {', '.join(hits[:20])}"
    )


def test_no_tracked_text_file_holds_a_development_machine_path() -> None:
    hits = []
    for name in tracked_files():
        path = ROOT / name
        if path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in ABSOLUTE_PATH.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            hits.append(f"{name}:{line}: {text[match.start() : match.start() + 40]!r}")
    assert not hits, (
        f"{len(hits)} absolute paths of a development machine in tracked files; write them relative to "
        f"the repository root: {'; '.join(hits[:10])}"
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("run `" + "/wo" + "rk/main/runs/bench-1`", True),
        ("cache in " + "/ro" + "ot/.cache/pip", True),
        ('"' + "/ho" + 'me/alice/data.csv"', True),
        ("see docs/work/notes.md", False),
        ("runs/bench-1", False),
        ("~/home/x", False),
        ("/var/lib/grafana/dashboards", False),
        ("http://host" + "/wo" + "rk/x", False),
    ],
)
def test_the_absolute_path_pattern(text: str, found: bool) -> None:
    """The pattern finds paths that start at a development machine's root directories, and nothing
    else (so the check above can fail, and does not fail on ordinary relative paths or URLs)."""
    assert bool(ABSOLUTE_PATH.search(text)) is found
