"""The aggregator: a competing consumer of the experiment's one durable updates queue.

Each update is validated (envelope, round, device, duplicates, tensor shapes) and folded into a
running partial with the strategy's associative ``reduce`` — memory O(model), not O(updates) — and a
small receipt goes to the server. The update's *ack is held* until the server has accepted the
partial containing it (``decision``): if this process dies first, the broker redelivers the update to
another aggregator, which sends it on as a one-update ``singleton`` partial that the server can refuse
if it already has it. That is what makes an aggregator crash count every update exactly once.

Held acks are bounded: when ``prefetch - 1`` updates are held and no partial awaits its decision,
the aggregator flushes on its own. While one does, the broker's window only fills up and the decision
frees it: sending the one or two updates that arrived meanwhile as a partial of their own would cost
the server a whole model's decode and merge for them (issue 16: in three rounds of the 10,000-device
benchmark, 92 of the 188 partials held one update; at 50 devices per round, one partial in three).

Bounds (``_bounded``) are checked here, after the sender and shape checks and before the update is
reduced: once folded into a sum, one bad update can no longer be told apart or taken out, and the
server merges partials, not updates. Non-finite values and a ``num_samples`` above what the device
registered are always dead-lettered; ``bounds.max_update_norm`` rejects or clips.

The aggregator only adds arrays: this module and what it imports use numpy, never torch, and
``fedfleet aggregator`` builds ``Experiment.aggregation_strategy`` — torch-free for an algorithm whose
aggregation needs only the model's layout (issue 16, lean processes; ``tests/test_lean.py``).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.common import MessageHandler, ServiceBase, decode_tensors, encode_tensors
from shared import codec, metrics
from shared.algorithms.base import Partial, Strategy, UpdateSpec
from shared.codec import tensorset
from shared.config import BoundsConfig
from shared.schemas import (
    MAX_RECEIPTS,
    Decision,
    Envelope,
    Kind,
    Receipt,
    Receipts,
    RoundOpen,
    Update,
    Updates,
    encode,
    message_parts,
    task_key,
    verify,
)
from shared.schemas import Partial as PartialMsg
from shared.transport import (
    KEY_AGGREGATORS,
    KEY_SERVER,
    KEY_UPDATE,
    Delivery,
    Transport,
    key_aggregator,
    split,
)

if TYPE_CHECKING:
    from shared.data.partitioning import Partition
    from shared.experiment import Experiment

REQUEUE_PAUSE_S = 0.05


def registered_samples(exp: Experiment) -> SampleLimits:
    """The training samples each device has — what the server registers for it, and the most an
    update from it may claim (``num_samples`` weighs the update in every mean).

    Every device id the partition covers, without building the fleet: the fleet's profiles are sized
    by the model's training footprint, which needs torch (and the extra ids of a sparse fleet are
    harmless: an update from a device that was not selected is refused before its limit is read)."""
    return SampleLimits(exp.partitions, exp.cfg.num_devices)


class SampleLimits(Mapping[int, int]):
    """``device id → training samples`` for ids ``0..num_devices-1``, read from the partition on access.

    Why not a dict: one entry per registered device cost each aggregator ~100 bytes per device
    (~7 MiB each at 100,000 devices, issue 16) though a round looks up ~1,300 of them; the partition
    already answers ``size`` in O(1) without making a device's indices.
    """

    def __init__(self, partitions: Partition, num_devices: int) -> None:
        self._partitions = partitions
        self._n = num_devices

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._n))

    def __getitem__(self, device: int) -> int:
        if isinstance(device, bool) or not isinstance(device, int | np.integer) or not 0 <= device < self._n:
            raise KeyError(device)
        return self._partitions.size(int(device))


@dataclass
class _Batch:
    """Updates reduced into one partial, with the deliveries whose acks wait for the decision."""

    partial: Partial = field(default_factory=Partial)
    devices: list[int] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    singleton: bool = False


class Aggregator(ServiceBase):
    service = "aggregator"

    def __init__(
        self,
        transport: Transport,
        strategy: Strategy,
        *,
        experiment_id: str,
        algorithm: str,
        aggregator_id: str,
        prefetch: int,
        max_bytes: int,
        bounds: BoundsConfig | None = None,
        sample_limits: Mapping[int, int] | None = None,
    ) -> None:
        super().__init__(transport, experiment_id, algorithm, max_bytes)
        self.strategy = strategy
        self.bounds = bounds or BoundsConfig()
        #: the training samples each device registered: an update may claim at most that many
        #: (None: no limit known, e.g. a unit test without an experiment)
        self.sample_limits = sample_limits
        # One queue and one partial sequence per process session: a restarted aggregator must never
        # take an old session's decision for one of its own partials.
        self.aggregator_id = f"{aggregator_id}-{uuid.uuid4().hex[:8]}"
        self.prefetch = prefetch
        self.inc = ""
        self.round = -1
        self.selected: set[int] = set()
        self.round_key = ""  # the open round's key, from which each device's task key derives
        self.holders: dict[int, str] = {}  # the host serving each selected device (RoundOpen)
        self.round_layouts: dict[bytes, tensorset.Layout] = {}  # the open round's payload layouts
        self.batch = _Batch()
        self.pending: dict[int, _Batch] = {}
        #: receipts of this turn's accepted updates, by (round, incarnation): one ``Receipts`` each
        #: at the flush
        self.receipts: dict[tuple[int, str], list[Receipt]] = {}
        self.seen: set[int] = set()  # devices reduced in the current round by this aggregator
        self.seq = 0
        names = transport.names
        if self.strict:  # the server owns the updates queue; an aggregator may only consume it
            transport.wait_for_queue(names.updates_queue)
        else:
            transport.declare_queue(names.updates_queue, [KEY_UPDATE])
        # The queue is named after the aggregator's identity, not its session: a restart reuses it
        # rather than creating another (replicated, with quorum queues) queue. The session's own key
        # is bound to it; a decision that arrives on an older session's key is dropped (on_decision).
        self.queue = names.aggregator_queue(aggregator_id)
        transport.declare_queue(
            self.queue, [KEY_AGGREGATORS, key_aggregator(self.aggregator_id)], expires_s=600
        )
        own = self.queue
        control: dict[Kind, MessageHandler] = {
            Kind.ROUND_OPEN: self.on_round_open,
            Kind.FLUSH: self.on_flush,
            Kind.DECISION: self.on_decision,
            Kind.ROUND_SUMMARY: lambda env, body, d: d.ack(),
            Kind.STOP: self.on_stop,
        }
        transport.consume(own, lambda d: self.dispatch(d, control), prefetch=256)
        self._entry_handlers: dict[Kind, MessageHandler] = {Kind.UPDATE: self.on_update}
        data = {**self._entry_handlers, Kind.UPDATES: self.on_updates}
        transport.consume(names.updates_queue, lambda d: self.dispatch(d, data), prefetch=prefetch)
        metrics.AGGREGATION_SECONDS.labels(experiment_id, algorithm)  # series exists before the first update
        self.log.info("aggregator %s ready", aggregator_id, extra={"event": "aggregator_ready"})

    # -- control ---------------------------------------------------------------------------------
    def on_round_open(self, env: Envelope, msg: RoundOpen, d: Delivery) -> None:
        if env.inc == self.inc and env.round == self.round:
            d.ack()  # the server repeats an open round's announcement for late-starting aggregators
            return
        # Anything still held belongs to an older round or incarnation: those updates can no longer
        # count, so they are dead-lettered (not requeued, which would loop them forever).
        for batch in [self.batch, *self.pending.values()]:
            for delivery in batch.deliveries:
                self.reject(
                    delivery, "stale-round", f"round {self.round} closed before its partial was merged"
                )
        self.batch = _Batch()
        self.pending.clear()
        self.seen.clear()
        self.inc, self.round, self.selected = env.inc, env.round, set(msg.selected)
        self.round_key = msg.round_key
        self.holders = msg.holder()
        self.round_layouts = {tensorset.digest(layout): layout for layout in msg.layouts}
        d.ack()

    def unknown_layout(self, env: Envelope, delivery: Delivery, detail: str) -> None:
        """An update naming a layout of a round whose announcement has not reached us yet (a
        restarted aggregator, say) waits for it, as an update of an unannounced round does; in the
        open round, an unknown layout is a bad message."""
        if env.kind is Kind.UPDATE and self._unannounced(env):
            time.sleep(REQUEUE_PAUSE_S)
            delivery.nack(requeue=True)
            return
        self.reject(delivery, "unknown-layout", detail)

    def _unannounced(self, env: Envelope) -> bool:
        """Is this update of a round whose ``round_open`` has not reached us yet (the next one, or
        any before the first)? Then it waits for the announcement, put back on the queue."""
        return self.round < 0 or (env.inc == self.inc and env.round == self.round + 1)

    def on_flush(self, env: Envelope, msg: Any, d: Delivery) -> None:
        if env.inc == self.inc and env.round == self.round:
            self._send_batch()
        d.ack()

    def on_decision(self, env: Envelope, msg: Decision, d: Delivery) -> None:
        if d.routing_key != key_aggregator(self.aggregator_id):
            d.ack()  # an earlier session's decision, still bound to this identity's queue
            return
        batch = self.pending.pop(msg.seq, None)
        d.ack()
        if batch is None:
            return
        if msg.accepted:
            for delivery in batch.deliveries:
                delivery.ack()
            metrics.UPDATES.labels(self.experiment, self.algorithm, self.service, "merged").inc(
                len(batch.devices)
            )
        elif msg.reason == "overlap":
            # Some update in this batch was also reduced elsewhere (a duplicate that reached two
            # aggregators). Requeue all of them: they return one by one as singletons, and the server
            # decides each on its own.
            self.seen.difference_update(batch.devices)
            for delivery in batch.deliveries:
                delivery.nack(requeue=True)
        else:
            reason = "duplicate" if msg.reason == "duplicate" else msg.reason or "refused"
            for delivery in batch.deliveries:
                self.reject(delivery, reason, f"server refused partial {msg.seq}: {msg.reason}")
        self._send_if_full()  # the window this batch held is free again

    def on_stop(self, env: Envelope, msg: Any, d: Delivery) -> None:
        d.ack()
        self.stopped = True
        # The run is over: remove the queue rather than wait for its expiry.
        self.transport.delete_queue(self.queue)

    # -- data plane ------------------------------------------------------------------------------
    def on_updates(self, env: Envelope, msg: Updates, d: Delivery) -> None:
        """Each update of a host's ``updates`` as if it had come alone, with every check a lone one
        gets, on a delivery of its own (``split``): one that fails is dead-lettered alone, and the
        ``updates`` is acked once all are settled (their acks held until their partials' decisions,
        as a lone update's is).

        Entries of a round not announced yet are looked at first, from their envelopes: if all
        are, the whole message waits for the announcement (put back once, not once per entry);
        if only some are, which no honest host sends (a host's flush holds one round's updates),
        those are dead-lettered ``unknown-round`` and the others handled. Put back after entries
        were handled, a bundle would bring them back redelivered, again and again until the round
        opened.

        An ``overlap`` decision (a duplicate that reached two aggregators: one crashed) puts back
        the updates of a partial, and with each its whole bundle: the bundle's other entries come
        back redelivered and go as singletons, whichever of their two partials the server decides
        second is refused (``duplicate`` or ``overlap``), and each update counts once; this can
        repeat over the round's next bundles, which then go by singletons (more partials, the same
        model). An entry dead-lettered before that is dead-lettered again on the redelivery.

        The prefetch window counts these messages, the held-update bound (``_send_if_full``)
        their updates: a partial goes as soon as either fills. So an aggregator may hold up to
        ``processes.prefetch`` bundles, each of up to 64 updates and about 4 MiB (a host's flush,
        ``Client.outbox_full``; a bundle's size is capped at half ``processes.max_message_bytes``,
        as a lone message at the whole), with the bundle's bytes and its entries' copies both alive
        until its last entry is settled."""
        early = [self._unannounced_entry(m) for m in msg.messages]
        if all(early):
            time.sleep(REQUEUE_PAUSE_S)
            d.nack(requeue=True)
            return
        for part, wait in zip(split(d, msg.messages), early, strict=True):
            if d.settled:  # put back whole by an entry (an overlap meanwhile): the rest return with it
                break
            if wait:
                detail = "an update of a round not announced yet, bundled with updates of the open round"
                self.reject(part, "unknown-round", detail)
            else:
                self.dispatch(part, self._entry_handlers, entry=True)

    def _unannounced_entry(self, data: bytes) -> bool:
        """``_unannounced`` for an entry, from its envelope alone (a malformed one is not: its
        handling dead-letters it)."""
        try:
            env = message_parts(data)
        except Exception:  # anything undecodable is for ``dispatch`` to refuse, with its reason
            return False
        return env.kind is Kind.UPDATE and self._unannounced(env)

    def on_update(self, env: Envelope, msg: Update, d: Delivery) -> None:
        started = time.perf_counter()
        if self._unannounced(env):
            # The round_open for this update has not reached us yet: put it back briefly.
            time.sleep(REQUEUE_PAUSE_S)
            d.nack(requeue=True)
            return
        if not self._admissible(env, msg, d):
            return
        try:
            tensors = decode_tensors(msg.tensors)
        except codec.CodecError as err:
            if err.reason != "nonfinite":
                raise
            self._out_of_bounds(d, msg.device_id, env.round, "nonfinite", f"device {msg.device_id}: {err}")
            return
        update = UpdateSpec(tensors, msg.num_samples, dict(msg.metrics), msg.device_id, env.round)
        self.strategy.validate_update(update)
        if (bounded := self._bounded(update, d)) is None:
            return
        update = bounded
        if d.redelivered:
            # Possibly already merged via a partial of a crashed aggregator: send it alone so the
            # server can tell.
            metrics.UPDATES.labels(self.experiment, self.algorithm, self.service, "redelivered").inc()
            self.log.info(
                "redelivered update from device %d sent as a singleton partial",
                msg.device_id,
                extra={"event": "redelivered", "device": msg.device_id},
            )
            batch = _Batch(singleton=True)
            self._reduce_into(batch, update, d)
            self._receipt(env, msg, d, update)
            self._send(batch)
        else:
            self._reduce_into(self.batch, update, d)
            self.seen.add(msg.device_id)
            self._receipt(env, msg, d, update)
            if self.seen >= self.selected:
                # every device of the round reached this aggregator: nothing more can come, so the
                # partial goes now rather than when the server's flush asks for it (a round trip)
                self._send_batch()
            else:
                self._send_if_full()
        metrics.UPDATES.labels(self.experiment, self.algorithm, self.service, "reduced").inc()
        metrics.AGGREGATION_SECONDS.labels(self.experiment, self.algorithm).observe(
            time.perf_counter() - started
        )

    def _admissible(self, env: Envelope, msg: Update, d: Delivery) -> bool:
        """May this update count in the open round? Dead-letters it with the reason if not."""
        if env.inc != self.inc or env.round != self.round:
            self.reject(d, "unknown-round", f"round {env.round}/{env.inc} is not the open round {self.round}")
        elif msg.device_id not in self.selected:
            self.reject(d, "unknown-device", f"device {msg.device_id} was not selected for round {env.round}")
        elif not verify(env, task_key(self.round_key, env.round, msg.device_id)):
            self.reject(d, "forged", f"update for device {msg.device_id} does not carry its task key's MAC")
        elif self.strict and self.holders.get(msg.device_id) != self.sender(d).host_id:
            self.reject(
                d, "not-leased", f"update for device {msg.device_id} from {self.sender(d)}, not its host"
            )
        elif not d.redelivered and msg.device_id in self.seen:
            self.reject(d, "duplicate", f"second update from device {msg.device_id} in round {env.round}")
        else:
            return True
        return False

    def _bounded(self, update: UpdateSpec, d: Delivery) -> UpdateSpec | None:
        """The update within bounds (clipped if so configured), or None after dead-lettering it.

        Its tensors' values are finite already: ``decode_tensors`` refuses NaN and ±Inf in any kind
        of tensor (``codec.Limits.allow_nonfinite`` is off), which ``on_update`` dead-letters
        ``nonfinite`` as this would. Checking them again here took 2.2 % of an aggregator's samples in
        a py-spy profile of a 50-device FedAvg round (the workload of ``benchmarks/bench_rounds.py``)."""
        device = update.device_id
        if bad := [k for k, v in update.metrics.items() if not math.isfinite(v)]:
            detail = f"device {device}: non-finite metrics {bad[:3]}"
            self._out_of_bounds(d, device, update.round, "nonfinite", detail)
            return None
        limit = None if self.sample_limits is None or device is None else self.sample_limits.get(device)
        if limit is not None and update.num_samples > limit:
            detail = f"device {device} claims {update.num_samples} samples, registered {limit}"
            self._out_of_bounds(d, device, update.round, "num-samples", detail)
            return None
        bound = self.bounds.max_update_norm
        if bound is None:
            return update
        norm = math.sqrt(sum(_sum_squares(t) for t in update.tensors.values()))
        if norm <= bound:
            return update
        dense = all(isinstance(t, codec.Dense) for t in update.tensors.values())
        if self.bounds.on_norm_exceeded == "reject" or not dense:
            how = "" if dense or self.bounds.on_norm_exceeded == "reject" else " (only dense updates clip)"
            detail = f"device {device}: update norm {norm:.4g} above {bound:.4g}{how}"
            self._out_of_bounds(d, device, update.round, "update-norm", detail)
            return None
        scale = bound / norm
        metrics.UPDATE_BOUNDS.labels(self.experiment, self.algorithm, "clipped").inc()
        self.log.info(
            "clipped the update of device %s from norm %.4g to %.4g",
            device,
            norm,
            bound,
            extra={"event": "update_clipped", "device": device},
        )
        update.tensors = {
            k: codec.Dense((np.asarray(_values(t), dtype=np.float64) * scale).astype(_values(t).dtype))
            for k, t in update.tensors.items()
        }
        return update

    def _out_of_bounds(
        self, d: Delivery, device: int | None, round: int | None, reason: str, detail: str
    ) -> None:
        """Dead-letter an out-of-bounds update and tell the server the device's answer is in (a
        refusal), so the round does not wait for it until the deadline."""
        metrics.UPDATE_BOUNDS.labels(self.experiment, self.algorithm, reason).inc()
        size = len(d.body)
        self.reject(d, reason, detail)
        assert device is not None and round is not None
        refusal = Receipt(
            device_id=device,
            aggregator_id=self.aggregator_id,
            update_bytes=size,
            dense_bytes=0,
            num_samples=0,
            refused=reason,
        )
        self.send(KEY_SERVER, Kind.RECEIPT, refusal, round=round, inc=self.inc)

    def _reduce_into(self, batch: _Batch, update: UpdateSpec, d: Delivery) -> None:
        assert update.device_id is not None
        batch.partial = self.strategy.reduce(batch.partial, update)
        batch.devices.append(update.device_id)
        batch.deliveries.append(d)

    def _send_if_full(self) -> None:
        """Send the batch when the held updates fill the prefetch window (all but one place), unless
        a partial awaits its decision: that decision frees the window (``on_decision``)."""
        if not self.pending and self.held_updates() >= self.prefetch - 1:
            self._send_batch()

    def held_updates(self) -> int:
        """Updates whose acks wait for a decision. The broker's window (the prefetch) counts
        messages, and a host's ``updates`` is one message of up to 64: this may exceed it."""
        return len(self.batch.deliveries) + sum(len(b.deliveries) for b in self.pending.values())

    def _receipt(self, env: Envelope, msg: Update, d: Delivery, update: UpdateSpec) -> None:
        # held for the turn's ``Receipts``, not confirmed one by one: the update it reports is acked
        # only once its partial is decided, after the receipts went out (``_send`` flushes them
        # right after the partial), so a crash in between redelivers the update and it is
        # receipted again
        self.receipts.setdefault((env.round, env.inc), []).append(
            Receipt(
                device_id=msg.device_id,
                aggregator_id=self.aggregator_id,
                update_bytes=len(d.body) - env.telemetry_bytes,  # the device's own bytes
                dense_bytes=sum(codec.dense_bytes(t) for t in update.tensors.values()),
                num_samples=msg.num_samples,
                metrics=msg.metrics,
                timings=msg.timings,
                telemetry_bytes=env.telemetry_bytes,
            )
        )

    def flush(self) -> None:
        """The turn's receipts as one ``Receipts`` per round (at most ``MAX_RECEIPTS`` each), then
        everything queued, published."""
        held, self.receipts = self.receipts, {}
        for (round, inc), receipts in held.items():
            for i in range(0, len(receipts), MAX_RECEIPTS):
                chunk = Receipts(receipts=receipts[i : i + MAX_RECEIPTS])
                data = encode(
                    Kind.RECEIPTS, chunk, exp=self.experiment, round=round, sender=self.service, inc=inc
                )
                # queued, not ``publish_soon``: a full outbox would publish it (and a partial
                # before it) without the receipts still to come
                self._queue(KEY_SERVER, Kind.RECEIPTS, data)
        super().flush()

    def _send_batch(self) -> None:
        if self.batch.deliveries:
            batch, self.batch = self.batch, _Batch()
            self._send(batch)

    def _send(self, batch: _Batch) -> None:
        """The batch as a partial, then the turn's receipts (its updates' among them).

        Why the partial first: the server finishes a round once every selected device is accounted
        for, every receipted update merged and every merged update receipted. Receipts first, the
        last ones would find their partial still on its way and start a flush (a round trip to
        every aggregator) that the partial then makes moot. The server waits for the receipts of
        merged updates before it finishes the round (``RoundState.settled``): a receipt carries the
        device's bytes, timings and metrics.

        Why one transaction: published apart, a crash between the partial and its receipts left
        the server holding merged updates whose receipts would come only from the aggregator that
        gets them redelivered, and with no other aggregator the round waited for its flush
        deadline. On classic queues both now land or neither does (then the updates are
        redelivered and merged again), as long as they fit in one transaction (``TX_MAX_BYTES``,
        64 MiB): past it they go as several, the partial first, and a crash between them leaves
        the gap described next for quorum queues. Quorum queues take one confirm per message
        (``AmqpTransport.publish_many``), in the same order, so there the gap remains. The updates
        are acked only on the partial's decision, so a crash before it redelivers them, and another
        aggregator receipts them again (its singleton partial is refused as a duplicate)."""
        self.seq += 1
        self.pending[self.seq] = batch
        tensors, scalars = batch.partial.to_wire()
        encoded, dense = encode_tensors(tensors)
        body = PartialMsg(
            aggregator_id=self.aggregator_id,
            seq=self.seq,
            devices=batch.devices,
            singleton=batch.singleton,
            tensors=encoded,
            scalars=scalars,
        )
        data = encode(
            Kind.PARTIAL,
            body,
            exp=self.experiment,
            round=self.round,
            sender=self.service,
            inc=self.inc,
            known=self.round_layouts,
        )
        self._queue(KEY_SERVER, Kind.PARTIAL, data, dense_bytes=dense)
        self.flush()  # the partial, then the receipts: one transaction (up to TX_MAX_BYTES)


def _values(t: codec.Tensor) -> np.ndarray:
    """The values a tensor carries (without densifying a sparse or sliced one)."""
    return t.array if isinstance(t, codec.Dense | codec.Threshold) else t.values


def _sum_squares(t: codec.Tensor) -> float:
    values = np.asarray(_values(t), dtype=np.float64).ravel()
    return float(np.dot(values, values))
