"""``fedfleet tap`` sees every message of a run over RabbitMQ and takes nothing away from it.

In a scratch vhost: a tap user with only ``shared.provision.tap_permissions`` (its own queue and the
tracer's exchange: no right on any of the experiment's queues or its exchange) runs
``fedfleet tap --json --until-stop`` as its own process while the experiment's services run over
RabbitMQ. Every message the services counted as published (``fedfleet_messages_total``, by kind) is
a line of the tap's output, and the run ends with the same global model as the same run without a
tap (in one process; the contract suite shows that equals the run over RabbitMQ).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from services.orchestrator import InprocCluster
from shared import provision
from shared.config import load_config
from shared.experiment import Experiment
from shared.transport import Transport
from tests.conftest import write_config
from tests.test_security_e2e import _ctl, _need_admin

pytestmark = pytest.mark.broker
ROOT = Path(__file__).resolve().parents[1]


def _published(exp_id: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == "fedfleet_messages_total" and s.labels.get("experiment") == exp_id:
                out[s.labels["kind"]] += int(s.value)
    return out


def _run(cfg: Path, run_dir: Path, exp_id: str, transport: Any = None) -> dict[str, np.ndarray]:
    exp = Experiment.build(load_config(cfg))
    run_dir.mkdir()
    cluster = InprocCluster(exp, run_dir, exp_id, transport=transport, aggregators=1, clients=2)
    try:
        cluster.run(max_steps=200_000)
    finally:
        cluster.close()
    with np.load(run_dir / "global_model.npz") as z:
        return {k: z[k] for k in z.files}


def test_the_tap_sees_every_message_and_takes_nothing(tmp_path: Path) -> None:
    _need_admin()
    from shared.transport.amqp import AmqpTransport

    tag = uuid.uuid4().hex[:8]
    vhost, tap_user, password = f"ff-tap-{tag}", f"fftap-{tag}", uuid.uuid4().hex
    exp_id = f"tap{tag}"
    assert _ctl("add_vhost", vhost).returncode == 0
    try:
        _ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        perm = provision.tap_permissions(exp_id)
        assert _ctl("add_user", tap_user, password).returncode == 0
        _ctl("set_permissions", "-p", vhost, tap_user, perm.configure, perm.write, perm.read)
        _ctl("set_topic_permissions", "-p", vhost, tap_user, provision.TRACE_EXCHANGE, "^$", perm.topic_read)
        url = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
        cfg = write_config(tmp_path / "c.yaml", rounds=3, num_devices=8, devices_per_round=4)
        out = tmp_path / "tap.jsonl"
        with out.open("w") as fh:
            tap = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "tap",
                    exp_id,
                    "--json",
                    "--until-stop",
                    "--seconds",
                    "300",
                ],
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    "PATH": "/usr/bin:/bin",
                    "RABBITMQ_URL": f"amqp://{tap_user}:{password}@127.0.0.1:5672/{vhost}",
                    "FEDFLEET_BROKER_ADMIN_URL": "http://guest:guest@127.0.0.1:15672",
                },
            )
            assert tap.stderr is not None
            first = tap.stderr.readline()
            assert "tapping" in first, first + tap.stderr.read()[-2000:]
            made: list[AmqpTransport] = []

            def amqp(user: str) -> Transport:
                made.append(AmqpTransport(url, exp_id))
                return made[-1]

            tapped_model = _run(cfg, tmp_path / "tapped", exp_id, amqp)
            try:
                tap.wait(60)
            finally:
                if tap.poll() is None:
                    tap.kill()
            err = tap.stderr.read()
        assert tap.returncode == 0, err[-2000:]
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        seen = Counter(line["kind"] for line in lines if not line["entry_of"])
        published = _published(exp_id)
        assert published["updates"] > 0 and published["payload"] > 0
        assert seen == published, (seen, published)
        assert all(line["error"] == "" for line in lines), [x for x in lines if x["error"]][:3]
        # each bundle's entries too: every update of the run (bundled, or alone when a flush held
        # one), with its device and tensors (the layouts were learned)
        updates = [x for x in lines if x["kind"] == "update"]
        rounds = list(csv.DictReader((tmp_path / "tapped" / "rounds.csv").open()))
        assert len(updates) == sum(int(r["participants"]) for r in rounds)
        assert {x["entry_of"] for x in updates} <= {"", "updates"} and any(x["entry_of"] for x in updates)
        assert all(x["device"] is not None and x["tensors"] for x in updates)
        # the tracer is off again: the tap switched it on and was the last to listen
        state = subprocess.run(
            ["curl", "-s", "-u", "guest:guest", f"http://127.0.0.1:15672/api/vhosts/{vhost}"],
            capture_output=True,
            text=True,
        )
        assert json.loads(state.stdout)["tracing"] is False
    finally:
        _ctl("delete_vhost", vhost)
        _ctl("delete_user", tap_user)
    untapped = _run(cfg, tmp_path / "plain", f"plain{tag}")
    assert set(untapped) == set(tapped_model)
    for k in untapped:
        np.testing.assert_allclose(tapped_model[k], untapped[k], atol=1e-6)
