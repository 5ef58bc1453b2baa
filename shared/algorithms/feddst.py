"""FedDST (Bibikar et al., AAAI 2022) as the FedMef paper runs it: mask adjustment on the devices.

Spec: ``docs/algorithms/fedmef.md`` §7 (recipe from the paper's schedule and ``bibikar/feddst``). Normal
rounds are FedTiny's plain sparse FedAvg (values on the common mask go up). In an adjustment round
each device

1. trains ``ceil(E/2)`` local epochs on the global mask,
2. prunes, per layer, the ξ_l smallest-|w| kept weights and grows the ξ_l pruned positions with the
   largest |dense gradient| of the last minibatch (new weights start at 0),
3. trains the remaining epochs (at least one) on its new local mask, and uploads the weights **with
   its mask** (:class:`codec.Sparse`: positions + values; the masks now differ between devices).

The server takes the mask-aware mean θ = Σ n_k m_k θ_k / Σ n_k m_k (0 where no device kept a
position), the union of the masks as the new mask, and re-prunes each layer by magnitude back to its
nnz (the union is denser than the target). The sums are carried as two float64 arrays per weight
(``dsum``, ``dcnt``), so the reduction stays associative.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from shared import codec
from shared.algorithms.base import DeviceContext, Partial, ServerState, TaskSpec, UpdateSpec, model_arrays
from shared.algorithms.dynamic_pruning import DynamicPruning
from shared.algorithms.training import local_sgd
from shared.models.dynamic_sparse import growth_gradients, prune_and_grow, set_masks


class FedDST(DynamicPruning):
    name = "feddst"

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        config = dict(task.config)
        if not config.get("adjust"):
            update = super().train(task, device)
            return update
        model, masks = self.load_task(task)
        eta = float(config["lr"])
        xi = {k: int(v) for k, v in dict(config.get("xi", {})).items()}
        epochs = self.ctx.train.local_epochs
        first = max(1, math.ceil(epochs / 2))
        second = max(1, epochs - first)
        x, y = device.data.x_train, device.data.y_train
        train = self.ctx.train
        m1 = local_sgd(model, x, y, train, device.seed, epochs=first, masks=masks, lr=lambda _t: eta)
        grads = growth_gradients(
            model, self.prunable, x, y, batch_size=self.ctx.train.batch_size, max_batches=1, last=True
        )
        params = dict(model.named_parameters())
        rng = np.random.default_rng(device.seed)
        new_masks = dict(masks)
        with torch.no_grad():
            for n in self.prunable:
                w = params[n].detach().numpy()
                old = masks[n].numpy() > 0
                new, _dropped, _grown = prune_and_grow(w, old, grads[n].numpy(), xi.get(n, 0), rng)
                new_masks[n] = torch.from_numpy(new.astype(np.float32))
                params[n].mul_(new_masks[n])  # dropped weights go, grown ones start at 0
        set_masks(model, new_masks)
        m2 = local_sgd(model, x, y, train, device.seed + 1, epochs=second, masks=new_masks, lr=lambda _t: eta)
        state = model_arrays(model)
        tensors: dict[str, codec.Tensor] = {}
        for name in self._float_names:
            if name in new_masks:
                tensors[name] = codec.Sparse.from_dense(state[name], new_masks[name].numpy() > 0)
            else:
                tensors[name] = codec.Dense(state[name])
        steps = m1["steps"] + m2["steps"]
        metrics = {
            "train_loss": (m1["train_loss"] * m1["steps"] + m2["train_loss"] * m2["steps"]) / max(steps, 1.0),
            "steps": steps,
            "adjust": 1.0,
        }
        return UpdateSpec(tensors, num_samples=len(y), metrics=metrics)

    def validate_weight(self, name: str, t: codec.Tensor) -> None:
        """Values on the global mask (normal rounds) or a local mask with the same nnz (adjustment)."""
        if isinstance(t, codec.Sparse):
            if t.shape != self.shapes[name] or t.nnz != self.nnz[name]:
                raise codec.CodecError(
                    "tensor", f"{name}: a local mask must keep {self.nnz[name]} of {self.shapes[name]}"
                )
            return
        super().validate_weight(name, t)

    def aggregate_extra(
        self, arrays: dict[str, np.ndarray], masks: dict[str, np.ndarray], partial: Partial, weight: float
    ) -> None:
        """Mask-aware mean, union of the device masks, magnitude re-prune to the target nnz (§7 step 4)."""
        for n in self.prunable:
            total, count = partial.arrays.get(f"dsum/{n}"), partial.arrays.get(f"dcnt/{n}")
            if total is None or count is None:
                continue
            held = count > 0
            theta = np.where(held, total / np.where(held, count, 1.0), 0.0)
            flat_held = np.flatnonzero(held.reshape(-1))
            if len(flat_held) > self.nnz[n]:
                mags = np.abs(theta.reshape(-1)[flat_held])
                flat_held = flat_held[np.argsort(-mags, kind="stable")[: self.nnz[n]]]
            flat_new = np.zeros(held.size, dtype=np.bool_)
            flat_new[flat_held] = True
            new = flat_new.reshape(held.shape)
            arrays[n] = (theta * new).astype(np.float32)
            arrays["mask/" + n] = new.astype(np.uint8)
            masks[n] = new

    def adjust_masks(
        self,
        state: ServerState,
        arrays: dict[str, np.ndarray],
        masks: dict[str, np.ndarray],
        partial: Partial,
        weight: float,
        r: int,
        meta: dict[str, Any],
    ) -> None:
        """The devices adjusted their masks; the server's part was ``aggregate_extra``."""
        meta["adjust_log"].append({"round": r + 1, "r": r, "xi_total": int(sum(self.xi(r).values()))})
