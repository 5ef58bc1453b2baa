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

import functools
import hashlib
import hmac
import math
import secrets
import typing
from collections.abc import Iterator, Mapping
from enum import StrEnum
from typing import Annotated, Any

import blake3
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from shared import codec
from shared.codec import tensorset

#: Bump when a message changes incompatibly. A build reads this version and the previous one, writes
#: the previous one to a peer that speaks only it, and dead-letters any other (docs/wire.md): bumping
#: means making today's writer the ``PREVIOUS_VERSION`` writer and retiring the oldest one's.
#: 2: client processes are hosts that lease devices (``heartbeat``, ``lease``, ``device_state``
#: replace ``register``). 3: the body travels as bytes with a MAC over them (``task_key``), tasks
#: carry a per-task key instead of a token; ``join`` asks for a host's own broker user.
#: 4: lean envelope — the envelope and bodies are msgpack arrays, tensors travel as one tensor set
#: per message (layout by digest once known), an update's metrics and timings as telemetry.
#: 5: a body's tensor blob follows its fields raw (no second bin frame), the tensor set's counts
#: sit beside its head, and references into a known layout are one byte each (the index implied by
#: the order, a slice's axes inside the ref): every device message within 64 bytes of its tensors.
#: 6: a device's MAC is keyed BLAKE3 instead of HMAC-SHA-256 (:func:`_mac`), the same 16 bytes over
#: the same input; the layout is version 5's. Why: checking the MAC of a 438 KB update was a quarter
#: of an aggregator's CPU at 10,000 devices, and making it a sixth of a client host's encoding.
#: 7: ``tasks``, one message per host carrying its devices' tasks of a round (:class:`Tasks`); the
#: layout and the MAC are version 6's. Why a version: a host of version 6 cannot read the new kind,
#: so the server must know whom to send it (``KIND_SINCE``).
SCHEMA_VERSION = 7
#: The version before this one: still read, and written to a peer that speaks it (a client host of
#: the previous image during a rolling upgrade; docs/wire.md, "Versions on the wire").
PREVIOUS_VERSION = 6


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
    RECEIPTS = "receipts"
    GOS = "gos"
    TASKS = "tasks"
    ANSWERS = "answers"
    UPDATES = "updates"


#: kinds that appeared after some accepted version: never written to a peer of an older one (it
#: would not know them), and refused in an envelope of an older one
KIND_SINCE: dict[Kind, int] = {Kind.GOS: 6, Kind.TASKS: 7, Kind.ANSWERS: 7, Kind.UPDATES: 7}


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
    #: the tensor-set layouts of the round's payloads: a device's update may name one by its digest
    layouts: list[list[Any]] = Field(default_factory=list, max_length=1024)

    def holder(self) -> dict[int, str]:
        return dict(zip(self.selected, self.holders, strict=False))


class Payload(_Body):
    """Server → a host: what several of the round's tasks share (the global model, a tier's
    sub-model), once per host instead of once per device. Tasks refer to it by ``digest``."""

    #: SHA-256 (first 8 bytes) of the packed ``tensors``: content-addressed, so a copy is a copy
    #: (64 bits: a round has a handful of payloads, so a collision is not a practical concern)
    digest: bytes = Field(min_length=8, max_length=8)
    tensors: dict[str, EncodedTensor] = Field(default_factory=dict)


class Fetch(_Body):
    """Host → server: send me payload ``digest`` again (a cache miss, e.g. after a restart)."""

    digest: bytes = Field(min_length=8, max_length=8)


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
    #: this device's key for this round (:func:`task_key`, raw bytes): what it sends back carries a
    #: MAC made with it. Only the device's host can read its tasks; the round key never leaves the
    #: server and the aggregators.
    key: bytes = Field(b"", max_length=32)


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
    #: what the device uploaded (the update without its telemetry)
    update_bytes: int = Field(ge=0)
    dense_bytes: int = Field(ge=0)
    num_samples: int = Field(ge=0)
    metrics: Metrics = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)
    #: what the update's telemetry added on the broker (its metrics and timings)
    telemetry_bytes: int = Field(0, ge=0)
    #: non-empty: the update was out of bounds and dead-lettered with this reason, so the server
    #: counts the device as answered (refused) instead of waiting for it until the deadline
    refused: str = Field("", max_length=64)


#: the most receipts one ``Receipts`` message carries (an aggregator's turn holds at most its
#: prefetch of updates; this bounds what a server decodes from one message)
MAX_RECEIPTS = 1024


class Receipts(_Body):
    """Aggregator → server: the receipts of the updates one turn of its loop accepted, in one message.

    Why: one message per accepted update made receipts a third of a round's messages, and the
    server's and the broker's per-message cost (decode, dispatch, ack, persist) the larger part of
    their CPU (issue 16's profile); one turn's receipts as one message cost that once. Every
    receipt is handled as a lone ``Receipt`` would be."""

    receipts: list[Receipt] = Field(min_length=1, max_length=MAX_RECEIPTS)


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


#: the most ``go`` decisions one ``Gos`` message carries (a round's devices of one host, or a chunk)
MAX_GOS = 4096


class Gos(_Body):
    """Server → one host: the ``go`` of each of its devices in a round, in one message (since schema
    version 6: every host this build writes to reads it, so the server sends no lone ``go``).

    Why: a first-finishers round at 10,000 devices sent ~1,300 ``go`` messages, one per invited
    device, though all of a host's go out at the same moment to the same queue: a quarter of a
    round's messages, each costing the broker, the server and the host their per-message work
    (benchmarks/results-scale.md). Every entry is handled as a lone ``go`` would be."""

    goes: list[Go] = Field(min_length=1, max_length=MAX_GOS)


#: the most tasks one ``Tasks`` message carries (a round's devices of one host, or a chunk)
MAX_TASKS = 4096


class Tasks(_Body):
    """Server → one host: the round's task of each of its selected devices, in one message (schema
    version 7; a host of version 6 gets one ``task`` per device).

    Why: a round sent one ``task`` per device, though all of a host's go out at the same moment to
    the same queue, and since payloads (``Payload``) carry the tensors a task is ~50 bytes: ~1,300
    messages a round at 10,000 devices, every one costing the broker, the server and the host their
    per-message work (a delivery, an ack, a persistent write) for nothing the device needs
    (benchmarks/results-scale.md). Every entry is handled as a lone ``task`` would be, and its
    device is charged the bytes of that lone ``task`` (the client encodes it for the entry's
    delivery, ``shared.transport.split``): what a real device would download does not depend on
    how the emulator batches its messages. Sent in virtual time only (``Server._send_tasks`` says
    why not in real time)."""

    tasks: list[Task] = Field(min_length=1, max_length=MAX_TASKS)


#: the kinds a host's devices answer the server with, which an ``Answers`` message may carry
ANSWER_KINDS = frozenset({Kind.READY, Kind.REJECT, Kind.EVAL_RESULT})
#: the most messages one ``Answers`` carries
MAX_ANSWERS = 4096


class Answers(_Body):
    """Host → server: its devices' answers (``ready``, ``reject``, ``eval_result``) that one turn of
    its loop queued, in one message (schema version 7). Each entry is the complete message the
    device would have sent alone, its MAC included, and the server handles it as that message
    (every check of a lone one: kind, sender's role, MAC): the batching is the host's, the
    answers stay the devices'.

    Why: in a first-finishers round every invited device answers ``ready`` (~1,300 a round at
    10,000 devices), each a message of ~60 bytes with a broker write, a delivery and an ack of its
    own; with quorum queues each was also a publisher confirm."""

    messages: list[bytes] = Field(min_length=1, max_length=MAX_ANSWERS)


#: the most updates one ``Updates`` carries (a host flushes at
#: ``services.client.service.UPLOAD_FLUSH_COUNT`` uploads, 64, or fewer; the bound is the
#: decoder's, for what a host may send)
MAX_UPDATES = 256


class Updates(_Body):
    """Host → aggregators: its devices' updates that one flush of its outbox sends, in one message
    (schema version 7). Each entry is the complete ``update`` the device would have sent alone, its
    MAC included, and the aggregator handles it as that message, on a delivery of its own
    (``shared.transport.split``): every check of a lone one (kind, sender's role and lease, MAC,
    round, duplicates, bounds), a dead letter of its own, its own receipt with its own bytes. The
    device is charged its update's bytes, not the bundle's.

    Why: an update was a message of its own, with a broker write, a delivery and an ack each. In
    ``benchmarks/bench_rounds.py --sizes 50 --rounds 40 --transports amqp``, run alternately on
    commit 5d53084 (before this kind) and with it (five pairs on a 2-core AMD EPYC VM, 2026-12-02),
    the broker's CPU per round was 32–38 ms with lone updates and 26–29 ms with ``updates``; the
    round times moved with the machine's noise, more than by any difference between the two.

    Readers first: only an aggregator of this build reads it. One older than its hosts dead-letters
    it with reason ``schema`` (an unknown kind), as docs/wire.md says of a reader older than its
    writers."""

    messages: list[bytes] = Field(min_length=1, max_length=MAX_UPDATES)


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
    Kind.RECEIPTS: Receipts,
    Kind.GOS: Gos,
    Kind.TASKS: Tasks,
    Kind.ANSWERS: Answers,
    Kind.UPDATES: Updates,
}


class Envelope(BaseModel):
    """What every message on the wire looks like: routing facts, then the body as bytes.

    Why bytes: a MAC (``mac``) must cover exactly what was sent, and a map re-encoded after decoding
    need not reproduce the same bytes. ``sender`` is the sender's word for itself, for logs only
    (empty on a device's messages: the device id is in the body); who really sent a message is the
    broker-validated ``user_id`` of the delivery.

    On the wire (versions 6 and 7) this is a msgpack *array*, not a map — field names cost more
    than most fields — see :func:`encode`. ``exp`` is not sent: a 32-bit tag of it is (``exp_tag``), and the
    receiver, which knows its experiment, checks the tag and fills ``exp`` in.
    """

    model_config = ConfigDict(extra="forbid")

    v: int
    kind: Kind
    exp: str = ""
    exp_tag: int = 0
    inc: str = ""
    round: int = Field(ge=0)
    sender: str = ""
    body: bytes
    #: the MAC (128 bits; :func:`_mac`) of the message under the device's task key; empty when not a
    #: device's
    mac: bytes = b""
    #: metrics and timings a device reports with its update, packed apart from the body: they are
    #: not what a real device's upload would carry, so they are not counted as the device's bytes
    telemetry: bytes = b""
    #: layouts of tensor sets that came inline (a receiver learns them from the server only)
    _layouts: list[tensorset.Layout] = PrivateAttr(default_factory=list)

    @property
    def layouts(self) -> list[tensorset.Layout]:
        return self._layouts

    @property
    def telemetry_bytes(self) -> int:
        """What the telemetry adds to the message (its bin framing included)."""
        return len(self.telemetry) + _bin_framing(len(self.telemetry)) if self.telemetry else 0


def _bin_framing(n: int) -> int:
    return 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5


class DecodeError(ValueError):
    """A message that cannot be used; ``reason`` is the dead-letter counter label."""

    def __init__(self, reason: str, message: str, env: Envelope | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        #: the envelope, when only the body failed (e.g. an unknown layout: the receiver may wait)
        self.env = env


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


#: an incarnation of this many bytes (the server's, :func:`new_incarnation`) travels as an unsigned
#: int — an int of up to 32 bits packs in at most 5 bytes, a 4-byte bin in 6
INC_BYTES = 4


def new_incarnation() -> str:
    """A server start's incarnation (hex): 31 random bits under a set top bit.

    Why the top bit: msgpack packs an int in as few bytes as its value needs, so a random 32-bit
    incarnation would make every message of a start 1–4 bytes shorter in one start of 256 — and
    byte counts that differ between two runs of the same experiment (a resumed run, the same run
    over RabbitMQ and in one process) for no reason. With it, every incarnation packs in 5 bytes.
    """
    return f"{secrets.randbits(8 * INC_BYTES - 1) | 1 << (8 * INC_BYTES - 1):08x}"


@functools.lru_cache(maxsize=64)
def exp_tag(exp: str) -> int:
    """The 32-bit tag of an experiment id that travels instead of the id (``Envelope.exp_tag``)."""
    return int.from_bytes(hashlib.sha256(exp.encode()).digest()[:4], "big")


#: the bytes of a message's MAC
MAC_BYTES = 16
#: each version's MAC algorithm, by its number. Why a table: at the next bump today's version
#: becomes the previous one and keeps its algorithm; choosing by "is it the previous version" would
#: then check every current host's MAC with the older algorithm. A version missing here has no MAC.
MAC_ALGORITHMS: dict[int, str] = {6: "blake3-keyed", 7: "blake3-keyed"}
#: BLAKE3's key-derivation context for a MAC key (its ``derive_key`` mode): a task key is 16 bytes,
#: keyed BLAKE3 takes 32, and a context string keeps these keys apart from any other use of the same
#: material
MAC_KEY_CONTEXT = "fedfleet 2026-11-29 device message MAC (schema version 6)"


def _mac(key: str, v: int, kind: Kind, exp: str, round: int, inc: str, body: bytes, tel: bytes) -> bytes:
    """The MAC of a message of version ``v`` under the task key ``key`` (hex).

    Versions 6 and 7: keyed BLAKE3 under a key derived from the task key, truncated to
    :data:`MAC_BYTES`, over the envelope's fields that the receiver checks (the version among them),
    the body and the telemetry. Version 5's HMAC-SHA-256 is retired with version 5.

    Why BLAKE3: the MAC runs over every byte of every update twice (the device makes it, an
    aggregator checks it). Checking a 438 KB update took 211 µs with HMAC-SHA-256 and 55 µs with
    keyed BLAKE3 on a 2-core AMD EPYC with SHA extensions (``benchmarks/bench_mac.py``). Keyed
    BLAKE3 is a PRF by design, so it is a MAC as HMAC is.
    """
    algorithm = MAC_ALGORITHMS.get(v)
    if algorithm is None:  # by the version's number, never "not the previous one": see MAC_ALGORITHMS
        raise ValueError(f"no MAC algorithm for schema version {v!r}")
    head = f"{v}|{kind.value}|{exp}|{round}|{inc}|{len(body)}|".encode()
    raw = bytes.fromhex(key)
    assert algorithm == "blake3-keyed", algorithm  # the only one a readable version has
    # the key derived per call (~0.5 µs; a 438 KB update's MAC takes ~55 µs): no cache of task keys
    b = blake3.blake3(head, key=blake3.blake3(raw, derive_key_context=MAC_KEY_CONTEXT).digest())
    b.update(body)
    b.update(tel)
    return b.digest(MAC_BYTES)


def verify(env: Envelope, key: str) -> bool:
    """Whether ``env`` carries the MAC of its own bytes under ``key`` (constant time).

    The MAC covers the full experiment id (not only its tag), the round, the incarnation, the body
    and the telemetry: a copy moved to another round or altered anywhere fails.
    """
    if not key or len(env.mac) != MAC_BYTES or env.v not in MAC_ALGORITHMS:
        return False
    want = _mac(key, env.v, env.kind, env.exp, env.round, env.inc, env.body, env.telemetry)
    return hmac.compare_digest(want, env.mac)


# -- the positional body encoding -----------------------------------------------------------------
#: fields holding a message's named tensors: they travel as one compact tensor set
#: (:mod:`shared.codec.tensorset`)
TENSOR_FIELDS = frozenset({"tensors"})
#: per kind, fields that travel as telemetry (apart from the body; see ``Envelope.telemetry``)
TELEMETRY: dict[Kind, tuple[str, ...]] = {Kind.UPDATE: ("metrics", "task_bytes", "timings")}
#: the wire code of each kind: its position here. Append new kinds at the end; never reorder.
KIND_CODES: dict[Kind, int] = {k: i for i, k in enumerate(Kind)}
_KINDS_BY_CODE: dict[int, Kind] = {i: k for k, i in KIND_CODES.items()}


def _nested(annotation: Any) -> type[_Body] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Body) else None


def _nested_list(annotation: Any) -> type[_Body] | None:
    """``B`` for a ``list[B]`` field of bodies (``Receipts.receipts``), else None."""
    if typing.get_origin(annotation) is list:
        (arg,) = typing.get_args(annotation)
        return _nested(arg)
    return None


def _positional(
    model: _Body, names: tuple[str, ...], known: Mapping[bytes, Any] | None, blobs: list[bytes] | None = None
) -> list[Any]:
    """Field values in declaration order, trailing defaults left out (the receiver fills them).

    A tensor set is written as ``[head, *counts]`` and its blob is appended to ``blobs``, for the
    caller to place after the packed fields. ``blobs`` None: telemetry, which holds no tensors.
    """
    fields = type(model).model_fields
    out: list[Any] = []
    for name in names:
        value = getattr(model, name)
        if name in TENSOR_FIELDS:
            if not value:
                value = None
            elif blobs is None:
                raise TypeError("a tensor set outside a body's fields")  # telemetry has none
            else:
                head, blob, *counts = tensorset.to_wire(value, known)
                value = [head, *(counts[0] if counts else [])]
                blobs.append(blob)
        elif isinstance(value, _Body):
            value = _positional(value, tuple(type(value).model_fields), known, blobs)
        elif isinstance(value, list) and value and isinstance(value[0], _Body):
            value = [_positional(v, tuple(type(v).model_fields), known, blobs) for v in value]
        out.append(value)
    while out and names[len(out) - 1] in fields and _is_default(model, names[len(out) - 1]):
        out.pop()
    return out


def _is_default(model: _Body, name: str) -> bool:
    default = _default(type(model), name)
    return default is not _REQUIRED and bool(getattr(model, name) == default)


_REQUIRED = object()


@functools.cache
def _default(cls: type[_Body], name: str) -> Any:
    """A field's default (a factory's, made once), or ``_REQUIRED``. Cached: pydantic inspects
    the factory's signature on every ``get_default``, a tenth of encoding an update (issue 16's
    profile). Only compared against, never handed out, so one shared instance is safe."""
    info = cls.model_fields[name]
    return _REQUIRED if info.is_required() else info.get_default(call_default_factory=True)


def _from_positional(
    cls: type[_Body],
    names: tuple[str, ...],
    values: Any,
    layouts: Mapping[bytes, Any],
    seen: list[Any],
    blob: list[bytes] | None = None,
) -> dict[str, Any]:
    """The inverse of :func:`_positional`. ``blob``: a one-item list holding the bytes that followed
    the body's fields; the tensor set takes them (and empties the list), so the caller can tell bytes
    nobody claimed. None: telemetry, where a tensor set is malformed."""
    if not isinstance(values, list) or len(values) > len(names):
        raise codec.CodecError("malformed", f"{cls.__name__}: expected a list of at most {len(names)} fields")
    out: dict[str, Any] = {}
    for name, value in zip(names, values, strict=False):
        if name in TENSOR_FIELDS:
            inline = None
            if value is None:
                value = {}
            else:
                if not isinstance(value, list) or not value or not blob:
                    raise codec.CodecError("malformed", "tensor set: expected [head, *counts] and one blob")
                wire = [value[0], blob.pop(), value[1:]] if len(value) > 1 else [value[0], blob.pop()]
                value, inline = tensorset.unpack(wire, layouts)
            if inline is not None:
                seen.append(inline)
        else:
            annotation = cls.model_fields[name].annotation
            sub = _nested(annotation)
            if sub is not None and isinstance(value, list):
                value = _from_positional(sub, tuple(sub.model_fields), value, layouts, seen, blob)
            elif (item := _nested_list(annotation)) is not None and isinstance(value, list):
                names_ = tuple(item.model_fields)
                value = [_from_positional(item, names_, v, layouts, seen, blob) for v in value]
        out[name] = value
    return out


def _body_fields(kind: Kind) -> tuple[tuple[str, ...], tuple[str, ...]]:
    tel = TELEMETRY.get(kind, ())
    return tuple(n for n in BODY_MODELS[kind].model_fields if n not in tel), tel


def encode(
    kind: Kind,
    body: _Body,
    *,
    exp: str,
    round: int,
    sender: str,
    inc: str = "",
    key: str = "",
    known: Mapping[bytes, Any] | None = None,
    version: int = SCHEMA_VERSION,
    packed: bytes | None = None,
) -> bytes:
    """Serialize one message; with ``key`` (a device's task key) it carries a MAC of its bytes.

    ``packed``: the body without its telemetry, as :func:`pack_body` made it for this ``body``,
    ``known`` and ``version`` (a client encodes an update twice, before and after it knows the
    upload's duration, which is telemetry: the tensors are packed once).

    ``version``: :data:`SCHEMA_VERSION` (the default), or :data:`PREVIOUS_VERSION` for a peer that
    speaks only that one.

    Wire form (versions 6 and 7 alike; version 7 adds the ``tasks`` kind), one msgpack array::

        [v, kind code, exp tag, inc (int; bin if not 4 bytes), round, sender, body (bin), mac (bin),
         telemetry (bin)]

    trailing empty fields left out. The body is an array of the body model's fields in declaration
    order (trailing defaults left out); a ``tensors`` field is a tensor set whose layout goes as a
    digest, or as references into a layout, that ``known`` (digest → layout) holds, written as
    ``[head, *counts]`` with the set's blob raw after the packed array, inside the same body bin
    (:mod:`shared.codec.tensorset`).

    Why: at small scale the envelope, not the model, was most of a message (a SpaFL update carried
    592 bytes beside 232 bytes of thresholds in version 3); this keeps every device message within
    64 bytes of its tensors' information (``benchmarks/bench_envelope.py`` measures it).
    """
    if not isinstance(body, BODY_MODELS[kind]):
        raise TypeError(f"{kind} needs a {BODY_MODELS[kind].__name__}, got {type(body).__name__}")
    _check_version(version)
    if KIND_SINCE.get(kind, 0) > version:
        raise ValueError(f"schema version {version} has no {kind.value!r} (since {KIND_SINCE[kind]})")
    if packed is None:
        packed = pack_body(kind, body, known=known, version=version)
    tel_names = TELEMETRY.get(kind, ())
    tel_values = _positional(body, tel_names, known) if tel_names else []
    tel = codec.packb(tel_values) if tel_values else b""
    env: list[Any] = [*_head(version, kind, exp, round, inc, sender), packed]
    env.append(_mac(key, version, kind, exp, round, inc, packed, tel) if key else b"")
    env.append(tel)
    while env[-1] == b"":
        env.pop()
    return codec.packb(env)


def _check_version(version: int) -> None:
    if version not in ACCEPTED_VERSIONS:
        raise ValueError(
            f"this build writes schema versions {PREVIOUS_VERSION} and {SCHEMA_VERSION}, not {version}"
        )


def _head(version: int, kind: Kind, exp: str, round: int, inc: str, sender: str) -> list[Any]:
    """The envelope's fields before the body (see :func:`encode`)."""
    inc_b = bytes.fromhex(inc)
    # a 4-byte incarnation as an int: 5 bytes at most, not a bin's 6
    inc_w = int.from_bytes(inc_b, "big") if len(inc_b) == INC_BYTES else inc_b
    return [version, KIND_CODES[kind], exp_tag(exp), inc_w, round, sender]


def device_size(
    kind: Kind,
    packed: bytes | int,
    *,
    exp: str,
    round: int,
    sender: str,
    inc: str = "",
    version: int = SCHEMA_VERSION,
) -> int:
    """``device_bytes(encode(..., key=k, packed=packed))`` of a device's message (it carries a MAC:
    ``k`` is not empty), computed without encoding it, whatever its telemetry.

    Why: a client must know the size of an update before its upload's duration (telemetry, which
    is not counted) can be filled in; encoding it twice computed the MAC of the whole body, and
    copied it, once for nothing (~3 % of a client's CPU). ``packed`` may be given by its length.
    """
    head = _head(version, kind, exp, round, inc, sender)
    assert len(head) + 2 < 16  # with the body and the MAC, a fixarray: one byte of framing
    n = packed if isinstance(packed, int) else len(packed)
    size = 1 + sum(len(codec.packb(f)) for f in head) + n + _bin_framing(n)
    return size + MAC_BYTES + _bin_framing(MAC_BYTES)


def pack_body(
    kind: Kind, body: _Body, *, known: Mapping[bytes, Any] | None = None, version: int = SCHEMA_VERSION
) -> bytes:
    """The body bin of :func:`encode`: the body's fields but its telemetry, positional, with its
    tensor sets' blobs after them (the same in versions 6 and 7; ``version`` is checked only)."""
    _check_version(version)
    names, _ = _body_fields(kind)
    blobs: list[bytes] = []
    packed = codec.packb(_positional(body, names, known, blobs))
    return packed + blobs[0] if blobs else packed


def decode(
    data: bytes, *, max_bytes: int, exp: str | None = None, layouts: Mapping[bytes, Any] | None = None
) -> tuple[Envelope, Any]:
    """Parse and validate one message; raises ``DecodeError`` with a dead-letter reason.

    ``exp``: the receiver's experiment (a message of another is refused, ``unknown-experiment``);
    ``layouts``: the tensor-set layouts the receiver knows (``shared.codec.tensorset``). This build
    reads versions :data:`ACCEPTED_VERSIONS` (docs/wire.md, "Versions on the wire").
    """
    try:
        raw = codec.unpackb(data, max_bytes=max_bytes)
    except codec.CodecError as err:
        raise DecodeError(err.reason, str(err)) from None
    env = _envelope(raw)
    if exp is not None:
        if env.exp_tag != exp_tag(exp):
            raise DecodeError("unknown-experiment", f"experiment tag {env.exp_tag:08x} is not {exp!r}", env)
        env.exp = exp
    try:
        names, tel_names = _body_fields(env.kind)
        cls = BODY_MODELS[env.kind]
        fields, rest = codec.unpackb_head(env.body, max_bytes=max_bytes)
        blob = [rest]
        values = _from_positional(cls, names, fields, layouts or {}, env.layouts, blob)
        if blob and blob[0]:
            raise codec.CodecError("malformed", f"{len(rest)} bytes after the body that no tensor set takes")
        if tel_names and env.telemetry:
            tel = codec.unpackb(env.telemetry, max_bytes=max_bytes)
            values.update(_from_positional(cls, tel_names, tel, layouts or {}, env.layouts))
    except codec.CodecError as err:
        raise DecodeError(err.reason, f"{env.kind.value} body: {err}", env) from None
    try:
        body = cls.model_validate(values)
    except ValidationError as err:
        raise DecodeError("schema", f"{env.kind.value} body: {_short(err)}", env) from None
    return env, body


#: the versions this build reads: its own and the one before (a rolling upgrade's mixed fleet)
ACCEPTED_VERSIONS = (PREVIOUS_VERSION, SCHEMA_VERSION)


def transcode(data: bytes, version: int, *, exp: str, layouts: Mapping[bytes, Any] | None = None) -> bytes:
    """``data`` (a message this service encoded) rewritten in schema ``version``.

    Why: a sender picks the version per addressee at the one place every message leaves it (see
    :class:`shared.schemas.peers.PeerVersions`), after the code that built the message, so that code
    needs no version of its own. A message with a MAC is refused: its MAC covers its bytes, and only
    a device, with its task key, may make one (the server's messages to hosts carry none).
    ``layouts``: the ones the message's tensor sets may name; rewritten, a tensor set carries its
    layout inline (the addressee may not know it: it learns layouts from what it is sent).
    """
    env, body = decode(data, max_bytes=len(data), exp=exp, layouts=layouts)
    if env.v == version:
        return data
    if env.mac:
        raise ValueError(f"a MAC'd {env.kind.value} cannot be rewritten in another version")
    return encode(env.kind, body, exp=exp, round=env.round, sender=env.sender, inc=env.inc, version=version)


def _envelope(raw: Any) -> Envelope:
    version = raw[0] if isinstance(raw, list) and raw else raw.get("v") if isinstance(raw, dict) else None
    if version not in ACCEPTED_VERSIONS:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        raise DecodeError(
            "schema",
            f"schema version {version!r} not supported (this build reads "
            f"{', '.join(map(str, ACCEPTED_VERSIONS))}){'; upgrade this service' if newer else ''}",
        )
    try:
        if not isinstance(raw, list) or not 7 <= len(raw) <= 9:
            raise DecodeError("schema", "envelope: expected an array of 7 to 9 fields")
        v, code, tag, inc, rnd, sender, body, *rest = raw
        kind = _KINDS_BY_CODE.get(code) if type(code) is int else None
        if kind is None or KIND_SINCE.get(kind, 0) > v:
            raise DecodeError("schema", f"envelope: unknown message kind {code!r} in version {v!r}")
        if type(inc) is int and 0 <= inc < 1 << 8 * INC_BYTES:
            inc = inc.to_bytes(INC_BYTES, "big")
        if not isinstance(inc, bytes) or len(inc) > 32:
            raise DecodeError("schema", "envelope: the incarnation must be a short bin or a 32-bit int")
        return Envelope.model_validate(
            {
                "v": v,
                "kind": kind,
                "exp_tag": tag,
                "inc": inc.hex(),
                "round": rnd,
                "sender": sender,
                "body": body,
                "mac": rest[0] if rest else b"",
                "telemetry": rest[1] if len(rest) > 1 else b"",
            }
        )
    except ValidationError as err:
        raise DecodeError("schema", f"envelope: {_short(err)}") from None


#: Issue 16's budget: a device's message (task, update) carries at most this many bytes beyond its
#: tensors' information (:func:`information_bytes`) and its telemetry. ``benchmarks/bench_envelope.py``
#: reports it; ``tests/test_contract.py`` holds every algorithm to it.
DEVICE_ENVELOPE_BUDGET = 64


def _buffers(obj: Any) -> Iterator[int]:
    """Lengths of every raw buffer inside an encoded tensor (codec layout v1)."""
    if isinstance(obj, bytes | bytearray | memoryview):
        yield len(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _buffers(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _buffers(v)


def information_bytes(body: Any) -> int:
    """The information in a decoded body: its tensors' raw buffers (dense data; mask + values;
    indices + values; per-axis indices + values: what no encoding can avoid), and a task's config
    (the device's own instructions — which layers to train, its sub-model; packed as msgpack).
    Everything else in a message is envelope (see :data:`DEVICE_ENVELOPE_BUDGET`)."""
    tensors = getattr(body, "tensors", None) or {}
    total = sum(sum(_buffers(t)) for t in tensors.values())
    if isinstance(body, Task) and body.config:
        total += len(codec.packb(body.config))
    return total


def message_parts(data: bytes) -> Envelope:
    """The envelope of an encoded message, body not decoded (sizes, kind: for accounting)."""
    return _envelope(codec.unpackb(data, max_bytes=len(data) + 1))


def device_bytes(data: bytes) -> int:
    """What a message costs the emulated device that sends it: all of it but its telemetry."""
    return len(data) - message_parts(data).telemetry_bytes


def _short(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
