"""The client: one process hosting M emulated devices, whose limits it enforces.

For each task addressed to one of its devices it:

1. **admits** it — the task's training footprint (parameters, gradients, optimizer state, measured
   activations; ``Strategy.task_footprint``) against the device's memory budget; a task that does not
   fit is refused with a ``reject`` naming both numbers, never trained and never silently skipped;
2. emulates the **download** over the device's link (latency + bytes × 8 / bandwidth of the bytes
   actually received), then lets the device **drop out** if its availability coin says so;
3. **trains** with the strategy's client half and emulates **compute** time (task FLOPs / device
   FLOP/s);
4. emulates the **upload** of the encoded update and publishes it — or, when the round keeps only the
   first finishers, reports ``ready`` and waits for the server's ``go``.

Time is ``virtual`` (durations computed and carried in the update; nothing sleeps) or ``real`` (the
client sleeps them, divided by the time factor). A task is acked only after its outcome is published,
so a client killed mid-training loses nothing but time: its tasks wait in its durable queue.

Real mode serialises the devices of one process (one task at a time); run more client processes to
emulate many devices concurrently.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import MessageHandler, ServiceBase, decode_tensors, encode_tensors
from shared import metrics
from shared.algorithms.base import DeviceContext, TaskSpec, UpdateSpec, derive_seed
from shared.devices import Device, admit, dropout_point, emulate_compute, emulate_transfer, transfer_seconds
from shared.experiment import Experiment
from shared.schemas import (
    DeviceInfo,
    Envelope,
    EvalResult,
    Go,
    Kind,
    MetricKey,
    Ready,
    Register,
    Reject,
    Task,
    Timings,
    Update,
    encode,
)
from shared.transport import KEY_CLIENTS, KEY_SERVER, KEY_UPDATE, Delivery, Transport, Unroutable, key_task

REGISTER_EVERY_S = 10.0


@dataclass
class _Held:
    """A trained update waiting for the server's ``go`` (first-finishers rounds)."""

    body: bytes
    dense_bytes: int
    upload_s: float
    device: Device


class Client(ServiceBase):
    service = "client"

    def __init__(
        self,
        transport: Transport,
        exp: Experiment,
        *,
        experiment_id: str,
        client_id: str,
        device_ids: list[int],
        state_dir: Path,
        prefetch: int = 2,
    ) -> None:
        cfg = exp.cfg
        super().__init__(transport, experiment_id, cfg.algorithm.name, cfg.processes.max_message_bytes)
        bad = [d for d in device_ids if not 0 <= d < cfg.num_devices]
        if bad:
            raise ValueError(f"devices {bad[:5]} are outside the fleet of {cfg.num_devices} devices")
        self.exp = exp
        self.strategy = exp.strategy
        self.client_id = client_id
        self.device_ids = sorted(device_ids)
        self.state_dir = state_dir
        self.emulation = cfg.emulation
        self.fleet = {d.device_id: d for d in exp.fleet}
        #: first-finishers protocol: when on, devices report ``ready`` and upload only on ``go``
        self.ready_protocol = cfg.emulation.over_selection > 1 or cfg.emulation.round_deadline_s is not None
        self.held: dict[tuple[str, int, int], _Held] = {}
        for dev in self.device_ids:
            self._create_series(self.fleet[dev])
        self.data = {d: exp.device_data(d) for d in self.device_ids}
        self.last_register = 0.0
        names = transport.names
        own = names.client_queue(client_id)
        transport.declare_queue(own, [KEY_CLIENTS, *(key_task(d) for d in self.device_ids)])
        handlers: dict[Kind, MessageHandler] = {
            Kind.TASK: self.on_task,
            Kind.GO: self.on_go,
            Kind.EVALUATE: self.on_evaluate,
            Kind.STOP: self.on_stop,
        }
        transport.consume(own, lambda d: self.dispatch(d, handlers), prefetch=prefetch)
        self.register()
        self.log.info(
            "client %s hosts %d devices", client_id, len(self.device_ids), extra={"event": "client_ready"}
        )

    def _create_series(self, device: Device) -> None:
        """The device's budget gauge, and its tier's histogram series before their first observation
        (a short run could otherwise end between two scrapes with nothing for rate() to work on)."""
        metrics.MEMORY_BUDGET_BYTES.labels(self.experiment, device.tier).set(device.profile.memory_bytes)
        labels = (self.experiment, self.algorithm, device.tier)
        metrics.CLIENT_TRAIN_SECONDS.labels(*labels)
        clocks = ("virtual", "real") if self.emulation.time_mode == "real" else ("virtual",)
        for clock in clocks:
            metrics.CLIENT_COMPUTE_SECONDS.labels(*labels, clock)
            for direction in ("down", "up"):
                metrics.CLIENT_TRANSFER_SECONDS.labels(*labels, direction, clock)

    def register(self) -> None:
        """Announce the hosted devices; repeated every few seconds so a (re)started server learns them.

        Clients may not declare the server's queue (least privilege on the broker), so before the
        server exists a registration is unroutable: that is expected, and retried soon.
        """
        infos = [
            DeviceInfo(
                device_id=d,
                tier=self.fleet[d].tier,
                num_samples=len(self.data[d].y_train),
                profile=self.fleet[d].profile.model_dump(mode="json"),
            )
            for d in self.device_ids
        ]
        self.last_register = time.time()
        try:
            self.send(KEY_SERVER, Kind.REGISTER, Register(client_id=self.client_id, devices=infos), round=0)
        except Unroutable:
            self.log.info("no server yet; will register again", extra={"event": "register_retry"})
            self.last_register -= REGISTER_EVERY_S - 1.0  # retry in a second

    def tick(self) -> None:
        if time.time() - self.last_register >= REGISTER_EVERY_S:
            self.register()

    def on_stop(self, env: Envelope, msg: Any, d: Delivery) -> None:
        d.ack()
        self.stopped = True

    def _notify(self, env: Envelope, dev: int, body: Reject | Ready, kind: Kind) -> None:
        self.send(KEY_SERVER, kind, body, round=env.round, inc=env.inc, sender=f"device-{dev}")

    def _observe(self, metric: Any, tier: str, seconds: float, real_s: float | None, **labels: str) -> None:
        metric.labels(self.experiment, self.algorithm, tier, *labels.values(), "virtual").observe(seconds)
        if real_s is not None:
            metric.labels(self.experiment, self.algorithm, tier, *labels.values(), "real").observe(real_s)

    def on_task(self, env: Envelope, msg: Task, d: Delivery) -> None:
        """Admit, download, (maybe drop out,) train and upload — each step below is one method."""
        dev = msg.device_id
        if dev not in self.data:
            self.reject(d, "unknown-device", f"device {dev} is not hosted by {self.client_id}")
            return
        device = self.fleet[dev]
        task = TaskSpec(decode_tensors(msg.tensors), dict(msg.config))
        task_bytes = len(d.body)
        if self._admitted(env, msg, task, device, task_bytes):
            down_s = self._download(task, device, task_bytes)
            if not self._dropped_out(env, msg, device, task_bytes):
                update, compute_s = self._train(env, task, device)
                self._deliver(env, msg, update, device, task_bytes, down_s, compute_s)
        d.ack()

    def _admitted(self, env: Envelope, msg: Task, task: TaskSpec, device: Device, task_bytes: int) -> bool:
        """Memory admission: nothing ever trains over budget. A refused task is reported, never skipped."""
        dev, tier = device.device_id, device.tier
        extra = self.strategy.task_extra_peak(task, len(self.data[dev].y_train))
        verdict = admit(
            self.strategy.task_footprint(task), device.profile.memory_bytes, tier=tier, extra=extra
        )
        metrics.MEMORY_FOOTPRINT_BYTES.labels(self.experiment, self.algorithm, tier).set(
            verdict.footprint_bytes
        )
        if verdict.admitted:
            return True
        self.log.info(verdict.detail, extra={"event": "reject", "device": dev, "reason": verdict.reason})
        refusal = Reject(
            device_id=dev,
            reason=verdict.reason,
            detail=verdict.detail,
            footprint_bytes=verdict.footprint_bytes,
            budget_bytes=verdict.budget_bytes,
            task_bytes=task_bytes,
            token=msg.token,
        )
        self._notify(env, dev, refusal, Kind.REJECT)
        return False

    def _download(self, task: TaskSpec, device: Device, task_bytes: int) -> float:
        """Emulate the task's download over the device's link; returns its emulated seconds."""
        mode, factor = self.emulation.time_mode, self.emulation.time_factor
        t0 = time.perf_counter()
        messages = self.strategy.task_download_messages(task)
        down_s = emulate_transfer(
            task_bytes, device.profile, "down", mode=mode, time_factor=factor, messages=messages
        )
        real_s = time.perf_counter() - t0 if mode == "real" else None
        self._observe(metrics.CLIENT_TRANSFER_SECONDS, device.tier, down_s, real_s, direction="down")
        return down_s

    def _dropped_out(self, env: Envelope, msg: Task, device: Device, task_bytes: int) -> bool:
        """The device's availability coin for this round: True if it vanishes after the download."""
        dev = device.device_id
        if dropout_point(device, env.round, self.exp.cfg.seed) is None:
            return False
        self.log.info("device %d dropped out", dev, extra={"event": "dropout", "device": dev})
        if self.emulation.time_mode != "real":
            # In virtual time the server's deadline would pass at no cost; tell it now instead of
            # making it wait in wall time. In real mode the device just goes silent.
            notice = Reject(device_id=dev, reason="dropout", task_bytes=task_bytes, token=msg.token)
            self._notify(env, dev, notice, Kind.REJECT)
        return True

    def _train(self, env: Envelope, task: TaskSpec, device: Device) -> tuple[UpdateSpec, float]:
        """Train with the strategy's client half; returns the update and the emulated compute seconds
        of its FLOPs (the update's ``train_flops`` metric is set to them)."""
        dev, tier = device.device_id, device.tier
        mode, factor = self.emulation.time_mode, self.emulation.time_factor
        started = time.perf_counter()
        update = self.strategy.train(task, self._context(dev, env.round))
        trained_s = time.perf_counter() - started
        metrics.CLIENT_TRAIN_SECONDS.labels(self.experiment, self.algorithm, tier).observe(trained_s)
        # a strategy whose cost depends on what training produced (e.g. the density SpaFL reached)
        # reports it; otherwise the accountant's count of the task
        reported = update.metrics.get(MetricKey.TRAIN_FLOPS)
        flops = int(reported) if reported else self.strategy.task_flops(task, len(self.data[dev].y_train))
        compute_s = emulate_compute(
            flops, device.profile, mode=mode, time_factor=factor, measured_s=trained_s
        )
        real_s = time.perf_counter() - started if mode == "real" else None
        self._observe(metrics.CLIENT_COMPUTE_SECONDS, tier, compute_s, real_s)
        update.metrics = self._finite_metrics(dev, {**update.metrics, MetricKey.TRAIN_FLOPS: float(flops)})
        return update, compute_s

    def _finite_metrics(self, dev: int, reported: dict[str, float]) -> dict[str, float]:
        """Drop non-finite numbers a strategy reported (a diverged loss): the wire schema refuses them,
        and losing the whole update over a diagnostic would stall the round."""
        bad = sorted(k for k, v in reported.items() if not math.isfinite(v))
        if bad:
            self.log.warning(
                "device %d reported non-finite %s; not sent",
                dev,
                ", ".join(bad),
                extra={"event": "non_finite_metric", "device": dev},
            )
        return {k: v for k, v in reported.items() if k not in bad}

    def _deliver(
        self,
        env: Envelope,
        msg: Task,
        update: UpdateSpec,
        device: Device,
        task_bytes: int,
        down_s: float,
        compute_s: float,
    ) -> None:
        """Encode the update and upload it — or, in first-finishers rounds, hold it and report ``ready``."""
        dev = device.device_id
        tensors, dense = encode_tensors(update.tensors)

        def body(up_s: float) -> bytes:
            upd = Update(
                device_id=dev,
                num_samples=update.num_samples,
                tensors=tensors,
                metrics=update.metrics,
                task_bytes=task_bytes,
                timings=Timings(download_s=down_s, compute_s=compute_s, upload_s=up_s),
                token=msg.token,
            )
            return encode(
                Kind.UPDATE, upd, exp=self.experiment, round=env.round, sender=f"device-{dev}", inc=env.inc
            )

        # the wire size is known once encoded (timings are fixed-size floats, so filling them in
        # does not change it)
        up_s = transfer_seconds(len(body(0.0)), device.profile.uplink_bps, device.profile.latency_s)
        data = body(up_s)
        if self.ready_protocol:
            self.held[(env.inc, env.round, dev)] = _Held(data, dense, up_s, device)
            ready = Ready(
                device_id=dev, finish_s=down_s + compute_s + up_s, update_bytes=len(data), token=msg.token
            )
            self._notify(env, dev, ready, Kind.READY)
        else:
            self._upload(data, dense, device, up_s)

    def _upload(self, data: bytes, dense: int, device: Device, up_s: float) -> None:
        real = self.emulation.time_mode == "real"
        t0 = time.perf_counter()
        if real:  # pace the upload for real; the emulated duration is already known
            emulate_transfer(
                len(data), device.profile, "up", mode="real", time_factor=self.emulation.time_factor
            )
        self.publish_raw(KEY_UPDATE, Kind.UPDATE, data, dense_bytes=dense)
        real_s = time.perf_counter() - t0 if real else None
        self._observe(metrics.CLIENT_TRANSFER_SECONDS, device.tier, up_s, real_s, direction="up")

    def _context(self, dev: int, round: int) -> DeviceContext:
        return DeviceContext(
            device_id=dev,
            round=round,
            data=self.data[dev],
            state_dir=self.state_dir / f"device-{dev}",
            seed=derive_seed(self.exp.cfg.seed, "train", round, dev) % (2**32),
            tier=self.fleet[dev].tier,
        )

    def on_evaluate(self, env: Envelope, msg: Task, d: Delivery) -> None:
        """The all-device evaluation: the personalised model on the device's own test split."""
        dev = msg.device_id
        if dev not in self.data:
            self.reject(d, "unknown-device", f"device {dev} is not hosted by {self.client_id}")
            return
        task = TaskSpec(decode_tensors(msg.tensors), dict(msg.config))
        result = self.strategy.evaluate_device(task, self._context(dev, env.round))
        body = EvalResult(device_id=dev, supported=result is not None, metrics=result or {}, token=msg.token)
        self.send(KEY_SERVER, Kind.EVAL_RESULT, body, round=env.round, inc=env.inc, sender=f"device-{dev}")
        d.ack()

    def on_go(self, env: Envelope, msg: Go, d: Delivery) -> None:
        held = self.held.pop((env.inc, env.round, msg.device_id), None)
        if held is not None and msg.upload:
            self._upload(held.body, held.dense_bytes, held.device, held.upload_s)
        d.ack()
        # forget anything older than this round (a round can be abandoned by a server restart)
        for key in [k for k in self.held if k[1] < env.round]:
            del self.held[key]
