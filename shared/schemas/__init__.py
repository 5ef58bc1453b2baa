"""The wire contract: every message fedfleet sends, as pydantic models inside one envelope.

Why an envelope: every message must say which experiment, round and server incarnation it belongs to
and who sent it, so that a stale, duplicated or misrouted message can be recognised and dead-lettered
without looking at its payload. Why pydantic: the schema *is* the validation — a message that does not
fit its model never reaches an algorithm.

Tensors inside bodies are codec dicts (``shared.codec.encode``); the schema checks their outer
structure and the codec checks their buffers (sizes, dtypes, limits) when an algorithm decodes them.
Bytes on the wire are msgpack; there is no pickle anywhere and nothing executes on decode.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import uuid
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from shared import codec

#: Bump when a message changes incompatibly; receivers dead-letter other versions.
#: 2: client processes are hosts that lease devices (``heartbeat``, ``lease``, ``device_state``
#: replace ``register``). 3: the body travels as bytes with a MAC over them (``task_key``), tasks
#: carry a per-task key instead of a token; ``join`` asks for a host's own broker user.
SCHEMA_VERSION = 3


class Kind(StrEnum):
    JOIN = "join"
    JOIN_REPLY = "join_reply"
    HEARTBEAT = "heartbeat"
    LEASE = "lease"
    PAYLOAD = "payload"
    FETCH = "fetch"
    DEVICE_STATE = "device_state"
    ROUND_OPEN = "round_open"
    TASK = "task"
    UPDATE = "update"
    RECEIPT = "receipt"
    REJECT = "reject"
    FLUSH = "flush"
    PARTIAL = "partial"
    DECISION = "decision"
    ROUND_SUMMARY = "round_summary"
    STOP = "stop"
    READY = "ready"
    GO = "go"
    EVALUATE = "evaluate"
    EVAL_RESULT = "eval_result"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


#: An encoded tensor: the codec's msgpack-ready mapping (validated in depth by ``codec.decode``).
EncodedTensor = dict[str, Any]


class MetricKey(StrEnum):
    """The names of the numbers devices report (``Update.metrics``, ``EvalResult.metrics``) that the
    framework itself reads. One place, so the server, the ledger and every algorithm agree.

    An algorithm may report further numbers under names of its own (diagnostics such as SpaFL's
    ``train_flops_paper``); they reach ``rounds.csv`` as ``m_<name>`` columns untouched.
    """

    #: mean training loss over the task's minibatches
    TRAIN_LOSS = "train_loss"
    #: SGD steps the task took
    STEPS = "steps"
    #: training FLOPs of the task (set by the client from the strategy's accounting)
    TRAIN_FLOPS = "train_flops"
    #: the device's own model on its own test split (personalised algorithms)
    EVAL_ACCURACY = "eval_accuracy"
    EVAL_LOSS = "eval_loss"
    #: size of that test split: the weight of the device's accuracy in the mean
    EVAL_SAMPLES = "eval_samples"
    #: fraction of the model's weights kept (sparse and pruned algorithms)
    DENSITY = "density"


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


#: A reported number: finite (NaN or infinity would poison every mean it enters).
FiniteFloat = Annotated[float, AfterValidator(_finite)]
#: A metric name: short and printable, so it can become a CSV column and a log field.
MetricName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:/-]+$")]
#: Numbers a device reports with a result, by name (``MetricKey`` for the ones the framework reads).
Metrics = Annotated[dict[MetricName, FiniteFloat], Field(max_length=256)]


class Timings(_Body):
    """Emulated seconds of one task on the device's virtual clock."""

    download_s: FiniteFloat = Field(0.0, ge=0)
    compute_s: FiniteFloat = Field(0.0, ge=0)
    upload_s: FiniteFloat = Field(0.0, ge=0)

    def total(self) -> float:
        return self.download_s + self.compute_s + self.upload_s


class DeviceInfo(_Body):
    device_id: int = Field(ge=0)
    tier: str = "default"
    num_samples: int = Field(ge=0)
    #: the device profile as a plain mapping (memory, bandwidth, ...); see ``shared.devices``
    profile: dict[str, Any] = Field(default_factory=dict)


#: A host's identity: printable, short, usable in a routing key and a queue name.
HostId = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")]


class Heartbeat(_Body):
    """Client host → server, every ``hosts.heartbeat_s``: I am alive, this is what I can host and
    hold. The first one is the host's join; one with ``epoch`` set acknowledges that lease; one with
    ``leaving`` asks to hand its devices back (SIGTERM)."""

    host_id: HostId
    #: most devices the host may be given (None: no limit of its own)
    capacity: int | None = Field(None, ge=0)
    #: memory the host has for training a task (None: unknown); devices whose task could need more
    #: are not leased to it
    memory_bytes: int | None = Field(None, ge=0)
    #: ``--devices``: the exact devices this host serves (reproducible placement); None = any
    pinned: list[int] | None = None
    #: the devices the host holds now (after a server restart: placement is kept where it can be)
    holding: list[int] = Field(default_factory=list, max_length=1_000_000)
    #: the newest lease epoch the host has applied (-1: none)
    epoch: int = Field(-1, ge=-1)
    leaving: bool = False


class Lease(_Body):
    """Server → one host: the complete set of devices it now serves (bind their tasks, load their
    data), as of ``epoch``; devices it held and are not listed go back. Answered by a heartbeat
    carrying the epoch."""

    host_id: HostId
    epoch: int = Field(ge=0)
    devices: list[int]


#: A device-state file name: one flat name, no paths.
StateFileName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class DeviceState(_Body):
    """A device's private state (personal model, masks, counters) as its files.

    Host → server after every task the device trains (the server keeps the newest copy, so a
    device that moves to another host, or whose host dies, continues from its last finished task);
    server → host when the device is leased to it, before the lease itself.
    """

    device_id: int = Field(ge=0)
    files: dict[StateFileName, bytes] = Field(default_factory=dict, max_length=1024)


class Join(_Body):
    """A new client process → server (from the shared join user): give me a broker user of my own.

    Sent with ``reply_to`` set to RabbitMQ's direct reply-to pseudo-queue, so only the asking
    connection can read the answer (a :class:`JoinReply`).
    """

    #: a name the host suggests for itself (its pod name), for logs; the server picks the identity
    hint: str = Field("", max_length=100)


class JoinReply(_Body):
    """Server → the joining connection only: the host's identity and its broker credentials."""

    host_id: HostId
    user: str = Field(max_length=200)
    password: str = Field(max_length=200)


class RoundOpen(_Body):
    """Server → aggregators: which devices may send updates for this round and incarnation."""

    selected: list[int]
    deadline_unix: float
    #: this round's key (hex): a device's task key is derived from it (:func:`task_key`), and an
    #: update's MAC made with that key proves it comes from that device's task, unaltered
    round_key: str = ""
    #: the host serving each selected device (same order as ``selected``): an update is accepted only
    #: from that host's broker user
    holders: list[str] = Field(default_factory=list)

    def holder(self) -> dict[int, str]:
        return dict(zip(self.selected, self.holders, strict=False))


class Payload(_Body):
    """Server → a host: what several of the round's tasks share (the global model, a tier's
    sub-model), once per host instead of once per device. Tasks refer to it by ``digest``."""

    #: SHA-256 (first 16 bytes) of the packed ``tensors``: content-addressed, so a copy is a copy
    digest: bytes = Field(min_length=16, max_length=16)
    tensors: dict[str, EncodedTensor] = Field(default_factory=dict)


class Fetch(_Body):
    """Host → server: send me payload ``digest`` again (a cache miss, e.g. after a restart)."""

    digest: bytes = Field(min_length=16, max_length=16)


class Task(_Body):
    """Server → one device: what it receives and what it is asked to do."""

    device_id: int = Field(ge=0)
    #: the device's own tensors (its mask, its slice: what no other device gets)
    tensors: dict[str, EncodedTensor] = Field(default_factory=dict)
    #: the digest of a :class:`Payload` whose tensors complete this task (empty: none). The
    #: emulated device is charged ``payload_bytes`` more, as if they came with the task.
    payload: bytes = b""
    payload_bytes: int = Field(0, ge=0)
    config: dict[str, Any] = Field(default_factory=dict)
    #: this device's key for this round (:func:`task_key`, hex): what it sends back carries a MAC
    #: made with it. Only the device's host can read its tasks; the round key never leaves the
    #: server and the aggregators.
    key: str = ""


class Update(_Body):
    """Device → aggregators: the result of a task."""

    device_id: int = Field(ge=0)
    num_samples: int = Field(ge=0)
    tensors: dict[str, EncodedTensor] = Field(default_factory=dict)
    metrics: Metrics = Field(default_factory=dict)
    #: wire bytes of the task this update answers (so the server can account per device)
    task_bytes: int = Field(0, ge=0)
    #: emulated seconds: download, compute, upload (virtual clock)
    timings: Timings = Field(default_factory=Timings)


class Receipt(_Body):
    """Aggregator → server: one update was accepted (validated and reduced, not yet merged)."""

    device_id: int = Field(ge=0)
    aggregator_id: str
    update_bytes: int = Field(ge=0)
    dense_bytes: int = Field(ge=0)
    num_samples: int = Field(ge=0)
    metrics: Metrics = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)
    #: non-empty: the update was out of bounds and dead-lettered with this reason, so the server
    #: counts the device as answered (refused) instead of waiting for it until the deadline
    refused: str = Field("", max_length=64)


class Reject(_Body):
    """Device → server: the task was refused before training (never a silent skip)."""

    device_id: int = Field(ge=0)
    reason: str
    detail: str = ""
    footprint_bytes: int = Field(0, ge=0)
    budget_bytes: int = Field(0, ge=0)
    task_bytes: int = Field(0, ge=0)


class Ready(_Body):
    """Device → server: trained, and would finish its upload at ``finish_s`` emulated seconds.

    Used when the round keeps only the first devices to finish (over-selection) or cuts stragglers
    (an emulated deadline): the server ranks devices by their emulated finish time — deterministic
    in virtual time — before any update bytes are spent.
    """

    device_id: int = Field(ge=0)
    finish_s: float = Field(ge=0)
    update_bytes: int = Field(ge=0)


class Go(_Body):
    """Server → one device: upload your held update (``upload``) or discard it (straggler)."""

    device_id: int = Field(ge=0)
    upload: bool
    reason: str = ""


class EvalResult(_Body):
    """Device → server: its personalised model's metrics on its own test split (no training)."""

    device_id: int = Field(ge=0)
    #: False when the algorithm keeps no personalised model (nothing was evaluated)
    supported: bool = True
    metrics: Metrics = Field(default_factory=dict)


class Flush(_Body):
    """Server → aggregators: send what you reduced for this round now."""


class Partial(_Body):
    """Aggregator → server: an associative partial reduction over ``devices``.

    ``singleton`` marks a partial built from one *redelivered* update: the server drops it if that
    device is already covered, which is what makes aggregator crashes count every update exactly once.
    """

    aggregator_id: str
    seq: int = Field(ge=0)
    devices: list[int]
    singleton: bool = False
    tensors: dict[str, EncodedTensor] = Field(default_factory=dict)
    scalars: dict[str, float] = Field(default_factory=dict)


class Decision(_Body):
    """Server → one aggregator: was its partial ``seq`` merged? (acks are held until then)."""

    seq: int = Field(ge=0)
    accepted: bool
    reason: str = ""


class RoundSummary(_Body):
    """Server → anyone listening: the outcome of a round (for observers and load tests)."""

    outcome: str
    accuracy: float | None = None
    loss: float | None = None
    participants: int = 0


class Stop(_Body):
    """Server → everyone: the experiment is over; exit cleanly."""

    reason: str = "finished"


BODY_MODELS: dict[Kind, type[_Body]] = {
    Kind.JOIN: Join,
    Kind.JOIN_REPLY: JoinReply,
    Kind.HEARTBEAT: Heartbeat,
    Kind.LEASE: Lease,
    Kind.PAYLOAD: Payload,
    Kind.FETCH: Fetch,
    Kind.DEVICE_STATE: DeviceState,
    Kind.ROUND_OPEN: RoundOpen,
    Kind.TASK: Task,
    Kind.UPDATE: Update,
    Kind.RECEIPT: Receipt,
    Kind.REJECT: Reject,
    Kind.FLUSH: Flush,
    Kind.PARTIAL: Partial,
    Kind.DECISION: Decision,
    Kind.ROUND_SUMMARY: RoundSummary,
    Kind.STOP: Stop,
    Kind.READY: Ready,
    Kind.GO: Go,
    Kind.EVALUATE: Task,
    Kind.EVAL_RESULT: EvalResult,
}


class Envelope(BaseModel):
    """What every message on the wire looks like: routing facts, then the body as bytes.

    Why bytes: a MAC (``mac``) must cover exactly what was sent, and a map re-encoded after decoding
    need not reproduce the same bytes. ``sender`` is the sender's word for itself, for logs only; who
    really sent a message is the broker-validated ``user_id`` of the delivery.
    """

    model_config = ConfigDict(extra="forbid")

    v: int
    kind: Kind
    exp: str
    inc: str = ""
    round: int = Field(ge=0)
    sender: str
    id: str
    body: bytes
    #: HMAC-SHA256 (128 bits) of the message under the device's task key; empty when not a device's
    mac: bytes = b""


class DecodeError(ValueError):
    """A message that cannot be used; ``reason`` is the dead-letter counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def task_key(round_key: str, round: int, device_id: int) -> str:
    """The key of ``device_id``'s task in ``round`` (hex, 128 bits), derived from the round's key.

    Why: the routing key of an update says nothing about who sent it, and the device id in its body
    is whatever the sender wrote. The round key stays with the server and the aggregators; a device's
    task key travels only in that device's task, which only its host can read. What the device sends
    back is MAC'd with it, so nobody else can speak for the device, and an altered copy of what it
    sent fails the check. An empty ``round_key`` (no round open) gives an empty key.
    """
    if not round_key:
        return ""
    msg = f"{round}:{device_id}".encode()
    return hmac.new(bytes.fromhex(round_key), msg, hashlib.sha256).hexdigest()[:32]


def _mac(key: str, kind: Kind, exp: str, round: int, inc: str, body: bytes) -> bytes:
    head = f"{kind.value}|{exp}|{round}|{inc}|".encode()
    return hmac.new(bytes.fromhex(key), head + body, hashlib.sha256).digest()[:16]


def verify(env: Envelope, key: str) -> bool:
    """Whether ``env`` carries the MAC of its own bytes under ``key`` (constant time)."""
    if not key or len(env.mac) != 16:
        return False
    return hmac.compare_digest(_mac(key, env.kind, env.exp, env.round, env.inc, env.body), env.mac)


def encode(
    kind: Kind,
    body: _Body,
    *,
    exp: str,
    round: int,
    sender: str,
    inc: str = "",
    msg_id: str | None = None,
    key: str = "",
) -> bytes:
    """Serialize one message; with ``key`` (a device's task key) it carries a MAC of its bytes.

    ``model_dump`` keeps bytes/memoryview tensor buffers as they are.
    """
    if not isinstance(body, BODY_MODELS[kind]):
        raise TypeError(f"{kind} needs a {BODY_MODELS[kind].__name__}, got {type(body).__name__}")
    packed = codec.packb(body.model_dump())
    env: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "kind": kind.value,
        "exp": exp,
        "inc": inc,
        "round": round,
        "sender": sender,
        "id": msg_id or uuid.uuid4().hex,
        "body": packed,
    }
    if key:
        env["mac"] = _mac(key, kind, exp, round, inc, packed)
    return codec.packb(env)


def decode(data: bytes, *, max_bytes: int) -> tuple[Envelope, Any]:
    """Parse and validate one message; raises ``DecodeError`` with a dead-letter reason."""
    try:
        raw = codec.unpackb(data, max_bytes=max_bytes)
    except codec.CodecError as err:
        raise DecodeError(err.reason, str(err)) from None
    try:
        env = Envelope.model_validate(raw)
    except ValidationError as err:
        raise DecodeError("schema", f"envelope: {_short(err)}") from None
    if env.v != SCHEMA_VERSION:
        raise DecodeError(
            "schema", f"schema version {env.v} not supported (this build speaks {SCHEMA_VERSION})"
        )
    try:
        fields = codec.unpackb(env.body, max_bytes=max_bytes)
    except codec.CodecError as err:
        raise DecodeError(err.reason, f"{env.kind.value} body: {err}") from None
    try:
        body = BODY_MODELS[env.kind].model_validate(fields)
    except ValidationError as err:
        raise DecodeError("schema", f"{env.kind.value} body: {_short(err)}") from None
    return env, body


def _short(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
