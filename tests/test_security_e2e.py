"""The message plane trusts no one: attacks made with exactly what a client process has.

A real run over the local RabbitMQ, in a scratch vhost, with the deployment's least-privilege users:
the server, the aggregator and the join user get the permissions ``shared.provision.role_permissions``
gives them (what the Kubernetes definitions hold); every client process starts as the join user and
gets a broker user of its own from the server (RabbitMQ's management API), with
``shared.provision.host_permissions``. One of the hosts is the attacker: a real client that serves
its devices honestly, and in round 2 tries everything a client host can try:

* send the server a partial aggregate, or receipts claiming other devices' updates arrived (only
  aggregators may send either) — dead-lettered ``wrong-sender``;
* read the round key meant for aggregators (bind its queue to ``aggregators``) — the broker refuses;
* read other devices' updates (consume the updates queue, bind ``update``) — the broker refuses;
* send an update for another host's device, and an altered copy of one of its own — ``forged``;
* a refusal in another device's name — ``forged``;
* the same inside an ``answers`` (to the server) or an ``updates`` (to the aggregators), with a
  partial and a nested ``updates`` among the entries — each entry refused alone, as itself;
* forge ``round_open`` / ``stop`` to aggregators and clients (publish with their keys) — the broker
  refuses;
* delete or purge another host's queue, the dead-letter queue, the exchange — the broker refuses.

The run finishes with the same global model as the same experiment run in one process without any
attacker (placement never changes results), and every refusal the services made is a dead letter
with its reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pika.exceptions
import pytest

from services.client.service import Client
from services.orchestrator import ProcessCluster, run_inproc
from shared import codec, identity, provision
from shared.config import load_config
from shared.experiment import Experiment
from shared.schemas import Answers, Kind, Partial, Receipt, Receipts, Reject, Stop, Update, Updates, encode
from shared.transport import KEY_AGGREGATORS, KEY_CLIENTS, KEY_SERVER, KEY_UPDATE
from shared.transport.amqp import AmqpTransport
from tests.conftest import read_rounds, wait_for, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ADMIN_API = "http://guest:guest@127.0.0.1:15672"
RUN_TIMEOUT = 240.0


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)


def _need_admin() -> None:
    """A local broker administrable with rabbitmqctl and its management API (make setup enables it)."""
    why = ""
    if shutil.which("rabbitmqctl") is None or _ctl("status").returncode != 0:
        why = "no local RabbitMQ administrable with rabbitmqctl"
    else:
        try:
            urllib.request.urlopen("http://127.0.0.1:15672/api/overview", timeout=5)
        except urllib.error.HTTPError:
            pass  # 401 without credentials: the API answers
        except OSError:
            why = "RabbitMQ's management API (rabbitmq_management) does not answer on 127.0.0.1:15672"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why + " (CI is set: this test must run)")
        pytest.skip(why)


class Deployment:
    """Role users with least privilege in a scratch vhost; what ``make up`` sets up on a cluster."""

    def __init__(self, experiment: str) -> None:
        tag = uuid.uuid4().hex[:8]
        self.prefix = f"ffsec{tag}-"
        self.vhost = f"ff-sec-{tag}"
        self.experiment = experiment
        self.password = uuid.uuid4().hex
        identity.configure(self.prefix)
        self.users = [identity.server_user(), identity.aggregator_user(), identity.join_user()]
        assert _ctl("add_vhost", self.vhost).returncode == 0
        # the admin the server makes host users with must see the scratch vhost
        assert _ctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*").returncode == 0
        for user, perm in provision.role_permissions(experiment).items():
            assert _ctl("add_user", user, self.password).returncode == 0
            for args in (
                ("set_permissions", "-p", self.vhost, user, perm.configure, perm.write, perm.read),
                (
                    "set_topic_permissions",
                    "-p",
                    self.vhost,
                    user,
                    f"ff.{experiment}",
                    perm.topic_write,
                    perm.topic_read,
                ),
            ):
                done = _ctl(*args)
                assert done.returncode == 0, f"rabbitmqctl {args[0]} {user}: {done.stderr.strip()}"

    def url(self, user: str, password: str | None = None) -> str:
        return f"amqp://{user}:{password or self.password}@127.0.0.1:5672/{self.vhost}"

    def guest_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:5672/{self.vhost}"

    def close(self) -> None:
        _ctl("delete_vhost", self.vhost)
        for user in self.users:
            _ctl("delete_user", user)
        for line in _ctl("list_users").stdout.splitlines():  # any host user the run left behind
            name = line.split("\t")[0]
            if name.startswith(self.prefix):
                _ctl("delete_user", name)
        identity.configure(identity.DEFAULT_PREFIX)


def _refused(url: str, action: Any) -> bool:
    """Whether the broker refuses ``action(channel)`` (403) for the user of ``url``."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        action(ch)
        conn.process_data_events(0.3)  # a refused publish closes the channel asynchronously
        return not ch.is_open
    except pika.exceptions.ChannelClosedByBroker as err:
        return err.reply_code == 403
    finally:
        if conn.is_open:
            conn.close()


class Attacker(Client):
    """A real host that serves its devices honestly and, in its first task from round 2 on (when the
    honest hosts hold devices too), tries every attack above."""

    attacks: dict[str, bool]
    host_url: str
    #: the entries of the ``answers`` it sends (each must be dead-lettered alone, as itself)
    smuggled: list[bytes]
    #: the entries of the ``updates`` it sends the aggregators (likewise)
    smuggled_updates: list[bytes]

    def on_task(self, env: Any, msg: Any, d: Any) -> None:
        others_exist = any(d not in self.data for d in range(self.exp.cfg.num_devices))
        if env.round >= 2 and others_exist and not getattr(self, "attacks", None):
            self.attacks = self._attack(env, msg)
        super().on_task(env, msg, d)

    def _attack(self, env: Any, msg: Any) -> dict[str, bool]:
        n = self.transport.names
        exp, inc, rnd = self.experiment, env.inc, env.round

        def message(kind: Kind, body: Any, key: bytes = b"") -> bytes:
            return encode(kind, body, exp=exp, round=rnd, sender="device", inc=inc, key=key.hex())

        weights = Experiment.build(self.exp.cfg).strategy.init_state().arrays
        dense = {k: codec.encode(codec.Dense(v)) for k, v in weights.items() if v.dtype.kind == "f"}
        others = [d for d in range(self.exp.cfg.num_devices) if d not in self.data]
        done: dict[str, bool] = {}
        # 1. a partial aggregate, which only aggregators may send
        partial = Partial(aggregator_id="evil", seq=1, devices=[msg.device_id], tensors=dense)
        self.transport.publish(KEY_SERVER, message(Kind.PARTIAL, partial))
        receipt = Receipt(
            device_id=others[0], aggregator_id="evil", update_bytes=1, dense_bytes=1, num_samples=10
        )
        self.transport.publish(KEY_SERVER, message(Kind.RECEIPTS, Receipts(receipts=[receipt])))
        # 3. an update for another host's device (MAC'd with this device's key), an altered copy of
        #    one of its own, and a refusal in another device's name
        other = Update(device_id=others[0], num_samples=10, tensors=dense)
        self.transport.publish(KEY_UPDATE, message(Kind.UPDATE, other, msg.key))
        self.transport.publish(
            KEY_UPDATE, _altered(message(Kind.UPDATE, _own(msg.device_id, dense), msg.key))
        )
        refusal = Reject(device_id=others[0], reason="memory")
        self.transport.publish(KEY_SERVER, message(Kind.REJECT, refusal, msg.key))
        # 7. the same inside an ``answers``, where each entry gets a lone message's checks: a partial
        #    (not a device's answer, whoever sends it) and a refusal in another device's name
        other_refusal = Reject(device_id=others[0], reason="dropout")
        self.smuggled = [message(Kind.PARTIAL, partial), message(Kind.REJECT, other_refusal, msg.key)]
        self.transport.publish(KEY_SERVER, message(Kind.ANSWERS, Answers(messages=self.smuggled)))
        # 8. the same inside an ``updates`` to the aggregators, where each entry gets a lone
        #    update's checks: an update for another host's device (MAC'd with this device's key),
        #    a partial, and an ``updates`` inside the ``updates``
        others_update = Update(device_id=others[0], num_samples=9, tensors=dense)
        nested = message(Kind.UPDATES, Updates(messages=[message(Kind.UPDATE, others_update, msg.key)]))
        self.smuggled_updates = [
            message(Kind.UPDATE, others_update, msg.key),
            message(Kind.PARTIAL, partial),
            nested,
        ]
        bundle = message(Kind.UPDATES, Updates(messages=self.smuggled_updates))
        self.transport.publish(KEY_UPDATE, bundle, transient=True)
        # 2./4./6. what the broker must refuse this host's own user
        url, q = self.host_url, self.queue
        stop = message(Kind.STOP, Stop())
        done["bind-aggregators"] = _refused(url, lambda ch: ch.queue_bind(q, n.exchange, KEY_AGGREGATORS))
        done["bind-update"] = _refused(url, lambda ch: ch.queue_bind(q, n.exchange, KEY_UPDATE))
        done["consume-updates"] = _refused(url, lambda ch: ch.basic_consume(n.updates_queue, _ignore))
        done["publish-aggregators"] = _refused(
            url, lambda ch: ch.basic_publish(n.exchange, KEY_AGGREGATORS, stop)
        )
        done["publish-clients"] = _refused(url, lambda ch: ch.basic_publish(n.exchange, KEY_CLIENTS, stop))
        done["delete-dead-letters"] = _refused(url, lambda ch: ch.queue_delete(n.dead_letter_queue))
        done["purge-updates"] = _refused(url, lambda ch: ch.queue_purge(n.updates_queue))
        done["delete-exchange"] = _refused(url, lambda ch: ch.exchange_delete(n.exchange))
        other_queue = n.client_queue("another-host")
        done["declare-others-queue"] = _refused(url, lambda ch: ch.queue_declare(other_queue, durable=True))
        return done


def _host_users(prefix: str) -> list[str]:
    return [line for line in _ctl("list_users").stdout.splitlines() if line.startswith(f"{prefix}host-h")]


def _ignore(*_: Any) -> None:
    pass


def _own(device: int, dense: dict[str, Any]) -> Update:
    return Update(device_id=device, num_samples=10, tensors=dense)


def _altered(data: bytes) -> bytes:
    """The same message with one byte of one weight changed, its MAC kept: well-formed, not genuine.

    Envelope (versions 5 and 6): ``[v, kind, exp tag, inc, round, sender, body, mac, ...]``; the
    body is its fields followed by the tensor set's blob, raw."""
    env = codec.unpackb(data, max_bytes=len(data) + 1)
    fields, blob = codec.unpackb_head(env[6], max_bytes=len(data) + 1)
    raw = bytearray(blob)
    raw[0] ^= 0x40
    env[6] = codec.packb(fields) + bytes(raw)
    return codec.packb(env)


def test_every_attack_a_client_host_can_make_is_refused(tmp_path: Path) -> None:
    _need_admin()
    experiment = f"sec{uuid.uuid4().hex[:8]}"
    dep = Deployment(experiment)
    try:
        # both honest hosts must serve before round 1: one slow to start would find every device
        # leased to the other and the short run over before the attacker could join
        config = write_config(
            tmp_path / "c.yaml",
            rounds=4,
            devices_per_round=8,
            round_timeout_s=120,
            registration_timeout_s=300,
            hosts={"min_hosts": 2},
        )
        cluster = ProcessCluster(
            dep.url(identity.server_user()),
            experiment,
            config,
            tmp_path / "run",
            env=dict(os.environ, FEDFLEET_USER_PREFIX=dep.prefix, FEDFLEET_BROKER_ADMIN_URL=ADMIN_API),
            # new interpreters: the attacker below must join while the run goes on, and hosts forked
            # from the fork server start so fast that the 4 rounds were over before it had joined
            fork_server=False,
        )
        server = cluster.server()
        cluster.env["RABBITMQ_URL"] = dep.url(identity.aggregator_user())
        cluster.aggregator("agg-0")
        cluster.env["RABBITMQ_URL"] = dep.url(identity.join_user())
        honest = [cluster.client("c0"), cluster.client("c1")]
        # the attacker joins like any host once the honest ones serve devices (it starts in this
        # process, far faster than they do, and would otherwise be leased every device), then runs
        # as a client of its own user
        serving = '"lease_applied"'

        def honest_serving() -> bool:
            for c in honest:  # a host that died will never serve: say so now, with its log
                assert c.alive(), f"host {c.name} exited {c.returncode}:\n{c.text()[-3000:]}"
            return all(serving in c.text() for c in honest)

        try:
            wait_for(honest_serving, 300, "the honest hosts to serve devices")
        except AssertionError as err:  # twice seen in full-suite runs only: keep what the services said
            logs = "\n".join(f"--- {p.name}:\n{p.text()[-2500:]}" for p in [server, *honest])
            raise AssertionError(f"{err}\n{logs}") from None
        reply = provision.join(dep.url(identity.join_user()), experiment, hint="attacker")
        host_url = dep.url(reply.user, reply.password)
        attacker = Attacker(
            AmqpTransport(host_url, experiment, declare_topology=False),
            Experiment.build(load_config(config)),
            experiment_id=experiment,
            client_id=reply.host_id,
            state_dir=tmp_path / "attacker",
        )
        attacker.host_url = host_url
        thread = threading.Thread(target=attacker.run, daemon=True)
        thread.start()
        try:
            rc = server.p.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not finish:\n" + server.text()[-3000:]) from None
        assert rc == 0, server.text()[-3000:]
        thread.join(30)
        cluster.stop_all()

        attacks = getattr(attacker, "attacks", None)
        assert attacks, "the attacker never got a task from round 2 on while others held devices"
        assert all(attacks.values()), attacks  # everything the broker must refuse, it refused
        # what the services refused went to the dead-letter queue, each with its reason
        conn = pika.BlockingConnection(pika.URLParameters(dep.url(identity.server_user())))
        ch = conn.channel()
        reasons, letters = [], []
        while True:
            method, props, body = ch.basic_get(attacker.transport.names.dead_letter_queue, auto_ack=True)
            if method is None:
                break
            reasons.append(props.headers["x-fedfleet-reason"])
            letters.append((props.headers["x-fedfleet-reason"], body))
        conn.close()
        assert reasons.count("wrong-sender") >= 2, reasons  # the partial, the receipts
        assert reasons.count("forged") >= 3, reasons  # other's update, altered copy, other's refusal
        # inside the ``answers``: each entry refused alone, as the lone message it is
        partial_entry, refusal_entry = attacker.smuggled
        assert ("unexpected-kind", partial_entry) in letters and ("forged", refusal_entry) in letters
        # inside the ``updates``: likewise, at the aggregator (the other device's update is
        # ``unknown-device`` if it was not selected this round, else ``forged``)
        others_entry, partial_entry, nested = attacker.smuggled_updates
        assert {r for r, body in letters if body == others_entry} <= {"forged", "unknown-device"}
        assert [body for _, body in letters].count(others_entry) == 1
        assert letters.count(("unexpected-kind", partial_entry)) == 2  # in the answers and here
        assert ("unexpected-kind", nested) in letters
        # no attack changed anything: the model of the same run without an attacker
        assert [r["outcome"] for r in read_rounds(cluster.run_dir)] == ["completed"] * 4
        reference = tmp_path / "reference"
        reference.mkdir()
        assert run_inproc(load_config(config), reference, f"ref-{experiment}", show_progress=False) == 0
        with np.load(cluster.run_dir / "global_model.npz") as a, np.load(reference / "global_model.npz") as b:
            worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
        assert worst <= 1e-6, worst
        # no credential ever reached a log
        for log in cluster.logs.glob("*.log"):
            assert reply.password not in log.read_text(), log
        # every host user the run made is gone with it
        wait_for(lambda: not _host_users(dep.prefix), 30, "the run's host users to be deleted")
    finally:
        dep.close()
