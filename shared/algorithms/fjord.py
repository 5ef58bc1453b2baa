"""FjORD (Horváth et al., NeurIPS '21): ordered dropout inside a device's nested width.

Spec context: ``docs/algorithms/feddse.md`` §1 names FjORD with HeteroFL as the ordered baselines.
A device of capacity ``r_n`` receives the HeteroFL prefix slice (the first ``k_l(r_n)`` units of every
hidden layer) and, for **every local minibatch**, trains a narrower prefix: ``p`` is drawn uniformly
from the capacity levels ``≤ r_n`` (plus ``r_n`` itself), and only the first ``k_l(p)`` units of each
hidden layer are active. So every prefix width is trained for itself and the model becomes
"ordered" (a narrow prefix is a usable model), which is what FjORD's ordered dropout buys. Upload and
aggregation are HeteroFL's (the ``r_n`` prefix slice, holder mean).

How a narrower prefix is trained: the units past ``k_l(p)`` are silenced by forcing their
activations to zero (forward hooks), which by Lemma 1' (spec §3.2) gives the same forward and the
same gradients as slicing the weights; weight decay and momentum still move the silenced weights of
the ``r_n`` slice, as they do in PyTorch implementations that slice per forward (the optimizer holds
the whole parameter). The draw of ``p`` is keyed by (seed, round, device).

Not implemented: FjORD's self-distillation from the widest sub-model (an optional extra in the
paper); the Flower baseline's ``p_s`` grid is replaced by the capacity ``levels`` option.

Options: those of :class:`shared.models.width_slice.WidthOptions` (see ``heterofl.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from shared.algorithms.base import DeviceContext, TaskSpec, UpdateSpec, derive_seed
from shared.algorithms.training import local_sgd
from shared.algorithms.width_slicing import LabelMask, WidthSliceStrategy
from shared.models.width_slice import keep_count


class FjORD(WidthSliceStrategy):
    name = "fjord"

    def widths_below(self, rate: float) -> list[float]:
        """The per-batch widths a device of capacity ``rate`` may train (levels ≤ rate, and rate)."""
        return sorted({*(lv for lv in self.opts.levels if lv <= rate + 1e-12), rate})

    def train(self, task: TaskSpec, device: DeviceContext) -> UpdateSpec:
        rate, sel, counts, sub = self.task_submodel(task, device)
        grid = self.widths_below(rate)
        rng = np.random.default_rng(
            derive_seed(self.ctx.seed, "fjord", device.round, device.device_id) % (2**32)
        )
        masks: dict[str, torch.Tensor] = {}
        drawn: list[float] = []

        def draw(_: nn.Module | None = None) -> None:
            p = float(grid[int(rng.integers(len(grid)))])
            drawn.append(p)
            for h, k in counts.items():
                active = min(k, keep_count(p, self.structure.layers[h].units, self.opts.rounding))
                m = torch.zeros(k)
                m[:active] = 1.0
                masks[h] = m

        def silence(h: str) -> Any:
            def hook(_: nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
                return out * masks[h].view(1, -1, *([1] * (out.dim() - 2)))

            return hook

        handles = [
            getattr(sub, self.structure.score_at[h]).register_forward_hook(silence(h))
            for h in self.structure.hidden
        ]
        draw()
        present = np.bincount(device.data.y_train, minlength=self.ctx.num_classes) > 0
        model: nn.Module = nn.Sequential(sub, LabelMask(present)) if self.opts.label_mask else sub
        try:
            metrics = local_sgd(
                model, device.data.x_train, device.data.y_train, self.ctx.train, device.seed, after_step=draw
            )
        finally:
            for handle in handles:
                handle.remove()
        update = self._upload(sub, sel, counts, rate, present, metrics, task, device)
        update.metrics["od_mean_width"] = float(np.mean(drawn[:-1])) if len(drawn) > 1 else rate
        return update
