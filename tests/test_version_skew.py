"""Version skew: a client host of the previous build (schema version 6) in a run of this one (7).

The previous build is taken from this repository's own history (:data:`OLD_BUILD`, the last commit
that wrote version 6) with ``git archive`` and run with this venv: it needs the same packages. What
is checked (docs/wire.md, "Versions on the wire"):

* every message a server sends a host, written in version 6 here, is read by the old build's own
  ``decode``, and what the old build writes — with version 6's MAC — is read (and its MACs
  verified) here;
* over RabbitMQ, with real processes: this build's server and aggregator, a client host of this
  build and one of the old build. Every round completes, the old host's devices take part in each
  (their updates merged), the model equals the same experiment's run in one process of this build,
  and nothing is dead-lettered for ``schema`` — except a version 8 message the test sends the
  server, which is dead-lettered with "upgrade this service".

Outside a git checkout (a source tarball) the old build cannot be made: the tests skip, or fail
under ``CI``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pytest

from services.orchestrator import ProcessCluster, run_inproc
from shared import codec, identity, provision
from shared.codec import tensorset
from shared.config import load_config
from shared.schemas import (
    PREVIOUS_VERSION,
    SCHEMA_VERSION,
    DeviceState,
    EvalResult,
    Fetch,
    Go,
    Gos,
    Heartbeat,
    JoinReply,
    Kind,
    Lease,
    Payload,
    Receipt,
    Reject,
    Stop,
    Task,
    Update,
    decode,
    encode,
    task_key,
    transcode,
    verify,
)
from shared.schemas.peers import PeerVersions
from shared.transport import KEY_CLIENTS, KEY_SERVER, key_host, names
from tests.conftest import write_config
from tests.test_security_e2e import ADMIN_API, _need_admin

ROOT = Path(__file__).resolve().parents[1]
#: the last commit whose build writes schema version 6 (the one before version 7: a host's tasks of
#: a round in one ``tasks`` message; docs/wire.md)
OLD_BUILD = "9d59ca9"
LIMIT = 1 << 20
EXP = "skew-unit"


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the previous build cannot be made: {why}")
    pytest.skip(f"the previous build cannot be made: {why}")


def _python(old: Path) -> dict[str, str]:
    """The environment of a process of the old build: its tree alone on the path."""
    return {**os.environ, "PYTHONPATH": str(old)}


@pytest.fixture(scope="module")
def old_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree of :data:`OLD_BUILD`, from this repository's history, checked to import here."""
    git = shutil.which("git")
    if git is None:
        _unavailable("no git")
    assert git is not None
    inside = subprocess.run([git, "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True)
    if inside.returncode != 0:
        _unavailable(f"{ROOT} is not a git checkout")
    tar = subprocess.run([git, "-C", str(ROOT), "archive", "--format=tar", OLD_BUILD], capture_output=True)
    if tar.returncode != 0:
        _unavailable(f"commit {OLD_BUILD} is not in this clone ({tar.stderr.decode()[-200:]})")
    dest = tmp_path_factory.mktemp("old-build")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        archive.extractall(dest, filter="data")
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import services.client.service, shared.schemas as s; print(s.SCHEMA_VERSION)",
        ],
        cwd=dest,
        env=_python(dest),
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, f"the old build does not import with this venv:\n{check.stderr[-2000:]}"
    assert check.stdout.strip() == str(PREVIOUS_VERSION)
    return dest


# -- the old build's own code, in a process of its own ----------------------------------------------
OLD_READ = """
import json, sys
from shared import codec
from shared.schemas import decode

def plain(v):
    if isinstance(v, (bytes, memoryview)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v

out = []
for data in codec.unpackb(open(sys.argv[1], "rb").read(), max_bytes=1 << 24):
    try:
        env, body = decode(data, max_bytes=1 << 20, exp="skew-unit")
        out.append({"kind": env.kind.value, "v": env.v, "exp": env.exp, "inc": env.inc,
                    "round": env.round, "body": plain(body.model_dump())})
    except Exception as err:
        out.append({"error": f"{type(err).__name__}: {err}"})
print(json.dumps(out))
"""

OLD_WRITE = """
import sys
import numpy as np
from shared import codec
from shared.codec import tensorset
from shared.schemas import Fetch, Heartbeat, Kind, Reject, Timings, Update, encode, task_key
key = task_key(sys.argv[2], 2, 5)
layout = tensorset.to_wire({"w": codec.encode(codec.Dense(np.zeros((2, 3), "float32")))})[0]
sliced = codec.Sliced.from_dense(np.arange(6, dtype="float32").reshape(2, 3), [np.array([1]), None])
msgs = [
    encode(Kind.HEARTBEAT, Heartbeat(host_id="old-host", capacity=4, holding=[1, 5], epoch=3),
           exp="skew-unit", round=0, sender="old-host", inc="0a0b0c0d"),
    encode(Kind.FETCH, Fetch(digest=bytes.fromhex(sys.argv[3])), exp="skew-unit", round=2, sender="old-host"),
    encode(Kind.UPDATE, Update(device_id=5, num_samples=10, tensors={"w": codec.encode(codec.Dense(
           __import__("numpy").arange(4, dtype="float32")))}, metrics={"train_loss": 0.25}, task_bytes=99,
           timings=Timings(download_s=1.0, compute_s=2.0, upload_s=0.5)),
           exp="skew-unit", round=2, sender="device-5", inc="0a0b0c0d", key=key),
    encode(Kind.UPDATE, Update(device_id=5, num_samples=10, tensors={"w": codec.encode(sliced)}),
           exp="skew-unit", round=2, sender="", inc="0a0b0c0d", key=key,
           known={tensorset.digest(layout): layout}),
    encode(Kind.REJECT, Reject(device_id=5, reason="memory"), exp="skew-unit", round=2,
           sender="device-5", inc="0a0b0c0d", key=key),
]
open(sys.argv[1], "wb").write(codec.packb(msgs))
"""


def _old(old: Path, script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=old, env=_python(old), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _tensor() -> dict[str, Any]:
    return codec.encode(codec.Dense(np.arange(6, dtype=np.float32).reshape(2, 3)))


def test_what_a_server_sends_a_host_is_read_by_the_previous_build(old_build: Path, tmp_path: Path) -> None:
    """Every kind a host receives, written in version 6 (directly, and rewritten from a version 7
    message as a service does on its way out), decoded by the old build's ``decode``."""
    digest, key = bytes(range(1, 9)), bytes(range(16))
    inc = "0a0b0c0d"
    bodies: list[tuple[Kind, Any]] = [
        (Kind.JOIN_REPLY, JoinReply(host_id="h1", user="u", password="p")),
        (Kind.LEASE, Lease(host_id="h1", epoch=2, devices=[1, 5])),
        (Kind.DEVICE_STATE, DeviceState(device_id=5, files={"state.npz": b"\x00\x01"})),
        (Kind.PAYLOAD, Payload(digest=digest, tensors={"w": _tensor()})),
        (Kind.TASK, Task(device_id=5, payload=digest, payload_bytes=120, config={"lr": 0.1}, key=key)),
        (Kind.EVALUATE, Task(device_id=5, key=key)),
        (Kind.GO, Go(device_id=5, upload=False, reason="surplus")),
        (Kind.GOS, Gos(goes=[Go(device_id=5, upload=True), Go(device_id=7, upload=False, reason="surplus")])),
        (Kind.STOP, Stop()),
    ]
    direct = [encode(k, b, exp=EXP, round=2, sender="", inc=inc, version=PREVIOUS_VERSION) for k, b in bodies]
    current = [encode(k, b, exp=EXP, round=2, sender="", inc=inc) for k, b in bodies]
    assert all(decode(d, max_bytes=LIMIT)[0].v == SCHEMA_VERSION for d in current)
    rewritten = [transcode(d, PREVIOUS_VERSION, exp=EXP) for d in current]
    path = tmp_path / "msgs"
    path.write_bytes(codec.packb(direct + rewritten))
    read = json.loads(_old(old_build, OLD_READ, str(path)))
    assert [r.get("error") for r in read] == [None] * len(read), read
    for got, (kind, body) in zip(read, bodies + bodies, strict=True):
        want_env = (kind.value, PREVIOUS_VERSION, EXP, inc, 2)
        assert (got["kind"], got["v"], got["exp"], got["inc"], got["round"]) == want_env
        want = body.model_dump()
        if kind is Kind.PAYLOAD:
            assert got["body"]["digest"] == digest.hex()
            assert got["body"]["tensors"]["w"]["data"] == bytes(_tensor()["data"]).hex()
        elif kind in (Kind.TASK, Kind.EVALUATE):
            assert got["body"]["key"] == key.hex()
            assert got["body"]["payload"] == (digest.hex() if body.payload else "")
            assert got["body"]["config"] == want["config"]
        elif kind is Kind.DEVICE_STATE:
            assert got["body"]["files"] == {"state.npz": "0001"}
        else:
            assert got["body"] == want


def test_what_the_previous_build_sends_is_read_and_its_macs_hold(old_build: Path, tmp_path: Path) -> None:
    round_key, digest = "ab" * 16, bytes(range(1, 9))
    path = tmp_path / "msgs"
    _old(old_build, OLD_WRITE, str(path), round_key, digest.hex())
    beat, fetch, update, by_reference, reject = codec.unpackb(path.read_bytes(), max_bytes=LIMIT)
    env, hb = decode(beat, max_bytes=LIMIT, exp=EXP)
    assert env.v == PREVIOUS_VERSION
    assert hb == Heartbeat(host_id="old-host", capacity=4, holding=[1, 5], epoch=3)
    env, f = decode(fetch, max_bytes=LIMIT, exp=EXP)
    assert isinstance(f, Fetch) and f.digest == digest
    env, upd = decode(update, max_bytes=LIMIT, exp=EXP)
    assert isinstance(upd, Update) and verify(env, task_key(round_key, 2, 5))
    assert not verify(env, task_key(round_key, 2, 6))
    assert (upd.task_bytes, upd.timings.total(), upd.metrics) == (99, 3.5, {"train_loss": 0.25})
    assert codec.to_array(codec.decode(upd.tensors["w"])).tolist() == [0.0, 1.0, 2.0, 3.0]
    # a slice of the model, its layout named by references into the model's layout
    layout = tensorset.to_wire({"w": codec.encode(codec.Dense(np.zeros((2, 3), np.float32)))})[0]
    env, upd = decode(by_reference, max_bytes=LIMIT, exp=EXP, layouts={tensorset.digest(layout): layout})
    assert isinstance(upd, Update) and verify(env, task_key(round_key, 2, 5))
    sliced = codec.Sliced.from_dense(np.arange(6, dtype=np.float32).reshape(2, 3), [np.array([1]), None])
    assert codec.decode(upd.tensors["w"]) == sliced
    env, rej = decode(reject, max_bytes=LIMIT, exp=EXP)
    assert isinstance(rej, Reject) and verify(env, task_key(round_key, 2, 5))


def test_what_cannot_be_rewritten_is_refused_not_dropped() -> None:
    """Versions this build does not write, and a MAC'd message (only its device can make a MAC),
    are refused; every field of version 7 has its place in version 6."""
    refused = Receipt(
        device_id=1, aggregator_id="a", update_bytes=1, dense_bytes=1, num_samples=1, refused="norm"
    )
    old = encode(Kind.RECEIPT, refused, exp=EXP, round=1, sender="a", version=PREVIOUS_VERSION)
    assert decode(old, max_bytes=LIMIT)[1] == refused
    with pytest.raises(ValueError, match="writes schema versions"):
        encode(Kind.STOP, Stop(), exp=EXP, round=1, sender="s", version=SCHEMA_VERSION + 1)
    with pytest.raises(ValueError, match="writes schema versions"):
        encode(Kind.STOP, Stop(), exp=EXP, round=1, sender="s", version=PREVIOUS_VERSION - 1)
    signed = encode(Kind.EVAL_RESULT, EvalResult(device_id=1), exp=EXP, round=1, sender="", key="cd" * 16)
    with pytest.raises(ValueError, match="MAC"):
        transcode(signed, PREVIOUS_VERSION, exp=EXP)


def test_each_host_is_written_its_own_version_and_broadcasts_the_lowest_live() -> None:
    new, prev = SCHEMA_VERSION, PREVIOUS_VERSION
    now = [1000.0]
    peers = PeerVersions(live_s=30.0, clock=lambda: now[0])
    assert peers.version_for(KEY_CLIENTS) == new  # nobody heard from yet
    peers.learn("new", new)
    peers.learn("old", prev)
    peers.learn("future", new + 1)  # not a version this build reads: never chosen
    peers.learn("ancient", prev - 1)  # nor one it no longer reads
    assert peers.versions() == {key_host("new"): new, key_host("old"): prev}
    assert (peers.version_for(key_host("new")), peers.version_for(key_host("old"))) == (new, prev)
    assert peers.version_for(key_host("unknown")) == new
    assert peers.version_for(KEY_CLIENTS) == prev
    stop = encode(Kind.STOP, Stop(), exp=EXP, round=3, sender="server")
    assert decode(peers.outgoing(KEY_CLIENTS, stop, exp=EXP), max_bytes=LIMIT)[0].v == prev
    assert peers.outgoing(key_host("new"), stop, exp=EXP) is stop
    now[0] += 20
    peers.learn("new", new)
    now[0] += 20  # the old host has been silent for 40 s: gone; the broadcast goes in the new version
    assert peers.version_for(KEY_CLIENTS) == new
    peers.learn("old", new)  # the same host id back with the new image
    assert peers.version_for(key_host("old")) == new


# -- a mixed run over RabbitMQ ----------------------------------------------------------------------
ROUNDS, DEVICES = 3, 8
OLD_DEVICES = range(0, 4)


class _Deployment:
    """The deployment's role users with least privilege in a scratch vhost, as
    ``tests/test_security_e2e.py``'s ``Deployment`` makes them, through the management API (one
    HTTP call each instead of one ``rabbitmqctl`` start each: seconds instead of tens of seconds)."""

    def __init__(self, experiment: str) -> None:
        tag = uuid.uuid4().hex[:8]
        self.prefix, self.vhost, self.password = f"ffskew{tag}-", f"ff-skew-{tag}", uuid.uuid4().hex
        identity.configure(self.prefix)
        self.users = [identity.server_user(), identity.aggregator_user(), identity.join_user()]
        v = urllib.parse.quote(self.vhost, safe="")
        self._api("PUT", f"/api/vhosts/{v}", {})
        every = {"configure": ".*", "write": ".*", "read": ".*"}
        self._api("PUT", f"/api/permissions/{v}/guest", every)  # the admin that makes host users
        for user, perm in provision.role_permissions(experiment).items():
            self._api("PUT", f"/api/users/{user}", {"password": self.password, "tags": ""})
            rights = {"configure": perm.configure, "write": perm.write, "read": perm.read}
            self._api("PUT", f"/api/permissions/{v}/{user}", rights)
            topic = {"exchange": f"ff.{experiment}", "write": perm.topic_write, "read": perm.topic_read}
            self._api("PUT", f"/api/topic-permissions/{v}/{user}", topic)

    @staticmethod
    def _api(method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request("http://127.0.0.1:15672" + path, data=data, method=method)
        req.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest, as ADMIN_API
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def url(self, user: str, password: str | None = None) -> str:
        return f"amqp://{user}:{password or self.password}@127.0.0.1:5672/{self.vhost}"

    def guest_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:5672/{self.vhost}"

    def close(self) -> None:
        """The vhost (and so every queue of the run) and every user of the run, host users too."""
        self._api("DELETE", f"/api/vhosts/{urllib.parse.quote(self.vhost, safe='')}")
        for user in self._api("GET", "/api/users"):
            if user["name"].startswith(self.prefix):
                self._api("DELETE", f"/api/users/{urllib.parse.quote(user['name'], safe='')}")
        identity.configure(identity.DEFAULT_PREFIX)


@pytest.fixture
def deployment(experiment_id: str) -> Iterator[_Deployment]:
    _need_admin()
    dep = _Deployment(experiment_id)
    try:
        yield dep
    finally:
        dep.close()


def _dead_letters(url: str, experiment: str) -> list[dict[str, Any]]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        out: list[dict[str, Any]] = []
        while True:
            method, props, body = ch.basic_get(names(experiment).dead_letter_queue, auto_ack=True)
            if method is None:
                return out
            headers = props.headers or {}
            out.append(
                {
                    "reason": headers.get("x-fedfleet-reason"),
                    "detail": headers.get("x-fedfleet-detail", ""),
                    "user": headers.get("x-fedfleet-user", ""),
                    "size": len(body),
                }
            )
    finally:
        conn.close()


@pytest.mark.broker
@pytest.mark.slow
def test_a_client_host_of_the_previous_build_finishes_a_run_of_this_one(
    old_build: Path, deployment: _Deployment, experiment_id: str, tmp_path: Path
) -> None:
    """As deployed: least-privilege role users in a scratch vhost, every client host joining with
    the join user for a broker user of its own (so the server learns a host's version from what the
    broker says its user sent, and answers the join in the joiner's version)."""
    dep = deployment
    config = write_config(
        tmp_path / "c.yaml",
        rounds=ROUNDS,
        num_devices=DEVICES,
        devices_per_round=DEVICES,  # every device every round: the old host's take part in each
        processes={"aggregators": 1, "clients": 2, "prefetch": 8},
    )
    env = dict(os.environ, FEDFLEET_USER_PREFIX=dep.prefix, FEDFLEET_BROKER_ADMIN_URL=ADMIN_API)
    cluster = ProcessCluster(
        dep.url(identity.server_user()), experiment_id, config, tmp_path / "run", logs=tmp_path, env=env
    )
    old_log = tmp_path / "old-client.log"
    old: subprocess.Popen[bytes] | None = None
    try:
        server = cluster.server()
        cluster.env["RABBITMQ_URL"] = dep.url(identity.aggregator_user())
        cluster.aggregator("aggregator-0")
        cluster.env["RABBITMQ_URL"] = dep.url(identity.join_user())
        cluster.client("new-client", devices=f"{len(OLD_DEVICES)}-{DEVICES - 1}")
        with old_log.open("wb") as log:
            old = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "client",
                    "--devices",
                    f"{OLD_DEVICES.start}-{OLD_DEVICES.stop - 1}",
                    "--state-dir",
                    str(tmp_path / "state" / "old-client"),
                    "--config",
                    str(config),
                    "--experiment",
                    experiment_id,
                    "--metrics-port",
                    "0",
                ],
                cwd=old_build,
                env={**env, **_python(old_build), "RABBITMQ_URL": dep.url(identity.join_user())},
                stdout=log,
                stderr=log,
            )
        # a message of a newer build than this one: dead-lettered, saying what to do
        newer = codec.packb([SCHEMA_VERSION + 1, 0, 0, b"", 0, "probe", codec.packb([])])
        _publish_when_bound(dep.guest_url(), experiment_id, KEY_SERVER, newer)
        try:
            rc = server.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not finish:\n" + server.text()[-3000:]) from None
        assert rc == 0, server.text()[-3000:]
        assert old.wait(30) == 0, old_log.read_text()[-3000:]

        with (cluster.run_dir / "rounds.csv").open() as f:
            rounds = list(csv.DictReader(f))
        assert [r["outcome"] for r in rounds] == ["completed"] * ROUNDS
        with (cluster.run_dir / "devices.csv").open() as f:
            completed = {int(r["device_id"]): int(r["completed"]) for r in csv.DictReader(f)}
        # every device of the old host had its update merged in every round
        assert {d: completed[d] for d in OLD_DEVICES} == {d: ROUNDS for d in OLD_DEVICES}, completed
        text = old_log.read_text()
        assert '"lease_applied"' in text and "dead_letter" not in text, text[-3000:]

        # and the old host trained as this build would have: the model of the run in one process
        reference = tmp_path / "reference"
        reference.mkdir()
        assert run_inproc(load_config(config), reference, f"ref-{experiment_id}", show_progress=False) == 0
        with np.load(cluster.run_dir / "global_model.npz") as a, np.load(reference / "global_model.npz") as b:
            assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files) <= 1e-6

        letters = _dead_letters(dep.guest_url(), experiment_id)
        schema = [x for x in letters if x["reason"] == "schema"]
        assert len(schema) == 1 and "upgrade this service" in schema[0]["detail"], letters
        assert letters == schema, letters  # nothing else, from the old host or anyone
    finally:
        if old is not None and old.poll() is None:
            old.kill()
            old.wait()
        cluster.stop_all()


def _publish_when_bound(url: str, experiment: str, key: str, data: bytes) -> None:
    """Publish ``data`` once the server's queue is bound for ``key`` (mandatory: retried while
    nobody is)."""
    import logging
    import time

    logging.getLogger("pika").setLevel(logging.CRITICAL)  # "no exchange yet" is expected, retried
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        deadline = time.monotonic() + 60
        while True:
            try:
                ch.basic_publish(names(experiment).exchange, key, data, mandatory=True)
                return
            except (pika.exceptions.UnroutableError, pika.exceptions.ChannelClosedByBroker):
                if time.monotonic() > deadline:
                    raise
                if ch.is_closed:
                    ch = conn.channel()
                    ch.confirm_delivery()
                time.sleep(0.2)
    finally:
        conn.close()
