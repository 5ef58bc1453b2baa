"""What a new user trips over: honest labels, loud failures, one name for one number, a tidy broker.

Each test here fails without the fix it guards (issue #18): ``compare`` labelling personalised and
global accuracy, one definition of compression, an explicit broker that does not answer, a message
limit smaller than the experiment's messages, an unknown dataset under ``--syntax-only``, a run
that leaves the broker as it found it except for its dead letters, which it exports, and the
README's sample output kept in step with what ``make run`` prints.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

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


def test_a_message_limit_below_the_experiments_messages_is_rejected_saying_how_big_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``processes.max_message_bytes: 1024`` used to pass validation and fail the run as "only 0 of
    8 devices registered". Now validation (and so ``run``) refuses it with the messages' sizes, and
    the limit it asks for is enough for the run."""
    from services.cli import _build, message_sizes
    from services.orchestrator import run_inproc
    from shared.config import load_config

    small = write_config(tmp_path / "small.yaml", processes={"max_message_bytes": 1024})
    assert cli("validate", str(small)) == 2
    err = " ".join(capsys.readouterr().err.split())
    exp = _build(load_config(small))
    assert not isinstance(exp, str)
    sizes = message_sizes(exp)
    dense = 2410 * 4  # the test model's 2,410 float32 parameters
    assert dense < sizes["task"] < dense + 2000  # the global model, plus its envelope
    assert 2 * dense < sizes["partial"] < 2 * dense + 2000  # float64 sums
    assert "processes.max_message_bytes (1,024)" in err
    assert f"{sizes['task']:,} bytes" in err and f"{sizes['partial']:,} bytes" in err
    assert cli("validate", str(small), "--syntax-only") == 0  # sizes need the model: not a syntax check

    enough = max(sizes.values())
    cfg_path = write_config(tmp_path / "ok.yaml", rounds=2, processes={"max_message_bytes": enough})
    assert cli("validate", str(cfg_path)) == 0
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(load_config(cfg_path), run, "limit-test", show_progress=False) == 0
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 2


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


# -- compare: global and personalised accuracy are told apart ----------------------------------------
def _fake_run(root: Path, name: str, algorithm: str, accs: list[float], **extra: object) -> Path:
    """A finished run's files as the server writes them (``compare`` reads nothing else)."""
    from shared.results import write_rounds, write_summary

    run = root / name
    run.mkdir(parents=True)
    rows = [
        {
            "round": i + 1,
            "outcome": "completed",
            "accuracy": a,
            "bytes_up": 100,
            "bytes_down": 100,
            "cum_bytes_up": 100 * (i + 1),
            "cum_bytes_down": 100 * (i + 1),
            "participants": 2,
            "selected": 2,
        }
        for i, a in enumerate(accs)
    ]
    write_rounds(run, rows)
    summary = {
        "algorithm": algorithm,
        "transport": "inproc",
        "rounds": len(accs),
        "final_accuracy": accs[-1],
        "best_accuracy": max(accs),
        **extra,
    }
    write_summary(run, summary)
    return run


def _table_row(out: str, label: str) -> list[str]:
    """The cells of the table row whose first cell is ``label``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_compare_files_global_and_personalised_accuracy_in_rows_of_their_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    glob = _fake_run(tmp_path, "g", "fedavg", [0.5, 0.8125])
    pers = _fake_run(tmp_path, "p", "spafl", [0.6, 0.9375], personal_accuracy_mean=0.875)
    assert cli("compare", str(glob), str(pers)) == 0
    out = capsys.readouterr().out
    assert _table_row(out, "accuracy measured on") == ["global model", "own models"]
    assert _table_row(out, "final accuracy, global model") == ["0.8125", "-"]
    assert _table_row(out, "final accuracy, personalised (participants)") == ["-", "0.9375"]
    assert _table_row(out, "personalised accuracy, mean over all devices") == ["-", "0.8750"]
    text = " ".join(out.split())
    assert "g: accuracy is the global model on the central test split" in text
    assert "p: accuracy is each device's own model on its own test split" in text


def test_compare_plot_makes_the_user_choose_when_runs_measure_accuracy_differently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shared.results

    glob = _fake_run(tmp_path, "g", "fedavg", [0.5, 0.8])
    pers = _fake_run(tmp_path, "p", "hermes", [0.6, 0.9])
    drawn: list[tuple[list[str], str]] = []
    real = shared.results.plot_compare

    def spy(runs: dict[str, list[dict[str, object]]], out: Path, **kw: Any) -> Path:
        drawn.append((list(runs), kw["ylabel"]))
        return real(runs, out, **kw)

    monkeypatch.setattr(shared.results, "plot_compare", spy)
    png = tmp_path / "cmp.png"
    # mixed kinds and no choice: refused, saying which run is which
    assert cli("compare", str(glob), str(pers), "--plot", str(png)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--accuracy" in err and "global: g" in err and "personalised: p" in err
    assert not png.exists() and not drawn
    # one kind: only its runs, the axis says which accuracy
    assert cli("compare", str(glob), str(pers), "--plot", str(png), "--accuracy", "personalised") == 0
    assert drawn[-1] == (["p"], "accuracy, each device's own model")
    assert "not plotted (accuracy of another kind): g" in capsys.readouterr().out
    # both, each labelled with its kind
    assert cli("compare", str(glob), str(pers), "--plot", str(png), "--accuracy", "both") == 0
    assert drawn[-1] == (["g (global)", "p (personalised)"], "accuracy (see legend)")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # runs of one kind plot without a choice
    assert cli("compare", str(glob), str(glob), "--plot", str(png)) == 0
    assert drawn[-1] == (["g"], "accuracy, global model")


# -- one definition and one name of compression ------------------------------------------------------
def _dense_over_wire(expr: str) -> bool:
    """True iff ``expr`` divides dense-equivalent bytes by wire bytes (in that order)."""
    dense, slash, wire = expr.partition("/")
    return bool(slash) and "fedfleet_dense_bytes_total" in dense and "fedfleet_wire_bytes_total" in wire


def test_results_report_compression_as_dense_over_wire(tmp_path: Path) -> None:
    """``summary.json`` and ``rounds.csv`` carry ``compression_ratio_up``/``_down`` = dense / wire."""
    from services.orchestrator import run_inproc
    from shared.config import load_config
    from shared.results import read_rounds

    cfg = load_config(write_config(tmp_path / "c.yaml", rounds=2))
    run = tmp_path / "run"
    run.mkdir()
    assert run_inproc(cfg, run, "compression-test", show_progress=False) == 0
    s = json.loads((run / "summary.json").read_text())
    assert "compression" + "_up" not in s
    for d in ("up", "down"):
        assert s[f"compression_ratio_{d}"] == pytest.approx(s[f"dense_bytes_{d}"] / s[f"bytes_{d}"])
        # FedAvg sends dense float32: headers make the wire a little larger, so just under 1
        assert 0.9 < s[f"compression_ratio_{d}"] < 1.0
    rows = read_rounds(run)
    assert len(rows) == 2
    for row in rows:
        for d in ("up", "down"):
            ratio = row[f"dense_bytes_{d}"] / row[f"bytes_{d}"]
            assert row[f"compression_ratio_{d}"] == pytest.approx(ratio, rel=1e-5)


def test_prometheus_rule_and_dashboard_define_compression_the_same_way() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())
    recorded = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    assert _dense_over_wire(recorded["fedfleet:compression_ratio"])
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/communication-cost.json").read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    about = [p for p in panels if "compression" in (p["title"] + p.get("description", "")).lower()]
    assert len(about) >= 2, "the dashboard shows the compression ratio"
    for panel in about:
        assert panel["title"].startswith("Compression ratio (dense-equivalent / wire)"), panel["title"]
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs and all(_dense_over_wire(e) for e in exprs), (panel["title"], exprs)
    for panel in panels:  # no other panel divides the two the other way round
        for t in panel.get("targets", []):
            wire, slash, dense = t["expr"].partition("/")
            assert not (slash and "wire_bytes" in wire and "dense_bytes" in dense), panel["title"]


def test_no_tracked_file_uses_the_old_compression_name() -> None:
    import subprocess

    old = "compression" + "_up"
    out = subprocess.run(["git", "grep", "-n", "-w", old], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1, f"the old name {old!r} is still used:\n{out.stdout}"


# -- a tidy broker -----------------------------------------------------------------------------------
def _management(url: str, path: str) -> list[dict[str, object]]:
    """GET a list from RabbitMQ's management API (``make broker`` enables it; a test fails without)."""
    import base64
    import urllib.request

    import pika

    params = pika.URLParameters(url)
    auth = base64.b64encode(f"{params.credentials.username}:{params.credentials.password}".encode())
    req = urllib.request.Request(f"http://{params.host}:15672/api/{path}")
    req.add_header("Authorization", "Basic " + auth.decode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = json.loads(resp.read())
    assert isinstance(data, list)
    return data


def broker_objects(url: str, experiment: str) -> set[str]:
    """The names of the queues and exchanges the broker holds for ``experiment``."""
    prefix = f"ff.{experiment}."
    queues = {str(q["name"]) for q in _management(url, "queues/%2F?columns=name")}
    exchanges = {str(e["name"]) for e in _management(url, "exchanges/%2F?columns=name")}
    return {n for n in queues | exchanges if n.startswith(prefix) or n == prefix[:-1]}


def queue_depth(url: str, queue: str) -> int:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


GARBAGE = b"\xc1 not a message"  # 0xc1 is never valid msgpack


def test_an_in_process_run_records_its_dead_letters_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a broker the run directory says the same: ``dead_letters.jsonl`` and the reasons in
    ``summary.json`` and ``fedfleet report``."""
    from services.orchestrator import run_inproc
    from shared.config import load_config

    cfg = load_config(write_config(tmp_path / "c.yaml", rounds=2))
    run = tmp_path / "run"
    run.mkdir()

    def garbage(server: Any) -> None:
        if len(server.rows) == 1:  # after round 1: the server reads it during round 2
            server.transport.publish("server", GARBAGE)

    assert run_inproc(cfg, run, "dl-test", on_round=garbage, show_progress=False) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dead_lettered"] == 1 and summary["dead_letter_reasons"] == {"malformed": 1}
    (rec,) = [json.loads(line) for line in (run / "dead_letters.jsonl").read_text().splitlines()]
    assert rec["reason"] == "malformed" and rec["size"] == len(GARBAGE) and rec["kind"] is None
    assert cli("report", str(run)) == 0
    assert "malformed" in capsys.readouterr().out


@pytest.fixture(params=["classic", "quorum"])
def queue_type(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both queue types: a quorum dead-letter queue refuses ``queue.delete`` with ``if-empty`` (and the
    broker closes the connection over it), which once made every quorum run end in a traceback."""
    monkeypatch.setenv("RABBITMQ_QUEUE_TYPE", request.param)
    return str(request.param)


@pytest.mark.broker
def test_run_end_exports_dead_letters_keeps_them_and_removes_everything_else(
    broker_url: str, experiment_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], queue_type: str
) -> None:
    """The run-end clean-up against the real broker: the dead letters go to ``dead_letters.jsonl``
    (reason, kind, sender, size) and stay in their queue; every other queue goes, including a killed
    aggregator's session queue whose name only the management API knows; ``report`` shows why."""
    import uuid

    from services.orchestrator import export_dead_letters, tidy_broker
    from shared.schemas import Kind, Stop, encode
    from shared.transport import Delivery
    from shared.transport.amqp import AmqpTransport
    from tests.conftest import wait_for

    t = AmqpTransport(broker_url, experiment_id)
    n = t.names
    try:
        t.declare_queue(n.server_queue, ["server"])
        orphan = n.aggregator_queue(f"aggregator-0-{uuid.uuid4().hex[:8]}")  # its process was killed
        t.declare_queue(orphan, ["aggregators"], expires_s=600)
        stop = encode(Kind.STOP, Stop(), exp=experiment_id, round=3, sender="server")
        t.publish("server", stop)
        t.publish("server", b"\xc1not msgpack")
        got: list[Delivery] = []

        def handle(d: Delivery) -> None:  # the services' own dead-letter path
            got.append(d)
            t.dead_letter(d, "stale-round" if len(got) == 1 else "malformed", "from the test")

        t.consume(n.server_queue, handle, prefetch=10)

        def two_deliveries() -> bool:
            t.process(0.1)
            return len(got) == 2

        wait_for(two_deliveries, 20, "two deliveries")
    finally:
        t.close()
    assert orphan in broker_objects(broker_url, experiment_id)

    run = _fake_run(tmp_path, "run", "fedavg", [0.5], dead_lettered=2)
    try:
        records = export_dead_letters(broker_url, experiment_id, run)
        by_reason = {r["reason"]: r for r in records}
        assert set(by_reason) == {"stale-round", "malformed"}
        assert by_reason["stale-round"]["kind"] == "stop" and by_reason["stale-round"]["round"] == 3
        assert by_reason["stale-round"]["size"] == len(stop)
        assert by_reason["malformed"]["kind"] is None and by_reason["malformed"]["size"] == 12
        assert all(r["sender"] == t.user and r["detail"] == "from the test" for r in records)
        lines = (run / "dead_letters.jsonl").read_text().splitlines()
        assert len(lines) == 2
        assert queue_depth(broker_url, n.dead_letter_queue) == 2  # exporting did not consume them

        tidy_broker(broker_url, experiment_id, keep_dead_letters=True)
        assert broker_objects(broker_url, experiment_id) == {n.dead_letter_queue}
        assert queue_depth(broker_url, n.dead_letter_queue) == 2

        assert cli("report", str(run)) == 0
        out = capsys.readouterr().out
        assert "stale-round" in out and "malformed" in out and "dead_letters.jsonl" in out
    finally:
        tidy_broker(broker_url, experiment_id)
    assert broker_objects(broker_url, experiment_id) == set()


@pytest.mark.broker
def test_an_empty_dead_letter_queue_does_not_outlive_the_run(
    broker_url: str, experiment_id: str, queue_type: str
) -> None:
    from services.orchestrator import tidy_broker
    from shared.transport.amqp import AmqpTransport

    t = AmqpTransport(broker_url, experiment_id)
    t.declare_queue(t.names.updates_queue, ["update"])
    t.close()
    assert t.names.dead_letter_queue in broker_objects(broker_url, experiment_id)
    tidy_broker(broker_url, experiment_id, keep_dead_letters=True)
    assert broker_objects(broker_url, experiment_id) == set()


# -- the README's sample output is what `make run` prints ----------------------------------------------
SAMPLE_RUN_ID = "qs-amqp"  # the run id the README's sample was made with
#: the documents that show the quickstart's output (between ``quickstart-output`` markers)
SAMPLE_DOCS = ("README.md", "docs/getting-started.md")
ELISION = "  ..."
_CLOCK = re.compile(r"\d+:\d\d:\d\d$")
#: the digits of a loss beyond the second decimal (see ``normalise``)
_LOSS_TAIL = re.compile(r"(\d+\.\d\d)\d\d")


def readme_sample(doc: Path) -> list[str]:
    """The lines between the ``quickstart-output`` markers of ``doc``, without the code fence."""
    text = doc.read_text()
    begin, end = "<!-- quickstart-output:begin -->", "<!-- quickstart-output:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, f"{doc} needs one {begin} ... {end} block"
    block = text.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()
    assert block[0].startswith("```") and block[-1] == "```"
    return block[1:-1]


def _is_round_row(line: str) -> bool:
    cells = line.split("│")
    return len(cells) > 2 and cells[1].strip().isdigit()


def normalise(line: str) -> str:
    """A printed line with what differs between identical runs masked: the clock, each round's
    wall time and the wall seconds. Accuracies and bytes are not masked: a run gives the same ones
    over the broker and in one process, loaded or not. They once differed between hosts (0.9125
    on one, 0.9158 on another): the CPU code path of torch's kernels, now pinned by ``import shared``
    (``shared.NUMERICS_ENV``). A round's loss keeps two decimals: pinned, an AVX-512 host and an
    AVX2 host still gave 0.2791 and 0.2734 for round 20 (same accuracies), and CI runs on either."""
    line = _CLOCK.sub("H:MM:SS", line.rstrip())
    cells = line.split("│")
    if _is_round_row(line):
        cells[-2] = "#" * len(cells[-2])  # round s
        cells[4] = _LOSS_TAIL.sub(r"\1##", cells[4])
    elif len(cells) > 2 and cells[1].strip() == "wall seconds":
        cells[2] = "#" * len(cells[2])
    return "│".join(cells)


def matches_sample(printed: list[str], sample: list[str]) -> list[str]:
    """Differences between what a run printed and the documented sample (empty: in step).

    The sample may leave out consecutive round rows (one ``  ...`` line); every other line must be
    there, in order, and nothing may be missing or added.
    """
    got = [normalise(line) for line in printed if line.strip()]
    want = [normalise(line) for line in sample]
    problems: list[str] = []
    i = 0
    for j, line in enumerate(want):
        if line == ELISION:
            nxt = want[j + 1] if j + 1 < len(want) else None
            while i < len(got) and got[i] != nxt and _is_round_row(got[i]):
                i += 1
            continue
        if i >= len(got):
            problems.append(f"documented but not printed: {line!r}")
        elif got[i] != line:
            problems.append(f"printed {got[i]!r}, documented {line!r}")
        i += 1
    problems += [f"printed but not documented: {extra!r}" for extra in got[i:]]
    return problems


@pytest.mark.parametrize("doc", SAMPLE_DOCS)
def test_the_sample_comparison_catches_a_stale_line(doc: str) -> None:
    """``matches_sample`` can fail: a changed number, a missing or an extra line are reported, an
    elided round range and the masked times are not."""
    sample = readme_sample(ROOT / doc)
    cut = sample.index(ELISION)
    row = sample[cut - 1]  # a round row, standing in for the rounds the sample leaves out
    printed = [*sample[:cut], row, row, *sample[cut + 1 :]]
    assert matches_sample(printed, sample) == []
    final = next(line for line in sample if "final accuracy" in line)
    stale = [line.replace(final, final.replace("0.", "1.", 1)) for line in sample]
    assert stale != sample and matches_sample(printed, stale)
    assert matches_sample(printed[:-1], sample)
    assert matches_sample([*printed, "one more line"], sample)
    assert matches_sample([*printed[:2], *printed[3:]], sample)  # a table line missing
    retimed = [_CLOCK.sub("0:01:07", line) for line in printed]
    assert matches_sample(retimed, sample) == []
    # a round's loss: its third and fourth decimals are the host's (masked), its second is not
    first = next(i for i, line in enumerate(printed) if _is_round_row(line))
    cells = printed[first].split("│")
    loss = cells[4].strip()
    for digits, caught in (
        (f"{loss[:-2]}{(int(loss[-2:]) + 57) % 100:02d}", False),
        (f"{float(loss) + 0.01:.4f}", True),
    ):
        cells[4] = cells[4].replace(loss, digits)
        changed = [*printed[:first], "│".join(cells), *printed[first + 1 :]]
        assert bool(matches_sample(changed, sample)) == caught, digits
        cells[4] = cells[4].replace(digits, loss)


@pytest.mark.broker
@pytest.mark.slow
def test_readme_sample_output_is_what_make_run_prints(broker_url: str) -> None:
    """Run the quickstart as ``make run`` does (``fedfleet run experiments/quickstart.yaml``) over
    the broker and compare what it prints with the README's sample, line by line. The run id has the
    sample's length, so the tables are laid out alike, and is unique, so concurrent runs on a shared
    broker do not meet. Also: the run leaves no queue or exchange behind, writes an (empty)
    ``dead_letters.jsonl``, and what it prints and writes holds repo-relative paths only."""
    import shutil
    import subprocess
    import sys
    import uuid

    run_id = f"qs-{uuid.uuid4().hex[:4]}"
    assert len(run_id) == len(SAMPLE_RUN_ID)
    run_dir = ROOT / "runs" / run_id
    # as a plain pipe shows it: rich's width and colours must not come from the caller's terminal
    layout = ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {k: v for k, v in os.environ.items() if k not in layout}
    env["RABBITMQ_URL"] = broker_url
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "run", "experiments/quickstart.yaml", "--run-id", run_id],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = (proc.stderr + proc.stdout).replace(run_id, SAMPLE_RUN_ID).splitlines()
        for doc in SAMPLE_DOCS:
            problems = matches_sample(printed, readme_sample(ROOT / doc))
            assert not problems, f"{doc}'s sample output is stale:\n" + "\n".join(problems)
        assert str(ROOT) not in proc.stdout + proc.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["dead_lettered"] == 0 and (run_dir / "dead_letters.jsonl").read_text() == ""
        for name in ("summary.json", "ports.json", "config.yaml", "rounds.csv", "devices.csv"):
            assert str(ROOT) not in (run_dir / name).read_text(), name
        assert broker_objects(broker_url, run_id) == set()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.broker
@pytest.mark.slow
def test_a_killed_aggregators_queue_does_not_outlive_the_run(
    cluster: Any, broker_url: str, experiment_id: str, tmp_path: Path
) -> None:
    """An aggregator SIGKILLed mid-run cannot delete its session queue (``ff.<exp>.agg.<id>-<session>``)
    and nobody else knows its name; the run-end clean-up of ``fedfleet run`` still finds and deletes
    it, with everything else, instead of leaving it for the broker's 600 s expiry."""
    from services.orchestrator import _record_dead_letters_and_clean
    from tests.conftest import wait_for

    config = write_config(tmp_path / "c.yaml", rounds=3, round_timeout_s=60)
    c = cluster(config)
    server = c.server()
    victim = c.aggregator("aggregator-0")
    c.aggregator("aggregator-1")
    agg_prefix = f"ff.{experiment_id}.agg."

    def sessions() -> int:
        return sum(name.startswith(agg_prefix) for name in broker_objects(broker_url, experiment_id))

    # No client is up yet, so no round can start: on a quiet machine the three rounds finished (and the
    # aggregators deleted their session queues) before a 0.5 s poll saw both (clean-clone CI at a93bfd1).
    wait_for(lambda: sessions() == 2, 120, "both aggregators' session queues", interval=0.1)
    c.client("client-0", "0-3")
    c.client("client-1", "4-7")
    victim.kill()
    rc = server.wait(300)
    assert rc == 0, server.text()[-3000:]
    c.shutdown(rc)
    assert sessions() == 1, "the killed aggregator's queue is there until the clean-up"
    _record_dead_letters_and_clean(c)
    left = broker_objects(broker_url, experiment_id)
    dlq = f"ff.{experiment_id}.dead"
    assert left <= {dlq}, left
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert (dlq in left) == (summary["dead_lettered"] > 0)
