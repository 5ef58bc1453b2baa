"""What a new user trips over: honest labels, loud failures, one name for one number, a tidy broker.

Each test here fails without the fix it guards (issue #18): ``compare`` labelling personalised and
global accuracy, one definition of compression, an explicit broker that does not answer, a message
limit smaller than the experiment's messages, an unknown dataset under ``--syntax-only``, and a run
that leaves the broker as it found it except for its dead letters, which it exports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from tests.conftest import write_config

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv: str) -> int:
    """``fedfleet ARGV``'s exit code (a config error exits through ``SystemExit``)."""
    try:
        return main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


# -- validation ------------------------------------------------------------------------------------
def test_syntax_only_validation_rejects_an_unknown_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--syntax-only`` loads no data, so the dataset name must be checked by the config itself."""
    cfg = write_config(tmp_path / "exp.yaml", dataset={"name": "fashion_minst"})
    assert cli("validate", str(cfg), "--syntax-only") == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "dataset.name" in err and "fashion_minst" in err
    assert "fashion-mnist" in err  # the closest valid name is suggested


@pytest.mark.parametrize("name", ["digits", "fashion-mnist", "FMNIST", "cifar-10"])
def test_known_dataset_names_and_aliases_still_validate(tmp_path: Path, name: str) -> None:
    cfg = write_config(tmp_path / "exp.yaml", dataset={"name": name})
    assert cli("validate", str(cfg), "--syntax-only") == 0


# -- an explicit broker that does not answer -------------------------------------------------------
def test_an_explicit_rabbitmq_url_that_does_not_answer_is_an_error_naming_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No silent in-process run: the user named a broker, so the run is refused, the message names
    the host and port, and the password is not printed. Port 1 on the loopback refuses at once."""
    monkeypatch.setenv("RABBITMQ_URL", "amqp://guest:s3cret-pw@127.0.0.1:1/%2F")
    cfg = write_config(tmp_path / "exp.yaml", rounds=1)
    rc = cli("run", str(cfg), "--runs-dir", str(tmp_path / "runs"), "--run-id", "r1")
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2
    assert "127.0.0.1:1" in err and "RABBITMQ_URL" in err
    assert "s3cret-pw" not in err
    assert "IN-PROCESS" not in err
    assert not (tmp_path / "runs" / "r1" / "summary.json").exists()
