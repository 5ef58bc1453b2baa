"""The experiment config: unknown keys and bad values are errors that name the file and the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from shared.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_experiment_validates() -> None:
    paths = sorted((ROOT / "experiments").glob("*.yaml"))
    assert paths, "no experiments shipped"
    for path in paths:
        cfg = load_config(path)
        assert cfg.rounds >= 1


def test_quickstart_is_what_the_issue_asks() -> None:
    cfg = load_config(ROOT / "experiments/quickstart.yaml")
    assert (cfg.algorithm.name, cfg.dataset.name) == ("fedavg", "digits")
    assert (cfg.num_devices, cfg.devices_per_round, cfg.rounds) == (20, 10, 20)


def test_misspelt_key_names_key_file_and_suggestion(tmp_path: Path) -> None:
    p = tmp_path / "exp.yaml"
    p.write_text("name: x\nrounds: 2\nnum_devices: 4\ndevices_per_rund: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg
    assert "unknown key 'devices_per_rund'" in msg
    assert "did you mean 'devices_per_round'" in msg


def test_nested_unknown_key_is_dotted(tmp_path: Path) -> None:
    p = tmp_path / "exp.yaml"
    p.write_text("name: x\nrounds: 2\nnum_devices: 4\ndevices_per_round: 2\ntrain: {lr: 0.1, epochs: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train\.epochs' \(did you mean 'local_epochs'\?\)"):
        load_config(p)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("name: x\nrounds: 0\nnum_devices: 4\ndevices_per_round: 2\n", "'rounds'"),
        ("name: x\nrounds: 2\nnum_devices: 4\ndevices_per_round: 9\n", "exceeds num_devices"),
        (
            "name: x\nrounds: 2\nnum_devices: 4\ndevices_per_round: 2\ndataset: {partition: random}\n",
            "partition",
        ),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("name: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_values_are_explained(tmp_path: Path, body: str, fragment: str) -> None:
    p = tmp_path / "exp.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert fragment in str(err.value)
    assert str(p) in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_algorithm_options_are_strict() -> None:
    from shared import algorithms

    with pytest.raises(ValueError, match=r"algorithm\.options\.alpha"):
        algorithms.parse_options("fedavg", {"alpha": 1})
    with pytest.raises(ValueError, match="unknown algorithm 'fedsgd'"):
        algorithms.get("fedsgd")


def test_validate_resolved_prints_every_default_and_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedfleet validate --resolved``: the config a run will use, algorithm defaults included,
    as YAML that loads back to the same config; a bad option still fails with exit code 2."""
    import yaml

    from services.cli import main
    from shared.algorithms import parse_options
    from tests.conftest import write_config

    src = write_config(tmp_path / "h.yaml", algorithm={"name": "hermes", "options": {"r_target": 0.5}})
    assert main(["validate", str(src), "--resolved"]) == 0
    text = capsys.readouterr().out
    data = yaml.safe_load(text)
    assert data["algorithm"]["options"]["r_target"] == 0.5
    assert data["algorithm"]["options"]["r_p"] == 0.2  # Hermes' default, filled in
    assert data["dataset"]["feature_noise_std"] == 0.0
    back = tmp_path / "back.yaml"
    back.write_text(text)
    a, b = load_config(src), load_config(back)
    assert a.model_dump(exclude={"algorithm"}) == b.model_dump(exclude={"algorithm"})
    assert parse_options("hermes", a.algorithm.options) == parse_options("hermes", b.algorithm.options)
    bad = write_config(tmp_path / "bad.yaml", algorithm={"name": "hermes", "options": {"r_targt": 0.5}})
    assert main(["validate", str(bad), "--resolved"]) == 2


def test_validate_refuses_what_run_would_refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``validate`` loads the dataset and the fleet as ``run`` does, so "ok" means the run can start;
    ``--syntax-only`` checks keys and values only (a config for a pod whose paths are not here)."""
    from services.cli import main
    from tests.conftest import write_config

    missing = tmp_path / "no-such-cifar"
    cfg = write_config(tmp_path / "c.yaml", dataset={"name": "cifar10", "path": str(missing)})
    assert main(["validate", str(cfg)]) == 2
    err = "".join(capsys.readouterr().err.split())  # rich wraps long lines, even inside a path
    assert "".join(f"cannot run here: CIFAR-10 path {missing} does not exist".split()) in err
    assert main(["validate", str(cfg), "--syntax-only"]) == 0
    assert "ok" in capsys.readouterr().err
    good = write_config(tmp_path / "g.yaml")
    assert main(["validate", str(good)]) == 0


def test_configuration_reference_is_current_and_documents_every_key() -> None:
    """``docs/configuration.md`` is what ``fedfleet reference`` prints now (regenerate it with
    ``.venv/bin/fedfleet reference --out docs/configuration.md``), and every config key and every
    algorithm option has a ``#:`` comment, so no row of the page has an empty meaning."""
    from shared import algorithms
    from shared.config import ExperimentConfig
    from shared.config.reference import SECTIONS, config_reference, field_comments

    assert (ROOT / "docs/configuration.md").read_text() == config_reference(), (
        "docs/configuration.md is stale: run .venv/bin/fedfleet reference --out docs/configuration.md"
    )
    models: list[tuple[str, type[BaseModel]]] = [("top level", ExperimentConfig), *SECTIONS]
    models += [(f"algorithm {n}", cls.Options) for n, cls in algorithms.REGISTRY.items()]
    undocumented = [
        f"{where}: {name}"
        for where, model in models
        for name, info in model.model_fields.items()
        if name not in field_comments(model)
        and not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel))
    ]
    assert not undocumented, undocumented


def test_reference_rows_carry_type_default_bounds_and_comment() -> None:
    """One row read back: a Literal lists its values, a required key says so, bounds are shown, and
    an inherited option takes its comment from the class that defines it."""
    from typing import Literal

    from pydantic import Field

    from shared.config.reference import field_comments, model_table
    from shared.models.width_slice import WidthOptions

    class Base(BaseModel):
        #: how many
        #: (two lines)
        count: int = Field(3, ge=1, lt=10)
        mode: Literal["a", "b"] = "a"

    class Child(Base):
        #: must be given
        need: float

    rows = model_table(Child, "x.")
    assert rows[2] == "| `x.count` | int | `3` | ≥ 1, < 10 | how many (two lines) |"
    assert rows[3] == "| `x.mode` | `a` \\| `b` | `a` |  |  |"
    assert rows[4] == "| `x.need` | float | **required** |  | must be given |"
    assert field_comments(WidthOptions)["rounding"].startswith("``k = max(1, floor(r·m))``")


def test_a_run_directory_resumed_with_another_config_is_refused_naming_the_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming must not mix two experiments: a different config is an error that names what
    differs, and the run's own ``config.yaml`` is never overwritten; ``--force`` resumes anyway and
    keeps the new config beside the old one."""
    from services.cli import main
    from shared.config import RunMismatch, claim_run_dir, dump_config
    from tests.conftest import write_config

    run = tmp_path / "runs" / "r1"
    first = load_config(write_config(tmp_path / "a.yaml", rounds=10))
    assert claim_run_dir(run, first) is None  # a new directory: its config is written
    original = (run / "config.yaml").read_text()
    assert original == dump_config(first)
    assert claim_run_dir(run, first) is None  # the same config resumes

    other_path = write_config(tmp_path / "b.yaml", rounds=30, train={"lr": 0.05})
    other = load_config(other_path)
    with pytest.raises(RunMismatch) as err:
        claim_run_dir(run, other)
    assert "rounds: 10 -> 30" in str(err.value) and "train.lr: 0.3 -> 0.05" in str(err.value)
    assert (run / "config.yaml").read_text() == original

    # the same refusal from the command line, before any broker is contacted: exit code 2
    argv = ["server", "--config", str(other_path), "--run-dir", str(run), "--metrics-port", "0"]
    assert main(argv) == 2
    assert "rounds: 10 -> 30" in capsys.readouterr().err
    runs = ["run", str(other_path), "--runs-dir", str(tmp_path / "runs"), "--run-id", "r1"]
    assert main(runs) == 2
    assert "train.lr" in "".join(capsys.readouterr().err.split())
    assert (run / "config.yaml").read_text() == original

    extra = claim_run_dir(run, other, force=True)
    assert extra is not None and extra.parent == run and load_config(extra) == other
    assert (run / "config.yaml").read_text() == original


def test_a_service_given_an_impossible_experiment_says_why_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedfleet server|aggregator|client`` with a config this machine cannot build (more devices
    than samples): exit code 2 and the reason, no traceback, nothing connected."""
    from services.cli import main
    from tests.conftest import write_config

    cfg = write_config(tmp_path / "c.yaml", num_devices=900, devices_per_round=10)
    for argv in (
        ["server", "--config", str(cfg), "--run-dir", str(tmp_path / "run")],
        ["aggregator", "--config", str(cfg)],
        ["client", "--config", str(cfg)],
    ):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--metrics-port", "0"])
        assert exit_.value.code == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "num_devices (900) exceeds the number of samples (800)" in err and "Traceback" not in err


def test_run_over_the_broker_checks_in_a_child_and_its_parent_stays_lean(tmp_path: Path) -> None:
    """``fedfleet run`` as processes builds the experiment in a child process (so a bad dataset path
    is still refused before anything starts, naming the path) and never imports torch itself: the
    parent only launches and watches the services (issue 16, lean processes)."""
    import subprocess
    import sys

    from tests.conftest import write_config

    missing = tmp_path / "no-such-cifar"
    bad = write_config(tmp_path / "bad.yaml", dataset={"name": "cifar10", "path": str(missing)})
    good = write_config(tmp_path / "good.yaml")
    probe = (
        "import sys\n"
        "from services import cli, orchestrator\n"
        "def launched(*a, **k):\n"
        "    print('TORCH-IN-PARENT', 'torch' in sys.modules, flush=True)\n"
        "    raise SystemExit(7)\n"
        "orchestrator.run_processes = launched\n"
        "cli._choose_transport = lambda *a: 'amqp'\n"
        "raise SystemExit(cli.main(['run', sys.argv[1], '--runs-dir', sys.argv[2]]))\n"
    )
    root = Path(__file__).resolve().parents[1]

    def run(cfg: Path) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", probe, str(cfg), str(tmp_path / "runs")]
        return subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"}
        )

    refused = run(bad)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "CIFAR-10 path" in refused.stdout + refused.stderr and "TORCH-IN-PARENT" not in refused.stdout
    launched = run(good)
    assert launched.returncode == 7, launched.stdout + launched.stderr
    assert "TORCH-IN-PARENT False" in launched.stdout
