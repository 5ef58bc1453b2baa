"""The server: owns the experiment — device registry, round loop, selection, deadlines, global state.

A round, as a state machine (:class:`~services.server.round.Phase`) driven by messages and ``tick``:

``registering`` → (enough devices) → ``open``: select devices, tell the aggregators which devices may
answer (``round_open``), send each device its task. Receipts (from aggregators) and refusals (from
devices) arrive; partials may too (an aggregator sends one when its window is full or it holds
every selected device's update, ahead of their receipts). When every selected device is accounted
for and the round is settled (every receipted device covered by exactly one accepted partial, every
covered device receipted) → finalize; when it is accounted for but not settled, or the deadline
passes with at least the quorum (receipted or merged) → ``flushing``: ask the aggregators for their
partials and merge them until the round is settled → finalize with the strategy, evaluate, record,
checkpoint → next round, or ``done`` (broadcast ``stop``).

Where things live: the open round's bookkeeping, and what happens when an update arrives, is
:class:`~services.server.round.RoundState` (one object per round); every reported number is the
:class:`~services.server.ledger.RunLedger`; the checkpoint format is
:mod:`services.server.checkpoint`. This class wires messages to them.

No silent success: a round that merged nothing because the broker lost it (the rule is
:meth:`~services.server.round.RoundState.lost_to_broker`) is recorded as ``lost`` and opened again —
same number, selection, key and tasks, so the model is the clean run's — after a pause, at most
``ROUND_REPEATS`` times and within the reconnect budget (:class:`~services.server.round.RepeatPolicy`);
past that the run stops with ``error`` set (exit code 1), never as a success.

Exactly-once: aggregators hold their acks until the server accepts the partial that contains an
update. A partial that overlaps devices already covered is refused: a normal partial's updates are
requeued and come back one by one (``singleton`` partials, built from redelivered messages), and a
singleton for a covered device is a duplicate. So a crashed aggregator or a replayed update changes
nothing in the result.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.common import MessageHandler, PublishItem, ServiceBase, decode_tensors
from services.server import checkpoint, fanout
from services.server.leases import Leases
from services.server.ledger import RoundOutcome, RunLedger
from services.server.registry import DeviceNeed, DeviceRegistry, OnlineChances
from services.server.round import EvaluationState, Phase, RepeatPolicy, RoundState
from shared import metrics
from shared.algorithms.base import Partial, ServerState, TaskSpec, derive_seed
from shared.config import ExperimentConfig
from shared.devices import dropout_point, over_select
from shared.experiment import Experiment
from shared.provision import BrokerAdmin, ProvisionError, new_host
from shared.schemas import (
    ANSWER_KINDS,
    KIND_SINCE,
    MAX_GOS,
    Answers,
    DeviceState,
    Envelope,
    EvalResult,
    Fetch,
    Flush,
    Go,
    Gos,
    Heartbeat,
    Join,
    JoinReply,
    Kind,
    MetricKey,
    Ready,
    Receipt,
    Receipts,
    Reject,
    RoundOpen,
    RoundSummary,
    Stop,
    encode,
    new_incarnation,
    task_key,
    verify,
)
from shared.schemas import Decision as DecisionMsg
from shared.schemas import Partial as PartialMsg
from shared.schemas import _Body as Body
from shared.transport import (
    KEY_AGGREGATORS,
    KEY_CLIENTS,
    KEY_JOIN,
    KEY_SERVER,
    KEY_UPDATE,
    Delivery,
    Transport,
    Unroutable,
    key_aggregator,
    key_host,
    split,
)

FLUSH_RETRY_S = 1.0
#: how often an open round's ``round_open`` is repeated for aggregators that started after it
ROUND_OPEN_REPEAT_S = 2.0
#: how long a host that got a broker user may take to send its first heartbeat before the user is
#: deleted: its broker connection may wait out its whole reconnect budget
#: (``FEDFLEET_RECONNECT_BUDGET_S``, 120 s by default: a broker node failing over), then it
#: heartbeats at once; a backlog in the server's queue may delay that heartbeat further
FIRST_HEARTBEAT_GRACE_S = 300.0


class Server(ServiceBase):
    service = "server"

    def __init__(
        self,
        transport: Transport,
        exp: Experiment,
        run_dir: Path,
        *,
        experiment_id: str,
        flush_timeout_s: float = 30.0,
        admin: BrokerAdmin | None = None,
        repeat: RepeatPolicy | None = None,
    ) -> None:
        cfg = exp.cfg
        super().__init__(transport, experiment_id, cfg.algorithm.name, cfg.processes.max_message_bytes)
        self.exp = exp
        self.cfg: ExperimentConfig = cfg
        self.strategy = exp.strategy
        self.run_dir = run_dir
        self.flush_timeout_s = flush_timeout_s
        self.incarnation = new_incarnation()  # random: tells this start from any other
        #: every device of the fleet, as strategies plan for it (tier, samples, profile), made on access
        self.registry: DeviceRegistry = self._device_infos(exp)
        #: who is online in a round (selection), from each device's p_online read once
        self.online_chances = OnlineChances(exp.fleet)
        self.leases = Leases(
            cfg.num_devices,
            self._host_need(exp),
            run_dir / "device-state",
            lambda key, kind, body: self.send(key, kind, body, round=self.round, inc=self.incarnation),
            experiment=experiment_id,
            lease_timeout_s=cfg.hosts.lease_timeout_s,
        )
        self.ledger = RunLedger(experiment_id, cfg.algorithm.name)
        self.ledger.registered(self.registry)
        #: the number of the last round opened (0 before the first)
        self.round = 0
        self.phase = Phase.REGISTERING
        self.state: ServerState = self.strategy.init_state()
        self.registration_deadline = self.ledger.started + cfg.registration_timeout_s
        #: the open round (None between rounds)
        self.rs: RoundState | None = None
        #: (round, selection, tasks) planned for a round that has not opened yet (no aggregator)
        self._planned: tuple[int, tuple[int, ...], dict[int, TaskSpec]] | None = None
        self.evaluation: EvaluationState | None = None
        self.last_retry = 0.0
        #: how lost rounds are repeated (default: the broker settings' budget and backoff)
        self.repeat = repeat if repeat is not None else RepeatPolicy.from_settings()
        #: since when no client host has served any device (None: some host does)
        self._no_hosts_since: float | None = None
        #: the ledger's journal beside the checkpoints (opened by ``_resume``)
        self.journal: checkpoint.Journal
        self.resumed = self._resume()
        self.error: str | None = None
        self._phases: dict[Phase, Callable[[float], None]] = {
            Phase.REGISTERING: self._tick_registering,
            Phase.SETTLING: self._tick_settling,
            Phase.WAITING: self._tick_waiting,
            Phase.OPEN: self._tick_open,
            Phase.FLUSHING: self._tick_flushing,
            Phase.EVALUATING: self._tick_evaluating,
            Phase.REPEATING: self._tick_repeating,
        }

        #: gives joining hosts broker users of their own (None: hosts come with their users)
        self.admin = admin
        #: hosts with a broker user of this experiment, with when this server made it or found it
        #: (``_adopt_host_users``); deleted when they leave or expire, or never heartbeat
        #: (``_check_hosts``), or at the end (``forget_hosts``)
        self.provisioned: dict[str, float] = {}
        #: those of them found on the broker rather than made here (``_adopt_host_users``)
        self.adopted: set[str] = set()
        self.first_heartbeat_grace_s = FIRST_HEARTBEAT_GRACE_S
        self._adopt_host_users()
        transport.declare_queue(transport.names.server_queue, [KEY_SERVER, KEY_JOIN])
        transport.declare_queue(transport.names.updates_queue, [KEY_UPDATE])
        handlers = self._handlers()
        #: what an entry of an ``answers`` may be, built once rather than per message
        self._answer_handlers = {kind: handlers[kind] for kind in ANSWER_KINDS}
        transport.consume(transport.names.server_queue, lambda d: self.dispatch(d, handlers), prefetch=64)
        self._create_series()
        self.log.info(
            "server ready",
            extra={"event": "server_ready", "f_incarnation": self.incarnation, "f_resumed_round": self.round},
        )

    def _handlers(self) -> dict[Kind, MessageHandler]:
        """What the server acts on, by message kind (anything else is dead-lettered)."""
        return {
            Kind.JOIN: self.on_join,
            Kind.FETCH: self.on_fetch,
            Kind.HEARTBEAT: self.on_heartbeat,
            Kind.DEVICE_STATE: self.on_device_state,
            Kind.RECEIPT: self.on_receipt,
            Kind.RECEIPTS: self.on_receipts,
            Kind.REJECT: self.on_reject,
            Kind.PARTIAL: self.on_partial,
            Kind.READY: self.on_ready,
            Kind.EVAL_RESULT: self.on_eval_result,
            Kind.ANSWERS: self.on_answers,
        }

    def on_answers(self, env: Envelope, msg: Answers, d: Delivery) -> None:
        """Each message of a host's ``answers`` as if it had come alone, with every check a lone one
        gets (its kind among ``ANSWER_KINDS``, its sender's role, its MAC), on a delivery of its own
        (``split``): one that fails is dead-lettered alone; the ``answers`` is acked once all are
        settled."""
        for part in split(d, msg.messages):
            self.dispatch(part, self._answer_handlers, entry=True)

    def _create_series(self) -> None:
        """Create the labelled series now: a histogram appears only at its first observation, and a
        short run could otherwise end between two scrapes with nothing for rate() to work on."""
        labels = (self.experiment, self.algorithm)
        metrics.DENSITY.labels(*labels).set(self.strategy.density(self.state))
        metrics.ROUND_DURATION.labels(*labels)
        metrics.ROUND_VIRTUAL_DURATION.labels(*labels)
        for outcome in ("completed", "below-quorum", "lost"):
            metrics.ROUNDS_COMPLETED.labels(*labels, outcome)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The ``rounds.csv`` rows so far."""
        return self.ledger.rows

    @property
    def ready_protocol(self) -> bool:
        """Rounds keep the first finishers (over-selection or an emulated deadline): devices report
        ``ready`` and upload only on ``go``."""
        emu = self.cfg.emulation
        return emu.over_selection > 1 or emu.round_deadline_s is not None

    # -- handlers --------------------------------------------------------------------------------
    @staticmethod
    def _device_infos(exp: Experiment) -> DeviceRegistry:
        """What every device is, from the experiment every process builds identically: a view that
        makes a device's ``DeviceInfo`` when asked, holding none for idle devices (issue 16)."""
        return DeviceRegistry(exp.fleet, exp.partitions)

    @staticmethod
    def _host_need(exp: Experiment) -> DeviceNeed:
        """Memory a device's largest task may take on its host: its budget, at most the full model
        (admission refuses anything above the budget, and no task is larger than the full model);
        made on first use, as one array (``DeviceNeed``)."""
        return DeviceNeed(exp.fleet, exp.full_footprint_bytes)

    def on_join(self, env: Envelope, msg: Join, d: Delivery) -> None:
        """A new client process asks for a broker user of its own (see ``shared.provision``)."""
        if self.admin is None or not d.reply_to:
            self.reject(d, "no-provisioning", "this server makes no broker users (FEDFLEET_BROKER_ADMIN_URL)")
            return
        # more hosts than devices: nothing to serve. A user found on the broker counts once its host
        # heartbeats: until then it may be the user of a host that died with the old server (deleted
        # after the first-heartbeat grace), and a host joining meanwhile must not be turned away
        joined = len(self.provisioned) - len(self.adopted - self.leases.table.hosts.keys())
        if joined >= self.cfg.num_devices:
            self.reject(d, "too-many-hosts", f"{joined} hosts already joined")
            return
        host_id, password = new_host()
        try:
            user = self.admin.create_host_user(self.experiment, host_id, password)
        except ProvisionError as err:
            self.log.error("cannot make a broker user: %s", err, extra={"event": "provision_failed"})
            self.reject(d, "provision-failed", str(err))
            return
        self.provisioned[host_id] = time.time()
        reply = encode(
            Kind.JOIN_REPLY,
            JoinReply(host_id=host_id, user=user, password=password),
            exp=self.experiment,
            round=0,
            sender=self.service,
            version=env.v,  # in the joining build's own version (docs/wire.md)
        )
        try:
            self.transport.publish_reply(d.reply_to, reply)
        except Unroutable:  # nobody can ask that way here (in one process): nobody can use that user
            self._forget_host(host_id)
        self.log.info("made broker user %s for a joining host (%s)", user, msg.hint, extra={"event": "join"})
        d.ack()

    def _forget_host(self, host_id: str) -> None:
        """Delete the broker user (and queue) of a host that left or died."""
        if self.admin is not None and host_id in self.provisioned:
            del self.provisioned[host_id]
            self.adopted.discard(host_id)
            try:
                self.admin.delete_host(self.experiment, host_id)
            except ProvisionError as err:
                self.log.warning(
                    "cannot delete host %s's user: %s", host_id, err, extra={"event": "provision"}
                )

    def release_host_users(self) -> None:
        """As the server process ends: delete the run's host users if the run is over (done, or
        failed before it began: the hosts got ``stop`` and closed meanwhile); if it was stopped
        mid-run (SIGTERM: an upgrade, a replaced pod), leave them. The hosts go on, and the next
        server of this experiment takes their users over (``_adopt_host_users``): deleting them
        would cut every live host off, and race a successor already making users of its own."""
        if self.phase == Phase.DONE or self.error:
            self.forget_hosts()
        elif self.provisioned:
            self.log.info(
                "left %d host users for the next server of this experiment",
                len(self.provisioned),
                extra={"event": "host_users_left"},
            )

    def forget_hosts(self) -> None:
        """After the run: delete every broker user made for it (the hosts got ``stop`` and closed),
        by this server or before it restarted — listed again here in case the listing at start
        failed."""
        self._adopt_host_users(when="at the end of the run")
        for host_id in sorted(self.provisioned):
            self._forget_host(host_id)

    def _adopt_host_users(self, when: str = "made before this server started") -> None:
        """Take over the host users the broker already has for this experiment, as if just made.

        A server that crashed or whose pod was replaced made them, and they would otherwise work
        until someone deleted them by hand. Adopted, each lives by the rules of any other: a host
        that heartbeats again keeps its user (and its devices, ``Heartbeat.holding``) until it
        leaves or expires; one that sends no heartbeat within ``first_heartbeat_grace_s`` has died
        with the old server and loses it; the end of the run deletes them all.

        Why ask the broker rather than keep ``provisioned`` in the checkpoint: the broker's list is
        the truth, while a checkpoint is written only after a round, so the users made during
        registration or since the last round would still be lost; nor does it change the checkpoint
        format. ``BrokerAdmin.host_ids`` scopes the list to this vhost, user prefix and experiment.
        """
        if self.admin is None:
            return
        try:
            found = self.admin.host_ids(self.experiment)
        except ProvisionError as err:
            self.log.error(
                "cannot list the broker's host users (those made before a restart stay): %s",
                err,
                extra={"event": "provision_failed"},
            )
            return
        now = time.time()
        adopted = [host_id for host_id in found if host_id not in self.provisioned]
        for host_id in adopted:
            self.provisioned[host_id] = now
        self.adopted.update(adopted)
        if adopted:
            self.log.info(
                "found %d host user(s) %s: %s",
                len(adopted),
                when,
                adopted[:10],
                extra={"event": "host_users_adopted"},
            )

    def on_heartbeat(self, env: Envelope, msg: Heartbeat, d: Delivery) -> None:
        sender = self.sender(d)
        if self.strict and msg.host_id != sender.host_id:
            self.reject(d, "wrong-sender", f"heartbeat for host {msg.host_id} from {sender}")
            return
        # an epoch is only meaningful in the incarnation that issued it (a restart starts over)
        epoch = msg.epoch if env.inc == self.incarnation else -1
        self.leases.heartbeat(msg, epoch, time.time())
        d.ack()

    def _host(self, env: Envelope, d: Delivery) -> str:
        """The host a message comes from: its broker user's (strict), its own word (dev mode)."""
        sender = self.sender(d)
        return sender.host_id or "" if self.strict else env.sender

    def on_device_state(self, env: Envelope, msg: DeviceState, d: Delivery) -> None:
        host = self._host(env, d)
        if not self.leases.device_state(host, msg):
            self.reject(d, "not-leased", f"{host} does not hold device {msg.device_id}")
            return
        d.ack()

    def _open(self, env: Envelope) -> RoundState | None:
        """The open round if ``env`` belongs to it (this incarnation, this round, open or flushing)."""
        rs = self.rs
        current = rs is not None and env.inc == self.incarnation and env.round == rs.number
        # a lost round waiting to be repeated takes its late answers: they count for the repeat
        return rs if current and self.phase in (Phase.OPEN, Phase.FLUSHING, Phase.REPEATING) else None

    def on_receipt(self, env: Envelope, msg: Receipt, d: Delivery) -> None:
        if (rs := self._open(env)) is not None:
            self._receipt(rs, msg)
        d.ack()

    def on_receipts(self, env: Envelope, msg: Receipts, d: Delivery) -> None:
        """One aggregator turn's receipts: each as a lone ``Receipt``, one ack for all."""
        if (rs := self._open(env)) is not None:
            for receipt in msg.receipts:
                self._receipt(rs, receipt)
        d.ack()

    def _receipt(self, rs: RoundState, msg: Receipt) -> None:
        if msg.refused:
            self._update_refused(rs, msg)
        else:
            rs.receipt(msg)

    def _update_refused(self, rs: RoundState, msg: Receipt) -> None:
        """An aggregator dead-lettered the device's update as out of bounds: the device has answered,
        with nothing to merge — counted as a refusal with the aggregator's reason."""
        dev = msg.device_id
        if not rs.is_selected(dev) or dev in rs.receipts or dev in rs.rejects or dev in rs.covered:
            return
        rs.rejects[dev] = Reject(device_id=dev, reason=msg.refused, detail="update out of bounds")
        self.log.warning(
            "device %d's update was out of bounds (%s): not merged",
            dev,
            msg.refused,
            extra={"event": "update_out_of_bounds", "device": dev, "reason": msg.refused},
        )

    def on_reject(self, env: Envelope, msg: Reject, d: Delivery) -> None:
        rs = self._open(env)
        if rs is None or not rs.is_selected(msg.device_id):
            d.ack()
            return
        if self._forged(env, rs.key, msg.device_id, d, "refusal"):
            return
        if msg.reason == "dropout":
            # a virtual-time dropout notice: the device will never answer (see the client)
            rs.discarded.setdefault(msg.device_id, "dropout")
        elif msg.device_id not in rs.rejects:
            rs.rejects[msg.device_id] = msg
            self.ledger.refused(msg.reason, msg.device_id, msg.footprint_bytes)
            self.log.info(
                "device %d refused its task: %s (%s)",
                msg.device_id,
                msg.reason,
                msg.detail,
                extra={"event": "reject", "device": msg.device_id, "reason": msg.reason},
            )
        d.ack()

    def on_ready(self, env: Envelope, msg: Ready, d: Delivery) -> None:
        rs = self._open(env)
        if rs is not None and rs.is_selected(msg.device_id) and not rs.go_sent:
            if self._forged(env, rs.key, msg.device_id, d, "ready"):
                return
            rs.readies[msg.device_id] = msg
        d.ack()

    def on_partial(self, env: Envelope, msg: PartialMsg, d: Delivery) -> None:
        rs = self._open(env)
        if rs is None:
            accepted, reason = False, "stale"
        else:
            accepted, reason = rs.decide_partial(msg.devices, msg.singleton)
            if accepted:
                rs.merge(
                    self.strategy, Partial.from_wire(decode_tensors(msg.tensors), msg.scalars), msg.devices
                )
            elif reason in ("duplicate", "overlap"):
                self.log.info(
                    "refused partial %s/%d: devices already covered",
                    msg.aggregator_id,
                    msg.seq,
                    extra={"event": "partial_refused"},
                )
        self.send(
            key_aggregator(msg.aggregator_id),
            Kind.DECISION,
            DecisionMsg(seq=msg.seq, accepted=accepted, reason=reason),
            round=env.round,
            inc=env.inc,
        )
        d.ack()

    def on_eval_result(self, env: Envelope, msg: EvalResult, d: Delivery) -> None:
        ev = self.evaluation
        if (
            self.phase == Phase.EVALUATING
            and ev is not None
            and env.inc == self.incarnation
            and msg.device_id in ev.expected
        ):
            if self._forged(env, ev.key, msg.device_id, d, "evaluation result"):
                return
            ev.results[msg.device_id] = msg
        d.ack()

    def _forged(self, env: Envelope, round_key: str, device_id: int, d: Delivery, what: str) -> bool:
        """Dead-letter a device's message that is not its own: ``forged`` when it lacks the MAC of its
        bytes under the device's task key, ``not-leased`` when its host does not hold the device."""
        if not verify(env, task_key(round_key, env.round, device_id)):
            self.reject(d, "forged", f"{what} for device {device_id} does not carry its task key's MAC")
            return True
        host = self.leases.table.host_of(device_id)
        if self.strict and host != self.sender(d).host_id:
            self.reject(d, "not-leased", f"{what} for device {device_id} from {self.sender(d)}, not its host")
            return True
        return False

    # -- timers: one method per phase ------------------------------------------------------------
    def tick(self) -> None:
        now = time.time()
        self._check_hosts(now)
        run = self._phases.get(self.phase)
        if run is not None:
            run(now)

    def _check_hosts(self, now: float) -> None:
        """Expire silent hosts. An open round stops waiting for a lost host's devices: they count as
        answered (silent) at once; their leases go to other hosts before the next round."""
        gone, left = self.leases.expire(now)
        for host in [*gone, *left]:
            self._forget_host(host.host_id)
        known = self.leases.table.hosts
        for host_id, made in list(self.provisioned.items()):
            if host_id not in known and now - made > self.first_heartbeat_grace_s:
                # killed between its join answer and its first heartbeat (the join's SIGTERM
                # handler cannot help with a SIGKILL), or, for a user found at start, gone with the
                # server before this one: nothing else would ever delete its user
                self.log.warning(
                    "host %s got (or was found with) a broker user %.0fs ago and never heartbeat; "
                    "deleting the user",
                    host_id,
                    now - made,
                    extra={"event": "host_never_started"},
                )
                self._forget_host(host_id)
        for host in gone:
            rs = self.rs
            if rs is None or self.phase not in (Phase.OPEN, Phase.FLUSHING, Phase.REPEATING):
                continue
            for dev in sorted(host.devices):
                # a merged update's receipt may still be on its way (it follows its partial)
                if rs.is_selected(dev) and dev not in rs.receipts and dev not in rs.covered:
                    rs.discarded.setdefault(dev, "host-lost")

    def _tick_registering(self, now: float) -> None:
        """Lease the fleet to the hosts that join; start once every device is served, at least
        ``hosts.min_hosts`` hosts joined and none joined for a moment (so the first round does not
        go to whoever came first), or at the registration deadline with a round's worth of devices."""
        settled = self.leases.settle()
        served, wanted = len(self.leases.table.available_ids()), self.cfg.num_devices
        quiet = now - self.leases.table.last_join >= self.cfg.hosts.join_quiet_s
        hosts = sum(not h.draining for h in self.leases.table.hosts.values())
        if settled and served >= wanted and quiet and hosts >= self.cfg.hosts.min_hosts:
            self._next()
        elif now > self.registration_deadline:
            if served >= self.cfg.devices_per_round and settled:
                self.log.warning(
                    "starting with %d of %d devices served by %d host(s) (%d wanted)",
                    served,
                    wanted,
                    hosts,
                    self.cfg.hosts.min_hosts,
                    extra={"event": "registration_timeout"},
                )
                self._next()
                return
            self.error = (
                f"only {served} of {wanted} devices were served by a client host within "
                f"{self.cfg.registration_timeout_s:.0f}s (need at least {self.cfg.devices_per_round}); "
                "are the client processes running and pointed at the same broker and experiment?"
            )
            self.log.error(self.error, extra={"event": "registration_failed"})
            self.stopped = True

    def _tick_settling(self, now: float) -> None:
        """Between rounds: wait until every host applied its lease (hosts that die meanwhile expire)."""
        if self.leases.settle():
            self.phase = Phase.BETWEEN
            self._next()

    def _tick_waiting(self, now: float) -> None:
        if now - self.last_retry >= FLUSH_RETRY_S:
            self.last_retry = now
            self._open_round()

    def _tick_open(self, now: float) -> None:
        rs = self.rs
        assert rs is not None
        if self.ready_protocol and not rs.go_sent:
            if rs.all_ready() or now >= rs.deadline:
                self._decide_uploads(rs)
            return
        if now - rs.last_announced >= ROUND_OPEN_REPEAT_S:
            self._announce(rs, now)
        if rs.all_accounted():
            if rs.settled():
                # every receipted update is already merged and every merged one receipted (an
                # aggregator that held them all sent its partial unasked, ahead of its receipts;
                # or the last answers were refusals): a flush would only cost a round trip
                self._finalize("completed" if rs.covered else "below-quorum")
            else:
                self._start_flush(rs, now)
        elif now >= rs.deadline:
            quorum = rs.quorum(self.cfg.devices_per_round, self.cfg.quorum_fraction)
            # a merged update whose receipt is still on its way counts: its partial went first
            if rs.answering() >= quorum:
                self._start_flush(rs, now)
            else:
                self._finalize("below-quorum")

    def _tick_flushing(self, now: float) -> None:
        rs = self.rs
        assert rs is not None
        if rs.settled():
            # a round nobody contributed to (every selected device unreachable) is no success
            self._finalize("completed" if rs.covered else "below-quorum")
        elif now >= rs.flush_deadline:
            lost = sorted(set(rs.receipts) - rs.covered)
            unreceipted = sorted(rs.covered - set(rs.receipts) - rs.earlier_receipts)
            rs.flush_timed_out = bool(lost)
            self.log.error(
                "flush timed out; %d receipted updates never arrived in a partial: %s; "
                "%d merged updates' receipts never arrived: %s",
                len(lost),
                lost[:10],
                len(unreceipted),
                unreceipted[:10],
                extra={"event": "flush_timeout"},
            )
            self._finalize("completed" if rs.covered else "below-quorum")
        elif now - rs.last_flush >= FLUSH_RETRY_S:
            self._broadcast_flush(rs, now)

    def _tick_repeating(self, now: float) -> None:
        """A lost round's pause is over: open it again, once every lease is applied (as any round)."""
        rs = self.rs
        assert rs is not None
        if now >= rs.resume_at and self.leases.settle():
            self._reopen(rs)

    def _tick_evaluating(self, now: float) -> None:
        ev = self.evaluation
        assert ev is not None
        if ev.done(now):
            missing = ev.missing()
            if missing:
                self.log.warning(
                    "evaluation closed without %d devices: %s",
                    len(missing),
                    missing[:10],
                    extra={"event": "evaluation_incomplete"},
                )
            self._finish()

    # -- the round -------------------------------------------------------------------------------
    def _select(self, round: int) -> tuple[list[int], int]:
        """Uniform random selection among the registered devices that are online this round.

        With over-selection, ceil(K x factor) are invited (FedScale-style over-commitment) and the
        first K finishers are kept. Returns (selected, number of registered devices offline).
        """
        rng = np.random.default_rng(derive_seed(self.cfg.seed, "select", round) % (2**32))
        # arrays, not lists of ints: every registered device passes through here each round, and
        # idle ones should cost next to nothing (issue 16); the same candidates in the same order
        registered = self.leases.table.available_ids()
        online = registered[self.online_chances.online(registered, round, self.cfg.seed)]
        picked = over_select(online, self.cfg.devices_per_round, self.cfg.emulation.over_selection, rng)
        return sorted(int(x) for x in picked), len(registered) - len(online)

    def _open_round(self) -> None:
        mark = self.bytes_published + self.bytes_consumed  # the round's broker traffic starts here
        number = self.round + 1
        if not self._hosts_serve(number):
            return
        selected, offline = self._select(number)
        started = time.time()
        deadline = started + self.cfg.round_timeout_s
        key = secrets.token_hex(16)
        holders = [self.leases.table.host_of(dev) or "" for dev in selected]
        # planned before the announcement, which lists the layouts of the round's payloads (an
        # update may then name its layout by digest); a plan is made once per round and selection
        tasks = self._plan(number, selected)
        out = self._fanout(Kind.TASK, tasks, selected, key, number)
        for layout in out.layouts.values():
            self.layouts.learn(layout)  # partials may name them too
        announcement = RoundOpen(
            selected=selected,
            deadline_unix=deadline,
            round_key=key,
            holders=holders,
            layouts=list(out.layouts.values()),
        )
        try:
            self.send(KEY_AGGREGATORS, Kind.ROUND_OPEN, announcement, round=number, inc=self.incarnation)
        except Unroutable:
            # No aggregator is listening (not started yet, or all gone): nothing could be aggregated,
            # so the round waits rather than burning its deadline.
            if self.phase != Phase.WAITING:
                self.log.warning("no aggregator is running; waiting", extra={"event": "no_aggregator"})
            self.phase = Phase.WAITING
            return
        self._planned = None
        rs = RoundState(
            number=number,
            selected=selected,
            offline=offline,
            key=key,
            started=started,
            deadline=deadline,
            announcement=announcement,
            last_announced=time.time(),
            tasks=tasks,
            faults_mark=self.transport.faults,
        )
        rs.broker_mark = mark
        rs.fanout = out
        self.rs, self.round, self.phase = rs, number, Phase.OPEN
        labels = (self.experiment, self.algorithm)
        metrics.ROUND.labels(*labels).set(number)
        metrics.ROUND_OPEN.labels(*labels).set(1)
        metrics.ROUND_STARTED.labels(*labels).set(started)
        metrics.ROUND_DEADLINE.labels(*labels).set(deadline)
        self.ledger.selected(rs)
        self._send_tasks(rs)
        self.log.info(
            "round %d opened with %d devices",
            number,
            len(selected),
            extra={"event": "round_open", "round": number},
        )

    def _reopen(self, rs: RoundState) -> None:
        """Open the next attempt of a round the broker lost: the same number, selection, key and
        tasks (so the devices train what they would have), routed to the devices' hosts as of now,
        announced again (an aggregator that knows the round takes it as the same one) and sent to
        the devices that have not answered yet — an answer that came late, during the pause, counts."""
        mark = self.bytes_published + self.bytes_consumed
        now = time.time()
        out = self._fanout(Kind.TASK, rs.tasks, rs.selected, rs.key, rs.number)
        rs.announcement = RoundOpen(
            selected=rs.selected,
            deadline_unix=now + self.cfg.round_timeout_s,
            round_key=rs.key,
            holders=[self.leases.table.host_of(dev) or "" for dev in rs.selected],
            layouts=list(out.layouts.values()),
        )
        try:
            self.send(
                KEY_AGGREGATORS, Kind.ROUND_OPEN, rs.announcement, round=rs.number, inc=self.incarnation
            )
        except Unroutable:  # no aggregator listening: try again in a moment, within the budget
            elapsed = now - (rs.first_lost or now)
            if elapsed > self.repeat.budget_s:
                self._give_up(rs, "no aggregator is listening to repeat it", elapsed)
                return
            rs.resume_at = now + FLUSH_RETRY_S
            return
        rs.started, rs.deadline, rs.last_announced = now, now + self.cfg.round_timeout_s, now
        rs.broker_mark, rs.fanout = mark, out
        self.phase = Phase.OPEN
        labels = (self.experiment, self.algorithm)
        metrics.ROUND_OPEN.labels(*labels).set(1)
        metrics.ROUND_STARTED.labels(*labels).set(now)
        metrics.ROUND_DEADLINE.labels(*labels).set(rs.deadline)
        self.ledger.selected(rs)
        silent = set(rs.selected) - rs.answered() - rs.covered  # merged: its receipt is on its way
        for dev in silent:  # sent again, maybe to another host: not written off before it can answer
            rs.unreachable.discard(dev)
            if rs.discarded.get(dev) == "host-lost":
                del rs.discarded[dev]
        self._send_tasks(rs, only=silent)
        self.log.info(
            "round %d opened again (attempt %d): tasks to the %d of %d devices that have not answered",
            rs.number,
            rs.attempt,
            len(silent),
            len(rs.selected),
            extra={"event": "round_open", "round": rs.number, "f_attempt": rs.attempt},
        )

    def _hosts_serve(self, number: int) -> bool:
        """Does any client host serve a device? A round with nobody to select is no round: the server
        waits for hosts (``Phase.WAITING``) within the reconnect budget, then fails the run. Before,
        a fleet whose hosts had all lost the broker ran its remaining rounds with 0 devices each and
        ended 0. (Devices offline by the emulation's availability model are another matter: they are
        served, just not online, and such a round opens as usual.)"""
        self.leases.settle()  # hosts that came back get their leases
        if self.leases.table.available_ids().size:
            self._no_hosts_since = None
            return True
        now = time.time()
        if self._no_hosts_since is None:
            self._no_hosts_since = now
            self.log.warning(
                "no client host serves any device; round %d waits", number, extra={"event": "no_hosts"}
            )
        elif now - self._no_hosts_since > self.repeat.budget_s:
            self._fail(
                f"round {number}: no client host served any device for {now - self._no_hosts_since:.0f}s "
                f"(FEDFLEET_RECONNECT_BUDGET_S={self.repeat.budget_s:g}): are the client processes running "
                "and connected to the broker?",
                number,
            )
            return False
        self.phase = Phase.WAITING
        return False

    def _plan(self, number: int, selected: list[int]) -> dict[int, TaskSpec]:
        """The strategy's tasks for round ``number``: planned once, kept while the round waits for an
        aggregator (a strategy may advance its own state when it plans)."""
        if self._planned is not None and self._planned[:2] == (number, tuple(selected)):
            return self._planned[2]
        tasks = self.strategy.plan(self.state, number, selected, self.registry)
        self._planned = (number, tuple(selected), tasks)
        return tasks

    def _send_tasks(self, rs: RoundState, only: set[int] | None = None) -> None:
        """Publish every selected device's task, or those of ``only`` (shared parts once per host:
        see ``fanout``); a task nobody can receive makes its device unreachable for the round."""
        assert rs.fanout is not None
        sending = rs.fanout if only is None else _only(rs.fanout, only)
        # One broker round trip for the whole fan-out, not one confirm per device; and in virtual
        # time one ``tasks`` message per host that reads them (version 7), not one ``task`` per
        # device. Not in real time: a host acks a ``tasks`` once every entry is answered, and there
        # each device's download and upload are slept through one after the other, so a host's
        # round could outlast the broker's delivery acknowledgement timeout (``consumer_timeout``,
        # 30 minutes by default) where lone tasks wait at most ``client_prefetch`` devices' time.
        batch = self.cfg.emulation.time_mode != "real"
        unroutable = fanout.publish(
            sending,
            self._publish_many,
            Kind.TASK,
            batched=lambda key: batch and self.peers.version_for(key) >= KIND_SINCE[Kind.TASKS],
            encode=lambda kind, body: encode(
                kind, body, exp=self.experiment, round=rs.number, sender="", inc=self.incarnation
            ),
        )
        for out in sending.tasks:
            if out.routing_key in unroutable:
                rs.unreachable.add(out.device)
                self.log.warning(
                    "no client hosts device %d any more", out.device, extra={"event": "unreachable"}
                )
                continue
            rs.task_bytes[out.device] = out.device_bytes
            rs.down_bytes += out.device_bytes
            rs.dense_down += out.dense_bytes
            self.ledger.task_sent(out.device, out.device_bytes)

    def _fanout(
        self, kind: Kind, tasks: dict[int, TaskSpec], devices: list[int], key: str, number: int
    ) -> fanout.Fanout:
        def envelope(k: Kind, body: Body) -> bytes:
            # no sender name: a task's bytes are a device's download, and the broker says who sent it
            return encode(k, body, exp=self.experiment, round=number, sender="", inc=self.incarnation)

        return fanout.build(
            kind,
            tasks,
            devices,
            host_of=lambda dev: self.leases.table.host_of(dev) or "-",
            route=key_host,
            task_key=lambda dev: task_key(key, number, dev),
            encode=envelope,
        )

    def on_fetch(self, env: Envelope, msg: Fetch, d: Delivery) -> None:
        """A host lost a payload of the current round (it restarted, say): send it again."""
        sources = [x.fanout for x in (self.rs, self.evaluation) if x is not None and x.fanout is not None]
        data = next((f.by_digest[msg.digest] for f in sources if msg.digest in f.by_digest), None)
        host = self._host(env, d)
        if data is None or not host:
            self.reject(d, "unknown-payload", f"no payload {msg.digest.hex()} in the open round")
            return
        self._publish_many([PublishItem(Kind.PAYLOAD, key_host(host), data)])
        d.ack()

    def _route(self, device: int) -> str:
        """Where a device's messages go: its host's key (only that host may read it)."""
        return key_host(self.leases.table.host_of(device) or "-")

    def _decide_uploads(self, rs: RoundState) -> None:
        """Keep the first ``devices_per_round`` finishers within the emulated deadline; discard the rest.

        Ranked by emulated finish time (ties by device id), so the choice is deterministic in virtual
        time and does not depend on which process happened to answer first.
        """
        rs.go_sent = True
        deadline = self.cfg.emulation.round_deadline_s
        kept = 0
        by_host: dict[str, list[Go]] = {}
        for ready in sorted(rs.readies.values(), key=lambda r: (r.finish_s, r.device_id)):
            if deadline is not None and ready.finish_s > deadline:
                upload, reason = False, "deadline"
            elif kept >= self.cfg.devices_per_round:
                upload, reason = False, "surplus"
            else:
                upload, reason = True, ""
                kept += 1
            if not upload:
                rs.discarded[ready.device_id] = reason
            go = Go(device_id=ready.device_id, upload=upload, reason=reason)
            by_host.setdefault(self._route(ready.device_id), []).append(go)
        # One message per host (``Gos``, each host's goes in rank order), and one broker round
        # trip for all of them: at 10,000 devices a round's ~1,300 ``go`` messages were a quarter of
        # its messages, and confirmed one by one ~2.5 s of the server's CPU per round under cProfile
        # (benchmarks/results-scale.md). Both versions this build writes (6 and 7) have ``gos``. A
        # host that is gone (its key unroutable) is quiet, as before: its devices' updates never
        # come, and the round's deadline decides.
        self._publish_many(
            [
                PublishItem(Kind.GOS, key, self._encode(Kind.GOS, Gos(goes=goes[i : i + MAX_GOS])))
                for key, goes in by_host.items()
                for i in range(0, len(goes), MAX_GOS)
            ]
        )

    def _encode(self, kind: Kind, body: Body) -> bytes:
        """A message of the open round from this server."""
        return encode(
            kind, body, exp=self.experiment, round=self.round, sender=self.service, inc=self.incarnation
        )

    def _announce(self, rs: RoundState, now: float) -> None:
        """Send the open round's ``round_open`` again (aggregators ignore a repeat).

        Why: an aggregator that starts after the round opened -- a late start, a scale-up, a
        restart -- never saw it, and cannot validate that round's updates: it can only put them
        back. If the aggregator that held them crashed, they would bounce between the broker and the
        newcomer until the flush deadline dropped them. Repeating the announcement lets it join.
        """
        rs.last_announced = now
        self._send_quietly(KEY_AGGREGATORS, Kind.ROUND_OPEN, rs.announcement)

    def _broadcast_flush(self, rs: RoundState, now: float) -> None:
        rs.last_flush = now
        self._announce(rs, now)  # first, so a late aggregator knows the round it is asked to flush
        self._send_quietly(KEY_AGGREGATORS, Kind.FLUSH, Flush())  # all gone: the flush deadline decides

    def _start_flush(self, rs: RoundState, now: float) -> None:
        self.phase = Phase.FLUSHING
        rs.flush_deadline = now + self.flush_timeout_s
        self._broadcast_flush(rs, now)

    def _send_quietly(self, key: str, kind: Kind, body: Body) -> None:
        """Send for the current round; nobody bound for ``key`` is not an error (e.g. every
        aggregator has exited, or a device's client is gone)."""
        with contextlib.suppress(Unroutable):
            self.send(key, kind, body, round=self.round, inc=self.incarnation)

    def _finalize(self, outcome: str) -> None:
        rs = self.rs
        assert rs is not None
        if outcome != "completed":
            why = rs.lost_to_broker(
                self._emulated_silent(rs),
                self.transport.faults > rs.faults_mark,
                real_time=self.cfg.emulation.time_mode == "real",
            )
            if why is not None:
                self._lose(rs, why)
                return
        merged = rs.merged if outcome == "completed" else None
        self.state = self.strategy.finalize(self.state, merged, rs.number)
        for what, n in getattr(self.strategy, "robust_counts", {}).items():  # robust aggregation only
            metrics.ROBUST_UPDATES.labels(self.experiment, self.algorithm, what).inc(n)
        participants = rs.participants() if merged is not None else []
        reported = self._participant_metrics(rs, participants)
        evaluation = self._round_evaluation(rs.number, reported)
        result = RoundOutcome(
            outcome=outcome,
            participants=participants,
            evaluation=evaluation,
            reported=reported,
            density=reported.get(MetricKey.DENSITY, self.strategy.density(self.state)),
            virtual_seconds=self._virtual_seconds(rs, participants),
            broker_bytes=self._broker_bytes(rs),
        )
        self.ledger.record_round(rs, result)
        self.log.info(
            "round %d %s: %d/%d participants, accuracy %s",
            rs.number,
            outcome,
            len(participants),
            len(rs.selected),
            f"{evaluation['accuracy']:.4f}" if "accuracy" in evaluation else "-",
            extra={"event": "round_done", "round": rs.number, "f_outcome": outcome},
        )
        summary = RoundSummary(
            outcome=outcome,
            accuracy=evaluation.get("accuracy"),
            loss=evaluation.get("loss"),
            participants=len(participants),
        )
        self._send_quietly(KEY_AGGREGATORS, Kind.ROUND_SUMMARY, summary)
        self.ledger.write_rows(self.run_dir)
        self._save_checkpoint()
        self.rs, self.phase = None, Phase.BETWEEN
        self._next()

    def _emulated_silent(self, rs: RoundState) -> set[int]:
        """Selected devices the emulation drops this round: in ``real`` time they send no notice."""
        fleet, seed = self.exp.fleet, self.cfg.seed
        return {d for d in rs.selected if dropout_point(fleet[d], rs.number, seed) is not None}

    def _lose(self, rs: RoundState, why: str) -> None:
        """Record the attempt as ``lost`` and open the round again after a pause — or, past the
        repeats or the reconnect budget, stop the run with one line saying why (exit code 1).

        Nothing of the attempt reaches the model: the strategy's ``finalize`` is not called, no
        evaluation runs, and the round is not checkpointed (a resumed run runs it again). The
        attempt's row in ``rounds.csv`` keeps the bytes it cost; the next attempt is a new
        ``RoundState`` of the same round, which takes the lost attempt's late answers (a slow device's
        receipt) while it waits, so what did arrive is not trained again.
        """
        now = time.time()
        result = RoundOutcome(
            outcome="lost",
            participants=[],
            evaluation={},
            reported={},
            density=self.strategy.density(self.state),
            virtual_seconds=0.0,
            broker_bytes=self._broker_bytes(rs),
        )
        self.ledger.record_round(rs, result)
        silent = sorted(rs.missing(self._emulated_silent(rs)))
        self.log.error(
            "round %d (attempt %d) lost to the broker: %s; silent devices %s",
            rs.number,
            rs.attempt,
            why,
            silent[:10],
            extra={"event": "round_lost", "round": rs.number, "f_attempt": rs.attempt, "f_outcome": "lost"},
        )
        summary = RoundSummary(outcome="lost", accuracy=None, loss=None, participants=0)
        self._send_quietly(KEY_AGGREGATORS, Kind.ROUND_SUMMARY, summary)
        self.ledger.write_rows(self.run_dir)
        first_lost = rs.first_lost if rs.first_lost is not None else now
        elapsed = now - first_lost
        pause = self.repeat.pause(rs.attempt)
        if rs.attempt > self.repeat.repeats or elapsed + pause > self.repeat.budget_s:
            self._give_up(rs, why, elapsed)
            return
        self.rs = RoundState(
            number=rs.number,
            selected=rs.selected,
            offline=rs.offline,
            key=rs.key,
            started=now,
            deadline=math.inf,
            announcement=rs.announcement,
            last_announced=now,
            tasks=rs.tasks,
            earlier_receipts=rs.earlier_receipts | set(rs.receipts),
            attempt=rs.attempt + 1,
            faults_mark=self.transport.faults,
            first_lost=first_lost,
            resume_at=now + pause,
        )
        self.phase = Phase.REPEATING

    def _give_up(self, rs: RoundState, why: str, elapsed: float) -> None:
        """No repeat left: results so far are written, the others told to stop, and the run fails."""
        lost = sum(r["round"] == rs.number and r["outcome"] == "lost" for r in self.rows)
        self._fail(
            f"round {rs.number} was lost to the broker {lost} times in {elapsed:.0f}s ({why}); "
            f"gave up after {lost - 1} repeats (at most {self.repeat.repeats}, within "
            f"FEDFLEET_RECONNECT_BUDGET_S={self.repeat.budget_s:g}): check the broker and the services' "
            f"amqp_* log events, or raise round_timeout_s ({self.cfg.round_timeout_s:g}s) if one local "
            "training takes longer",
            rs.number,
        )

    def _fail(self, error: str, number: int) -> None:
        """Stop the run as failed: ``error`` is its one line (``fedfleet server`` prints it and exits 1)."""
        self.error = error
        self.log.error(self.error, extra={"event": "run_failed", "round": number})
        self.phase = Phase.DONE
        self.write_results()
        for key in (KEY_CLIENTS, KEY_AGGREGATORS):
            self._send_quietly(key, Kind.STOP, Stop())
        self.stopped = True

    def _broker_bytes(self, rs: RoundState) -> int:
        """What the round put through the broker: everything the server sent and took, and every
        update (the aggregators' receipts name their sizes) — every message of the run but dead
        letters, which stay in their own queue, and the framing of the hosts' ``updates`` bundles
        (a few bytes a bundle, which no receipt names: ``fedfleet_wire_bytes_total{kind="updates"}``
        counts them; docs/wire.md, "Two byte counts")."""
        server = self.bytes_published + self.bytes_consumed - rs.broker_mark
        return server + sum(r.update_bytes + r.telemetry_bytes for r in rs.receipts.values())

    def _round_evaluation(self, round: int, reported: dict[str, float]) -> dict[str, float]:
        """Personalised algorithms: the participants' own test accuracy (each device evaluates its
        own model); otherwise the global model on the test set, every ``eval_every`` rounds."""
        if self.strategy.personalised:
            keys = {"accuracy": MetricKey.EVAL_ACCURACY, "loss": MetricKey.EVAL_LOSS}
            return {name: reported[key] for name, key in keys.items() if key in reported}
        if round % self.cfg.eval_every and round != self.cfg.rounds:
            return {}
        ev = self.strategy.evaluate(self.state, self.exp.dataset.x_test, self.exp.dataset.y_test)
        labels = (self.experiment, self.algorithm)
        if "accuracy" in ev:
            metrics.ACCURACY.labels(*labels).set(ev["accuracy"])
        if "loss" in ev:
            metrics.LOSS.labels(*labels).set(ev["loss"])
        return ev

    def _virtual_seconds(self, rs: RoundState, participants: list[int]) -> float:
        """Emulated round time: the slowest participant; with first finishers, the last kept
        finisher, or the emulated deadline if the round had to wait for it."""
        if not self.ready_protocol:
            return max(
                (rs.receipts[d].timings.total() for d in participants if d in rs.receipts), default=0.0
            )
        finishes = [rs.readies[d].finish_s for d in participants if d in rs.readies]
        short = len(participants) < min(self.cfg.devices_per_round, len(rs.selected))
        deadline = self.cfg.emulation.round_deadline_s
        return deadline if short and deadline is not None else max(finishes, default=0.0)

    @staticmethod
    def _participant_metrics(rs: RoundState, participants: list[int]) -> dict[str, float]:
        """Means of the metrics the round's participants reported.

        ``eval_*`` metrics are weighted by each device's ``eval_samples`` (its personal test split),
        the rest by its training samples, so a device with more data counts for more — as in the
        papers' "mean personalised accuracy" weighted over test samples.
        """
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for dev in participants:
            r = rs.receipts.get(dev)
            if r is None:
                continue
            for key, value in r.metrics.items():
                eval_metric = key.startswith("eval_")
                w = r.metrics.get(MetricKey.EVAL_SAMPLES, 1.0) if eval_metric else float(r.num_samples or 1)
                sums[key] = sums.get(key, 0.0) + w * value
                weights[key] = weights.get(key, 0.0) + w
        return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}

    def _next(self) -> None:
        """Open the next round, or — after the last — evaluate every device (personalised) or finish.

        Hosts that joined, left or died since the last round get their new leases first: the round
        opens only once every lease is applied (``Phase.SETTLING``), so its tasks reach bound queues.
        """
        more = self.round < self.cfg.rounds or self.strategy.personalised
        if more and not self.leases.settle():
            self.phase = Phase.SETTLING
            return
        if self.round < self.cfg.rounds:
            self._open_round()
        elif self.strategy.personalised:
            self._start_evaluation()
        else:
            self._finish()

    def _start_evaluation(self) -> None:
        """Ask every registered device to evaluate its personalised model on its own test split.

        The papers report the mean over all devices; a round's participants are only a sample. The
        evaluation messages are their own kind, so their bytes never mix with training traffic.
        """
        devices = self.leases.table.available()
        tasks = self.strategy.plan_evaluation(self.state, devices, self.registry)
        key = secrets.token_hex(16)
        out = self._fanout(Kind.EVALUATE, tasks, devices, key, self.round)
        unroutable = fanout.publish(out, self._publish_many, Kind.EVALUATE)
        sent = [t for t in out.tasks if t.routing_key not in unroutable]
        for t in sent:
            self.ledger.eval_sent(t.device, t.device_bytes)
        self.evaluation = EvaluationState(
            key=key,
            expected={t.device for t in sent},
            deadline=time.time() + self.cfg.round_timeout_s,
            down_bytes=sum(t.device_bytes for t in sent),
            fanout=out,
        )
        self.phase = Phase.EVALUATING
        self.log.info(
            "evaluating the personalised models of %d devices",
            len(self.evaluation.expected),
            extra={"event": "evaluate"},
        )

    def _finish(self) -> None:
        self.phase = Phase.DONE
        self.write_results()  # before stopping the others: a caller may treat their exit as "done"
        for key in (KEY_CLIENTS, KEY_AGGREGATORS):
            self._send_quietly(key, Kind.STOP, Stop())
        self.stopped = True

    # -- results and checkpoints -----------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        """What identifies the run in ``summary.json``."""
        return {
            "experiment": self.experiment,
            "name": self.cfg.name,
            "algorithm": self.algorithm,
            "transport": self.transport.kind,
            "dataset": self.cfg.dataset.name,
            "model": self.cfg.model.name,
            "seed": self.cfg.seed,
        }

    def summary(self) -> dict[str, Any]:
        return self.ledger.summary(self._meta(), self.evaluation)

    def write_results(self) -> None:
        self.ledger.write(
            self.run_dir,
            self._meta(),
            self.state.arrays,
            self.evaluation,
            f"{self.cfg.name} ({self.algorithm})",
        )

    def _save_checkpoint(self) -> None:
        whole = self.journal.compacting()
        ckpt = checkpoint.Checkpoint(
            self.round,
            self.state,
            self.ledger.to_checkpoint(),
            self.ledger.to_journal(whole=whole),
            snapshot=whole,
        )
        try:
            checkpoint.save(self.run_dir, ckpt, self.journal)
        except checkpoint.CheckpointError as err:  # the previous checkpoint stays the one to resume
            self.log.error("%s", err, extra={"event": "checkpoint_refused"})
        else:
            self.ledger.journaled()

    def _resume(self) -> bool:
        ckpt = checkpoint.load(self.run_dir)
        # appends continue the resumed checkpoint's journal; a new run starts it empty
        self.journal = checkpoint.Journal(self.run_dir, ckpt.mark if ckpt is not None else None)
        if ckpt is None:
            return False
        self.state, self.round = ckpt.state, ckpt.round
        self.ledger.restore(ckpt.ledger, ckpt.journal)
        self.log.info(
            "resuming after round %d from %s",
            self.round,
            self.run_dir / "checkpoint",
            extra={"event": "resume"},
        )
        if self.round >= self.cfg.rounds and not self.strategy.personalised:
            self.phase = Phase.DONE  # (a personalised run still owes its all-device evaluation)
        return True

    def run(self, poll_s: float = 0.05) -> None:
        if self.phase == Phase.DONE:  # resumed a finished run: rewrite results and say so
            self.write_results()
            return
        super().run(poll_s)


def _only(out: fanout.Fanout, devices: set[int]) -> fanout.Fanout:
    """The part of a fan-out that goes to ``devices``: their tasks, and the payloads of their hosts."""
    tasks = [t for t in out.tasks if t.device in devices]
    hosts = {t.host for t in tasks}
    payloads = [p for p in out.payloads if p[0] in hosts]
    return fanout.Fanout(payloads=payloads, tasks=tasks, by_digest=out.by_digest, layouts=out.layouts)
