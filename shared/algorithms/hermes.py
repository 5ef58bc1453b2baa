"""Hermes (Li et al., MobiCom '21): personalised structured-sparse subnetworks, overlap averaging.

Spec: ``docs/algorithms/hermes.md``. Each device learns its own *unit-structured* subnetwork of one
shared dense model: when the downloaded subnetwork is good enough on its validation split (the
accuracy gate), it removes the lowest-norm rows/filters at rate ``r_p`` per event, down to
``r_target`` of the parameters; it trains under its mask with a group-lasso penalty and sends back
only the kept weights (the mask travels as the payload's structure). The server keeps the dense model
``W`` and one mask per device, sends each device ``W ⊙ M_k``, and averages every coordinate over the
devices that kept it — coordinates nobody kept this round keep their old value — so pruned devices
never pull shared weights towards zero and a unit only one device holds stays that device's own.

The four halves, all here:

* **server** — ``init_state`` (dense model; masks ``mask/<device>/<layer>`` appear in
  ``ServerState.arrays`` at a device's first upload, absent = all ones), ``plan`` (``W ⊙ M_k`` as the
  smallest of Dense / Sliced / Sparse per tensor: a never-pruned device gets the full dense model),
  ``finalize`` (holder mean, masks only shrink);
* **client** — ``train``: gate, ``StructuredPrune``, masked SGD + group lasso, evaluation of both the
  downloaded ``W ⊙ M_k`` and the locally trained model on the device's own test split (spec §8.3
  item 7), device state in ``state_dir`` for deployment (:meth:`Hermes.export_compact`);
* **aggregation** — ``reduce``: per-coordinate sums and holder counts plus the device's new keep
  vectors, all plain float64 sums, so any split over aggregators gives the same answer;
* **options** for the spec's ablations: ``r_target: 1.0`` (no pruning), ``aggregation:
  masked_fedavg`` (divide by the number of participants — the dilution bug Hermes avoids),
  ``acc_threshold: 0``, ``prune_on: trained``, ``weighting: samples`` (the initial model is the
  experiment's ``model.init``, the same for Hermes and its baselines);
* **all-device evaluation** — ``plan_evaluation`` sends ``W ⊙ M_k``, ``evaluate_device`` reports it
  and the device's last locally trained subnetwork.

The structure (which tensor axis each unit owns, compaction, FLOPs) is
:mod:`shared.models.hermes_layers`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from shared import codec
from shared.algorithms import device_state
from shared.algorithms.base import (
    DeviceContext,
    DeviceData,
    Fleet,
    Partial,
    ServerState,
    Strategy,
    StrategyContext,
    TaskSpec,
    UpdateSpec,
    derive_seed,
    load_arrays,
    model_arrays,
    typed_options,
)
from shared.algorithms.training import evaluate, local_sgd
from shared.data.partitioning import split_local
from shared.models.hermes_layers import Keep, UnitStructure, group_lasso, structured_prune

#: the update tensor naming the device whose mask the upload carries (see ``reduce``)
#: per-device JSON-lines log of every task's metrics (the rounds table keeps only accuracy/loss)
DEVICE_LOG = "device_log.jsonl"
#: device state files ``hermes-<round>.npz`` (``shared.algorithms.device_state``)
STATE_PREFIX = "hermes"


# -- device-side logs ----------------------------------------------------------------------------------
def append_device_log(state_dir: Path, record: dict[str, Any]) -> None:
    """Append one task's metrics to the device's log (a replayed task appends again; readers keep
    the last record of a round)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / DEVICE_LOG).open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read_device_logs(device_state_root: Path) -> dict[int, list[dict[str, Any]]]:
    """Every device's log under ``runs/<id>/device-state``, one record per round (the last written)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for log in sorted(device_state_root.glob(f"device-*/{DEVICE_LOG}")):
        by_round: dict[int, dict[str, Any]] = {}
        for line in log.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_round[int(rec["round"])] = rec
        dev = int(log.parent.name.removeprefix("device-"))
        out[dev] = [by_round[r] for r in sorted(by_round)]
    return out


@dataclass(frozen=True)
class LocalData:
    """A device's data as Hermes uses it: train / validation (the gate) / personal test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def local_data(data: DeviceData, *, device_id: int, experiment_seed: int, val_fraction: float) -> LocalData:
    """A stratified, per-device-fixed train/validation split of the device's train data."""
    x_tr, x_te = data.x_train, data.x_test
    idx = np.arange(len(data.y_train), dtype=np.int64)
    split_seed = derive_seed(experiment_seed, "hermes-val", device_id) % (2**32)
    tr, va = split_local(idx, val_fraction, split_seed, labels=data.y_train)
    return LocalData(x_tr[tr], data.y_train[tr], x_tr[va], data.y_train[va], x_te, data.y_test)


class HermesOptions(BaseModel):
    """``algorithm.options`` of Hermes; defaults are the paper's (§5.2) and the spec's (§0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: pruning rate per event (fraction of the current density removed, see ``schedule``)
    r_p: float = Field(0.2, gt=0, lt=1)
    #: target *density* (kept fraction of the parameters); 1.0 = never prune (the spec's ablation)
    r_target: float = Field(0.3, gt=0, le=1)
    #: prune only if the downloaded subnetwork's validation accuracy is above this (< 0: never gate)
    acc_threshold: float = Field(0.5, ge=-1, le=1)
    #: group-lasso coefficient λ (paper: not given; spec: 1e-4); 0 disables the penalty
    group_lasso: float = Field(1e-4, ge=0)
    #: fraction of each device's training data held out as D_val for the gate (stratified)
    val_fraction: float = Field(0.2, ge=0, lt=1)
    #: multiplicative: d ← max(r_target, d·(1−r_p)); linear: d ← max(r_target, d − r_p)
    schedule: Literal["multiplicative", "linear"] = "multiplicative"
    #: score units on the downloaded weights (Alg. 1) or on the locally trained ones (spec §3.4 option)
    prune_on: Literal["downloaded", "trained"] = "downloaded"
    #: holder_mean = Hermes; masked_fedavg = divide by the number of participants (ablation, biased)
    aggregation: Literal["holder_mean", "masked_fedavg"] = "holder_mean"
    #: p_k in the holder mean: 1 (spec default, as in the authors' LotteryFL code) or n_k
    weighting: Literal["uniform", "samples"] = "uniform"
    #: which model ``eval_accuracy`` reports: the last locally trained one (the spec's §8.3 item 1
    #: comparison) or the downloaded W ⊙ M_k; both are always reported as ``eval_accuracy_local`` and
    #: ``eval_accuracy_download``
    primary_eval: Literal["local", "download"] = "local"


class Hermes(Strategy):
    name = "hermes"
    Options = HermesOptions
    personalised = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.opts = typed_options(ctx.options, HermesOptions)
        model = ctx.model_factory()
        if not isinstance(model, nn.Sequential):
            raise ValueError("hermes needs a sequential model (mlp, cnn_digits_pool, tinycnn, lenet...)")
        self.structure = UnitStructure(model, ctx.input_shape)
        self._local: dict[int, tuple[DeviceData, LocalData]] = {}

    # -- masks in the server state ---------------------------------------------------------------------
    @staticmethod
    def mask_key(device: int, layer: str) -> str:
        return f"mask/{device}/{layer}"

    def device_keep(self, state: ServerState, device: int) -> Keep:
        """The server's mask of ``device`` (all ones until its first upload)."""
        keep = self.structure.full_keep()
        for layer in self.structure.hidden:
            stored = state.arrays.get(self.mask_key(device, layer))
            if stored is not None:
                keep[layer] = np.asarray(stored, dtype=np.bool_).copy()
        return keep

    # -- server half -----------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        model = self.ctx.model_factory()
        return ServerState(model_arrays(model), {"prune_events": 0.0})

    def plan(self, state: ServerState, round: int, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        # Devices with the same mask share one TaskSpec object: the server encodes it once.
        shared: dict[bytes, TaskSpec] = {}
        out: dict[int, TaskSpec] = {}
        for dev in devices:
            keep = self.device_keep(state, dev)
            sig = b"".join(np.packbits(keep[k]).tobytes() for k in self.structure.hidden)
            if sig not in shared:
                shared[sig] = TaskSpec(self.structure.payload(state.arrays, keep))
            out[dev] = shared[sig]
        return out

    def finalize(self, state: ServerState, partial: Partial | None, round: int) -> ServerState:
        """Holder mean per coordinate; coordinates no participant kept keep ``W^T``; masks shrink."""
        if partial is None:
            return state
        arrays = dict(state.arrays)
        for name in self.structure.shapes:
            total = partial.arrays.get(f"sum/{name}")
            count = partial.arrays.get(f"count/{name}")
            if total is None or count is None:
                continue
            new = np.asarray(state.arrays[name], dtype=np.float64).copy()
            held = count > 0
            new[held] = total[held] / count[held]
            arrays[name] = new.astype(state.arrays[name].dtype)
        for key, vec in partial.arrays.items():
            if not key.startswith("mask/"):
                continue
            layer = key.split("/", 2)[2]
            if layer not in self.structure.hidden:
                continue
            old = arrays.get(key)
            kept = vec > 0.5
            arrays[key] = (kept if old is None else (kept & (np.asarray(old) > 0))).astype(np.uint8)
        meta = dict(state.meta)
        meta["prune_events"] = float(meta.get("prune_events", 0.0)) + partial.scalars.get("pruned", 0.0)
        return ServerState(arrays, meta)

    def density(self, state: ServerState) -> float:
        devices = {k.split("/")[1] for k in state.arrays if k.startswith("mask/")}
        if not devices:
            return 1.0
        return float(np.mean([self.structure.density(self.device_keep(state, int(d))) for d in devices]))

    def personal_model(self, state: ServerState, device: int) -> nn.Sequential:
        """``W ⊙ M_k`` compacted: the model the server would deploy to ``device`` now."""
        model = self.ctx.model_factory()
        load_arrays(model, state.arrays)
        assert isinstance(model, nn.Sequential)
        return self.structure.compact(model, self.device_keep(state, device))

    # -- client half -----------------------------------------------------------------------------------
    def _data(self, device: DeviceContext) -> LocalData:
        """The device's split, computed once per device: it is fixed for the run."""
        cached = self._local.get(device.device_id)
        if cached is None or cached[0] is not device.data:  # holding the object: no id() reuse
            split = local_data(
                device.data,
                device_id=device.device_id,
                experiment_seed=self.ctx.seed,
                val_fraction=self.opts.val_fraction,
            )
            cached = self._local[device.device_id] = (device.data, split)
        return cached[1]

    def next_density(self, density: float) -> float:
        o = self.opts
        step = density * (1 - o.r_p) if o.schedule == "multiplicative" else density - o.r_p
        return max(o.r_target, step)

    def _masked_model(self, arrays: dict[str, np.ndarray], keep: Keep) -> tuple[nn.Module, Any]:
        model = self.ctx.model_factory()
        load_arrays(model, arrays)
        masks = self.structure.torch_masks(keep)
        params = dict(model.named_parameters())

        @torch.no_grad()
        def apply(m: nn.Module) -> None:
            for name, mask in masks.items():
                params[name].mul_(mask)

        apply(model)
        return model, apply

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        o, st = self.opts, self.structure
        keep = st.keep_from_payload(task.tensors)
        arrays = model_arrays(self.ctx.model_factory())
        for name, t in task.tensors.items():
            arrays[name] = codec.to_array(t)
        data = self._data(device)

        # 1. the downloaded subnetwork W ⊙ M_k: personal test accuracy and the gate's val accuracy
        downloaded, _ = self._masked_model(arrays, keep)
        ev_down = evaluate(downloaded, data.x_test, data.y_test)
        x_gate, y_gate = (data.x_val, data.y_val) if len(data.y_val) else (data.x_train, data.y_train)
        val_acc = evaluate(downloaded, x_gate, y_gate)["accuracy"]
        density_before = st.density(keep)
        wants = density_before > o.r_target + 1e-12
        gate = val_acc > o.acc_threshold
        target = self.next_density(density_before)

        # 2. prune (paper order: scores from the downloaded weights), then masked SGD + group lasso
        new_keep = keep
        if wants and gate and o.prune_on == "downloaded":
            new_keep = structured_prune(st, arrays, keep, target)
        model, apply = self._masked_model(arrays, new_keep)
        penalty = group_lasso(st, o.group_lasso) if o.group_lasso > 0 else None
        train_metrics = local_sgd(
            model, data.x_train, data.y_train, self.ctx.train, device.seed, penalty=penalty, after_step=apply
        )
        if wants and gate and o.prune_on == "trained":
            new_keep = structured_prune(st, model_arrays(model), keep, target)
            model, apply = self._masked_model(model_arrays(model), new_keep)
        ev_local = evaluate(model, data.x_test, data.y_test)
        trained = model_arrays(model)

        # 3. upload the kept weights; the payload's structure is the new mask
        tensors = st.payload(trained, new_keep)
        density = st.density(new_keep)
        kept = st.kept_params(new_keep)
        primary = ev_local if o.primary_eval == "local" else ev_down
        metrics = {
            "eval_accuracy": primary["accuracy"],
            "eval_loss": primary["loss"],
            "eval_samples": float(len(data.y_test)),
            "eval_accuracy_local": ev_local["accuracy"],
            "eval_loss_local": ev_local["loss"],
            "eval_accuracy_download": ev_down["accuracy"],
            "eval_loss_download": ev_down["loss"],
            "val_accuracy": val_acc,
            "gate_open": float(gate),
            "gate_blocked": float(wants and not gate),
            "pruned": float(density < density_before),
            "density": density,
            "density_before": density_before,
            "kept_params": float(kept),
            # the paper's accounting: 4 B per kept value, plus 1 bit per parameter for the mask
            "paper_bytes_up": float(4 * kept + math.ceil(st.total_params / 8)),
            "paper_bytes_down": float(4 * st.kept_params(keep)),
            # ≈ 3 × forward FLOPs of the compacted model per training sample and epoch
            "train_flops": float(3 * st.flops(new_keep) * len(data.y_train) * self.ctx.train.local_epochs),
            **train_metrics,
        }
        self._save_device_state(device, new_keep, trained)
        append_device_log(device.state_dir, {"round": device.round, "device": device.device_id, **metrics})
        return UpdateSpec(tensors, num_samples=len(data.y_train), metrics=metrics)

    # -- the all-device evaluation after the last round ------------------------------------------------
    def plan_evaluation(self, state: ServerState, devices: list[int], fleet: Fleet) -> dict[int, TaskSpec]:
        """Every device gets ``W_final ⊙ M_k`` (its download-time model), as in ``plan``."""
        return self.plan(state, -1, devices, fleet)

    def evaluate_device(self, task: TaskSpec, device: DeviceContext) -> dict[str, float] | None:
        """Both personalised models on the device's own test split, without training.

        ``eval_accuracy_download``: ``W_final ⊙ M_k`` from the task; ``eval_accuracy_local``: the
        device's last locally trained subnetwork (``state_dir``), absent if it never participated.
        ``eval_accuracy`` follows ``primary_eval`` (falling back to the download-time model for a
        device without a local model).
        """
        data = self._data(device)
        out: dict[str, float] = {"eval_samples": float(len(data.y_test))}
        ev_down = ev_local = None
        if task.tensors:
            keep = self.structure.keep_from_payload(task.tensors)
            arrays = model_arrays(self.ctx.model_factory())
            for name, t in task.tensors.items():
                arrays[name] = codec.to_array(t)
            model, _ = self._masked_model(arrays, keep)
            ev_down = evaluate(model, data.x_test, data.y_test)
            out.update(eval_accuracy_download=ev_down["accuracy"], eval_loss_download=ev_down["loss"])
            out["density"] = self.structure.density(keep)
        local = self.export_compact(device.state_dir)
        if local is not None:
            ev_local = evaluate(local, data.x_test, data.y_test)
            out.update(eval_accuracy_local=ev_local["accuracy"], eval_loss_local=ev_local["loss"])
        primary = ev_local if (self.opts.primary_eval == "local" and ev_local is not None) else ev_down
        if primary is None:
            primary = ev_local
        if primary is None:
            return None
        out.update(eval_accuracy=primary["accuracy"], eval_loss=primary["loss"])
        return out

    def _save_device_state(self, device: DeviceContext, keep: Keep, trained: dict[str, np.ndarray]) -> None:
        """What a real device keeps: its mask and its last locally trained subnetwork (for deployment)."""
        arrays: dict[str, np.ndarray] = {f"keep/{k}": v.astype(np.uint8) for k, v in keep.items()}
        arrays.update({f"w/{k}": v for k, v in trained.items()})
        device_state.save(device.state_dir, STATE_PREFIX, device.round, arrays)

    def export_compact(self, state_dir: Path) -> nn.Sequential | None:
        """The device's deployable model: its last locally trained subnetwork, pruned units removed
        (None if the device never trained)."""
        saved = device_state.load_latest(state_dir, STATE_PREFIX)
        if saved is None:
            return None
        keep = {
            k.removeprefix("keep/"): v.astype(np.bool_) for k, v in saved.items() if k.startswith("keep/")
        }
        weights = {k.removeprefix("w/"): v for k, v in saved.items() if k.startswith("w/")}
        model = self.ctx.model_factory()
        load_arrays(model, weights)
        assert isinstance(model, nn.Sequential)
        return self.structure.compact(model, keep)

    # -- aggregation half ------------------------------------------------------------------------------
    def validate_update(self, update: UpdateSpec) -> None:
        if set(update.tensors) != set(self.structure.shapes):
            raise codec.CodecError("tensor", f"update names {sorted(update.tensors)[:4]}... do not match")
        if update.device_id is None:
            # The mask is stored under the sender's id: it must come from the aggregator's validated
            # envelope (an id the device reports itself could overwrite another device's mask).
            raise codec.CodecError("tensor", "update carries no envelope device id")
        self.structure.keep_from_payload(update.tensors)
        if update.num_samples <= 0:
            raise codec.CodecError("tensor", "num_samples must be positive")

    def reduce(self, partial: Partial, update: UpdateSpec) -> Partial:
        """Sums of ``p_k·W_k`` and of ``p_k`` over the coordinates each device kept, plus its mask.

        ``finalize`` divides sum by count where count > 0, which is the holder mean; everything is a
        plain sum, so the reduction is associative and commutative. ``masked_fedavg`` (ablation)
        counts every coordinate for every participant instead, i.e. divides by the participants.
        """
        st = self.structure
        keep = st.keep_from_payload(update.tensors)
        assert update.device_id is not None  # validate_update checked it
        dev = update.device_id
        p = 1.0 if self.opts.weighting == "uniform" else float(update.num_samples)
        arrays: dict[str, np.ndarray] = {}
        for name in st.shapes:
            t = update.tensors[name]
            full = np.asarray(codec.to_array(t), dtype=np.float64)
            mask = st.tensor_mask(name, keep).astype(np.float64)
            arrays[f"sum/{name}"] = p * full * mask
            arrays[f"count/{name}"] = p * (
                mask if self.opts.aggregation == "holder_mean" else np.ones_like(mask)
            )
        for layer in st.hidden:
            arrays[self.mask_key(dev, layer)] = keep[layer].astype(np.float64)
        scalars = {"updates": 1.0, "pruned": float(update.metrics.get("pruned", 0.0))}
        return partial.add(Partial(arrays, scalars))
