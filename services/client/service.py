"""The client: one process hosting M emulated devices.

For each task addressed to one of its devices it decodes the payload, asks whether the task fits the
device (admission — a refusal is a ``reject`` message, never a silent skip), trains with the
strategy's client half on that device's local data and private state directory, and publishes the
update. The task is acked only after the update (or the reject) is confirmed by the broker, so a
client killed mid-training loses nothing but time: its tasks wait in its durable queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common import MessageHandler, ServiceBase, decode_tensors, encode_tensors
from shared import metrics
from shared.algorithms.base import DeviceContext, TaskSpec, derive_seed
from shared.experiment import Experiment
from shared.schemas import DeviceInfo, Envelope, Kind, Register, Reject, Task, Update
from shared.transport import KEY_CLIENTS, KEY_SERVER, KEY_UPDATE, Delivery, Transport, Unroutable, key_task

REGISTER_EVERY_S = 10.0

#: admission hook: (device_id, task) -> a Reject to send, or None to train
Admission = Callable[[int, TaskSpec], Reject | None]


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
        admission: Admission | None = None,
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
        self.admission = admission
        self.data = {d: exp.device_data(d) for d in self.device_ids}
        self.last_register = 0.0
        names = transport.names
        own = names.client_queue(client_id)
        transport.declare_queue(own, [KEY_CLIENTS, *(key_task(d) for d in self.device_ids)])
        handlers: dict[Kind, MessageHandler] = {Kind.TASK: self.on_task, Kind.STOP: self.on_stop}
        transport.consume(own, lambda d: self.dispatch(d, handlers), prefetch=prefetch)
        self.register()
        self.log.info(
            "client %s hosts %d devices", client_id, len(self.device_ids), extra={"event": "client_ready"}
        )

    def register(self) -> None:
        """Announce the hosted devices; repeated every few seconds so a (re)started server learns them.

        Clients may not declare the server's queue (least privilege on the broker), so before the
        server exists a registration is unroutable: that is expected, and retried soon.
        """
        infos = [
            DeviceInfo(device_id=d, tier="default", num_samples=len(self.data[d].y_train))
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

    def on_task(self, env: Envelope, msg: Task, d: Delivery) -> None:
        dev = msg.device_id
        if dev not in self.data:
            self.reject(d, "unknown-device", f"device {dev} is not hosted by {self.client_id}")
            return
        task = TaskSpec(decode_tensors(msg.tensors), dict(msg.config))
        task_bytes = len(d.body)
        tier = "default"
        if self.admission is not None:
            refusal = self.admission(dev, task)
            if refusal is not None:
                refusal.task_bytes = task_bytes
                self.send(
                    KEY_SERVER, Kind.REJECT, refusal, round=env.round, inc=env.inc, sender=f"device-{dev}"
                )
                d.ack()
                return
        ctx = DeviceContext(
            device_id=dev,
            round=env.round,
            data=self.data[dev],
            state_dir=self.state_dir / f"device-{dev}",
            seed=derive_seed(self.exp.cfg.seed, "train", env.round, dev) % (2**32),
            tier=tier,
        )
        started = time.perf_counter()
        update = self.strategy.train(task, ctx)
        metrics.CLIENT_TRAIN_SECONDS.labels(self.experiment, self.algorithm, tier).observe(
            time.perf_counter() - started
        )
        tensors, dense = encode_tensors(update.tensors)
        self.send(
            KEY_UPDATE,
            Kind.UPDATE,
            Update(
                device_id=dev,
                num_samples=update.num_samples,
                tensors=tensors,
                metrics=update.metrics,
                task_bytes=task_bytes,
            ),
            round=env.round,
            inc=env.inc,
            dense_bytes=dense,
            sender=f"device-{dev}",
        )
        d.ack()
