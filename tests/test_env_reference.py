"""Every setting a process reads from its environment is on the reference page (#19, item 2).

Why: ``RABBITMQ_URL`` taking several addresses, ``RABBITMQ_QUEUE_TYPE`` and the reconnect budget
change what a deployment survives, and a variable nobody can find is a setting nobody uses. The page
is generated from ``Settings``; these tests make sure no field is left out, that each row names the
variable the field is really read from, and that no code reads a variable the page does not list.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared.config import Settings
from shared.config.reference import OTHER_ENV, config_reference, env_name, field_comments

ROOT = Path(__file__).resolve().parent.parent

#: variables the code reads that are not settings of fedfleet's (a child process's environment)
NOT_SETTINGS = {"PYTHONPATH", "COLUMNS", "MAKELEVEL", "CI"}


def _rows() -> dict[str, str]:
    """The process-settings table of the page: variable → its row."""
    page = config_reference()
    section = page.split("## Process settings (environment)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([A-Z0-9_]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_every_setting_is_listed_under_its_variable_with_default_and_meaning() -> None:
    rows = _rows()
    notes = field_comments(Settings)
    for name, info in Settings.model_fields.items():
        var = env_name(name, info)
        assert var in rows, f"{var} (Settings.{name}) is missing from docs/configuration.md"
        assert name in notes, f"Settings.{name} has no #: comment: its row would have no meaning"
        cells = [c.strip() for c in rows[var].strip("|").split("|")]
        assert cells[2], f"{var}: no default"
    for var in ("RABBITMQ_URL", "RABBITMQ_QUEUE_TYPE", "FEDFLEET_RECONNECT_BUDGET_S"):
        assert var in rows
    assert "`;`" in rows["RABBITMQ_URL"] or "``;``" in rows["RABBITMQ_URL"]


@pytest.mark.parametrize(
    ("var", "field", "value", "expected"),
    [
        (
            "RABBITMQ_URL",
            "rabbitmq_url",
            "amqp://a:b@x:1/v;amqp://a:b@y:1/v",
            "amqp://a:b@x:1/v;amqp://a:b@y:1/v",
        ),
        ("RABBITMQ_QUEUE_TYPE", "rabbitmq_queue_type", "quorum", "quorum"),
        ("RABBITMQ_QUEUE_MODE", "rabbitmq_queue_mode", "default", "default"),
        ("FEDFLEET_RECONNECT_BUDGET_S", "reconnect_budget_s", "7.5", 7.5),
        ("FEDFLEET_RECONNECT_BACKOFF_S", "reconnect_backoff_s", "0.5", 0.5),
        ("FEDFLEET_RECONNECT_BACKOFF_MAX_S", "reconnect_backoff_max_s", "2", 2.0),
        ("FEDFLEET_PUBLISH_RETRIES", "publish_retries", "3", 3),
    ],
)
def test_the_listed_variable_is_the_one_read(
    monkeypatch: pytest.MonkeyPatch, var: str, field: str, value: str, expected: object
) -> None:
    """The name on the page is the one pydantic-settings reads (an alias or the prefix + name)."""
    assert env_name(field, Settings.model_fields[field]) == var
    monkeypatch.setenv(var, value)
    assert getattr(Settings(), field) == expected


def test_no_code_reads_a_variable_the_page_does_not_list() -> None:
    """``os.environ`` reads outside ``Settings`` (the client's ``HOSTNAME``, the tap's
    ``RABBITMQ_URL``) must be on the page too."""
    listed = set(_rows())
    read: dict[str, str] = {}
    pattern = re.compile(r"""os\.environ(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]*)["']""")
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("shared/**/*.py")]:
        for var in pattern.findall(path.read_text()):
            read.setdefault(var, str(path.relative_to(ROOT)))
    assert "HOSTNAME" in read and "HOSTNAME" in OTHER_ENV  # the scan finds what it should
    unlisted = {var: where for var, where in read.items() if var not in listed | NOT_SETTINGS}
    assert not unlisted, f"read from the environment but not in docs/configuration.md: {unlisted}"


def test_importing_shared_pins_the_cpu_code_path_unless_the_caller_chose() -> None:
    """``import shared`` sets the kernel-path pins (same model on every AVX2 host) and keeps a value
    the environment already gives; torch then reports the pinned capability."""
    import os
    import subprocess
    import sys

    from shared import NUMERICS_ENV

    probe = (
        "import os, shared, torch; torch.ones(8).sum(); "
        "print(*(os.environ[k] for k in shared.NUMERICS_ENV), torch.backends.cpu.get_cpu_capability())"
    )
    clean = {k: v for k, v in os.environ.items() if k not in NUMERICS_ENV}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=clean, cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [*NUMERICS_ENV.values(), "AVX2"]
    chosen = {**clean, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=chosen, cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        NUMERICS_ENV["MKL_CBWR"],
        "default",
        NUMERICS_ENV["ONEDNN_MAX_CPU_ISA"],
        "DEFAULT",
    ]
