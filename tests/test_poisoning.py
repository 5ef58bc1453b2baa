"""Poisoned and out-of-bounds updates, sent by devices with everything a client process has.

The attackers are real devices of a real run: their updates carry their own task's MAC and come
from the host that holds their lease, so authentication lets them through — what stops them is the
aggregators' bounds and the server's robust aggregation. The attack itself is a hook of these tests
(``benchmarks/poisoning.install_attack`` and :func:`_out_of_bounds` wrap the strategy's ``train``
in this process), never a config option.

* 10% of the devices sign-flip or scale their updates (FedAvg on digits): without a defence the
  final accuracy falls far below the clean run's; with the coordinate-wise median or the trimmed
  mean it stays within 3 points of it.
* Updates with NaN, with values of 1e30 (above ``bounds.max_update_norm``) or claiming 10¹² samples
  are dead-lettered with their reason and counted, the round does not wait for them, and the run
  ends with the model of the run in which those updates were simply refused.
* The same over RabbitMQ with the deployment's per-role and per-host broker users.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pytest
from prometheus_client import REGISTRY

from services.orchestrator import InprocCluster
from shared import codec, identity, provision
from shared.algorithms.base import DeviceContext, TaskSpec, UpdateSpec
from shared.config import load_config
from shared.experiment import Experiment
from shared.transport.amqp import AmqpTransport
from tests.conftest import read_rounds, write_config

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("poisoning_bench", ROOT / "benchmarks" / "poisoning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("poisoning_bench", module)
    spec.loader.exec_module(module)
    return module


bench = _bench()


@pytest.fixture(scope="module")
def clean_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    return float(bench.run(None, "none (mean)", tmp_path_factory.mktemp("clean") / "run"))


@pytest.mark.parametrize("attack", ["sign-flip", "scale"])
def test_ten_percent_poisoners_ruin_the_mean_but_not_the_median_or_trimmed_mean(
    tmp_path: Path, clean_accuracy: float, attack: str
) -> None:
    assert bench.attackers(20) == {0, 10}  # 10% of quickstart's 20 devices
    assert clean_accuracy > 0.85  # the clean run learns (digits, 20 rounds)
    undefended = bench.run(attack, "none (mean)", tmp_path / "mean")
    assert undefended < clean_accuracy - 0.03, (undefended, clean_accuracy)
    for defence in ("median", "trimmed mean (β = 0.2)"):
        defended = bench.run(attack, defence, tmp_path / bench.slug(defence))
        assert defended >= clean_accuracy - 0.03, (defence, defended, clean_accuracy)


# -- out-of-bounds updates ------------------------------------------------------------------------------
def _out_of_bounds(exp: Experiment, attacks: dict[int, str]) -> None:
    """Make devices send non-finite (``nan``), huge (``huge``: ×1e30) or over-counted (``samples``)
    updates — with their own MAC, from their own host: what a compromised device can do."""
    honest = exp.strategy.train

    def train(task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        update = honest(task, device)
        attack = attacks.get(device.device_id)
        if attack == "samples":
            update.num_samples = 10**12
        elif attack in ("nan", "huge"):
            tensors = dict(update.tensors)
            name = sorted(tensors)[0]
            values = codec.to_array(tensors[name]).copy()
            if attack == "nan":
                values.flat[0] = np.nan
            else:
                with np.errstate(over="ignore"):  # a model already blown up may overflow to inf
                    values *= 1e30
            tensors[name] = codec.Dense(values)
            update.tensors = tensors
        return update

    exp.strategy.train = train  # type: ignore[method-assign]


BOUNDS_CONFIG: dict[str, Any] = {
    "rounds": 3,
    "devices_per_round": 8,  # every device every round: each attack happens in each round
    "bounds": {"max_update_norm": 1e6},
}
ATTACKS = {1: "nan", 2: "huge", 5: "samples"}


def _counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _run(config: Path, run: Path, experiment: str, attacks: dict[int, str], **kw: Any) -> InprocCluster:
    exp = Experiment.build(load_config(config))
    _out_of_bounds(exp, attacks)
    run.mkdir(parents=True, exist_ok=True)
    cluster = InprocCluster(exp, run, experiment, state_dir=run / "state", **kw)
    try:
        assert cluster.run(max_steps=500_000) == 0
    finally:
        cluster.close()
    return cluster


def _model(run: Path) -> dict[str, np.ndarray]:
    with np.load(run / "global_model.npz") as z:
        return {k: z[k] for k in z.files}


def _assert_same_model(a: Path, b: Path) -> None:
    ma, mb = _model(a), _model(b)
    worst = max(float(np.max(np.abs(ma[k] - mb[k]))) for k in ma)
    assert worst <= 1e-6, worst


def _check_refused(run: Path, experiment: str) -> None:
    """Every attack was refused in every round: counted, not merged, not waited for."""
    rows = read_rounds(run)
    assert [r["outcome"] for r in rows] == ["completed"] * 3
    assert all(int(r["participants"]) == 5 and int(r["rejected"]) == 3 for r in rows), rows
    for reason in ("nonfinite", "update-norm", "num-samples"):
        labels = {"experiment": experiment, "algorithm": "fedavg", "outcome": reason}
        assert _counter("fedfleet_update_bounds_total", **labels) == 3, reason
        dead = {"experiment": experiment, "service": "aggregator", "reason": reason}
        assert _counter("fedfleet_dead_letters_total", **dead) == 3, reason
    model = _model(run)
    assert all(np.isfinite(v).all() for v in model.values())


def test_out_of_bounds_updates_are_dead_lettered_counted_and_change_nothing_else(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", **BOUNDS_CONFIG)
    exp_id = f"oob{uuid.uuid4().hex[:6]}"
    _run(config, tmp_path / "attacked", exp_id, ATTACKS)
    _check_refused(tmp_path / "attacked", exp_id)
    # the reference: the same devices' updates refused for one plain reason (NaN) — the three
    # attacks are three ways of being refused, and none leaves a trace in the model
    _run(config, tmp_path / "reference", f"ref{uuid.uuid4().hex[:6]}", dict.fromkeys(ATTACKS, "nan"))
    _assert_same_model(tmp_path / "attacked", tmp_path / "reference")
    # without a norm bound, one update of 1e30s reaches the model (what the bound is for)
    loose = write_config(tmp_path / "loose.yaml", **{**BOUNDS_CONFIG, "bounds": {}})
    _run(loose, tmp_path / "loose", f"loose{uuid.uuid4().hex[:6]}", {2: "huge"})
    model = _model(tmp_path / "loose")
    assert max(float(np.max(np.abs(v))) for v in model.values()) > 1e20


def test_a_clip_bound_scales_a_huge_update_down_instead_of_refusing_it(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "c.yaml",
        **{**BOUNDS_CONFIG, "bounds": {"max_update_norm": 1e3, "on_norm_exceeded": "clip"}},
    )
    exp_id = f"clip{uuid.uuid4().hex[:6]}"
    _run(config, tmp_path / "run", exp_id, {2: "huge"})
    rows = read_rounds(tmp_path / "run")
    assert all(int(r["participants"]) == 8 and int(r["rejected"]) == 0 for r in rows), rows
    clipped = {"experiment": exp_id, "algorithm": "fedavg", "outcome": "clipped"}
    assert _counter("fedfleet_update_bounds_total", **clipped) == 3
    assert all(np.isfinite(v).all() for v in _model(tmp_path / "run").values())


# -- the same over RabbitMQ, with the deployment's users -----------------------------------------------
def _broker_deployment(experiment: str, hosts: list[str]) -> tuple[Callable[[str], str], Callable[[], None]]:
    """Role users and per-host users with least privilege in a scratch vhost (what ``make up`` and
    the server's provisioning give them); returns (url of a user, clean-up)."""
    from tests.test_security_e2e import Deployment, _ctl, _need_admin

    _need_admin()
    dep = Deployment(experiment)
    exchange = f"ff.{experiment}"
    for host in hosts:
        user, perm = identity.host_user(host), provision.host_permissions(experiment, host)
        assert _ctl("add_user", user, dep.password).returncode == 0
        dep.users.append(user)
        _ctl("set_permissions", "-p", dep.vhost, user, perm.configure, perm.write, perm.read)
        _ctl("set_topic_permissions", "-p", dep.vhost, user, exchange, perm.topic_write, perm.topic_read)
    return dep.url, dep.close


def _amqp(url: Callable[[str], str], experiment: str) -> Callable[[str], AmqpTransport]:
    def make(user: str) -> AmqpTransport:
        owner = identity.identify(user).role is identity.Role.SERVER
        return AmqpTransport(url(user), experiment, declare_topology=owner)

    return make


def _dead_letters(url: str, queue: str) -> list[str]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    reasons: list[str] = []
    try:
        ch = conn.channel()
        while True:
            method, props, _ = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return reasons
            reasons.append(props.headers["x-fedfleet-reason"])
    finally:
        conn.close()


@pytest.mark.broker
@pytest.mark.slow
def test_over_rabbitmq_with_per_role_users_bounds_and_median_hold(tmp_path: Path) -> None:
    """Out-of-bounds updates and a sign-flipping device over a real broker, every service logged in
    as its own least-privilege user: the dead letters carry their reasons, the median keeps the
    model, and the run ends with the model of the same run in one process."""
    experiment = f"pois{uuid.uuid4().hex[:8]}"
    hosts = ["client-0", "client-1"]
    url, close = _broker_deployment(experiment, hosts)
    try:
        config = write_config(tmp_path / "c.yaml", **BOUNDS_CONFIG, robust={"aggregation": "median"})
        exp = Experiment.build(load_config(config))
        _out_of_bounds(exp, ATTACKS)
        bench.install_attack(exp, [0], "sign-flip")
        run = tmp_path / "amqp"
        run.mkdir()
        cluster = InprocCluster(
            exp, run, experiment, transport=_amqp(url, experiment), state_dir=run / "state"
        )
        assert all(svc.strict for svc in cluster.services)  # no dev mode: roles and leases checked
        try:
            assert cluster.run(max_steps=5_000_000) == 0
        finally:
            cluster.close()
        _check_refused(run, experiment)
        # the median ran at the server over the five updates left in each of the three rounds
        used = {"experiment": experiment, "algorithm": "fedavg", "outcome": "used"}
        assert _counter("fedfleet_robust_updates_total", **used) == 15
        reasons = _dead_letters(url(identity.server_user()), cluster.server.transport.names.dead_letter_queue)
        assert sorted(reasons) == sorted(["nonfinite", "update-norm", "num-samples"] * 3), reasons
        # the same attacks in one process (placement never changes results; the median is exact)
        ref = Experiment.build(load_config(config))
        _out_of_bounds(ref, ATTACKS)
        bench.install_attack(ref, [0], "sign-flip")
        (tmp_path / "inproc").mkdir()
        reference = InprocCluster(ref, tmp_path / "inproc", f"ref{experiment}", state_dir=tmp_path / "s")
        assert reference.run(max_steps=500_000) == 0
        reference.close()
        _assert_same_model(run, tmp_path / "inproc")
        accuracy = float(read_rounds(run)[-1]["accuracy"])
        assert math.isfinite(accuracy) and accuracy > 0.5
    finally:
        close()
