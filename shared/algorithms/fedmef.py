"""FedMef (memory-efficient federated dynamic pruning): FedTiny's protocol plus BaE and SAP.

Spec: ``docs/algorithms/fedmef.md``. The server half, the wire format and the aggregation are
FedTiny's (:class:`~shared.algorithms.dynamic_pruning.DynamicPruning`); what differs is on the device:

* **Budget-aware extrusion (BaE, §3.4)** — in an adjustment round every device marks θ_low, the ξ_l
  kept weights of smallest |θ| of the *received* model (the same set on every device), and trains on
  ``CE + λ‖θ_low‖²`` (or λ‖θ_low‖₁) for the whole round with one rate for all weights,
  ``μ_t = max(η_r, p(t)(2σ(‖θ_low‖) − 1)η_0)``, p the REX budget factor over the round's T local steps.
  The penalty pushes the information of the weights about to be pruned into the survivors, so the
  server's prune removes little. The device reports ‖θ_low‖_end / ‖θ_low‖_start (``extrusion_ratio``).
* **Scaled activation pruning (SAP, §3.3)** — BatchNorm is removed, convs become
  :class:`~shared.models.dynamic_sparse.NSConv2d` (weight standardisation over the unpruned weights,
  scaled by γ) and every conv/linear keeps only the largest ``1 − s_ta`` of its input cache, packed,
  for the weight gradient. The regrowth gradient is taken w.r.t. the standardised weight Ŵ (§3.5).

Memory: ``task_footprint`` (inherited) measures the activation bytes of *this* model, so the packed
caches are what admission sees; a device whose budget fits FedMef but not FedTiny trains FedMef.

Ablations (options): ``extrusion: false`` = "w/o BaE"; ``nsconv: false`` = "w/o SAP" in the paper's
sense (activation pruning kept, normalisation removed); ``activation_sparsity: 0`` = no cache pruning.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from shared.algorithms.base import DeviceContext, StrategyContext, typed_options
from shared.algorithms.dynamic_pruning import DynamicPruning, DynamicPruningOptions
from shared.algorithms.training import local_sgd
from shared.models.dynamic_sparse import extrusion_lr, smallest_active, to_fedmef_model


class FedMefOptions(DynamicPruningOptions):
    """FedMef's options on top of the shared schedule; λ and γ are not given by the paper (§5)."""

    #: BaE on/off ("FedMef w/o BaE" when off: adjustment rounds train like FedTiny)
    extrusion: bool = True
    #: λ of the extrusion penalty (spec §8: 1.0, sweep {0.1, 1, 5})
    extrusion_lambda: float = Field(1.0, ge=0)
    #: Eq. 2's squared L2 (default) or the text's "L_1 regularization" (§9.1)
    penalty: Literal["l2", "l1"] = "l2"
    #: target activation-cache sparsity s_ta (0 = keep the whole cache)
    activation_sparsity: float = Field(0.9, ge=0, lt=1)
    #: NSConv (weight standardisation) on; off = the "w/o NSConv" ablation (plain, un-normalised convs)
    nsconv: bool = True
    #: γ of NSConv (not given by the paper; spec §8: 1)
    gamma: float = Field(1.0, gt=0)
    #: fan-in-corrected standardisation (default, §3.3) or Eq. 7 as printed (§9.10)
    ns_form: Literal["fan_in", "literal"] = "fan_in"


class FedMef(DynamicPruning):
    name = "fedmef"
    Options = FedMefOptions

    def __init__(self, ctx: StrategyContext) -> None:
        self.mopts = typed_options(ctx.options, FedMefOptions)
        super().__init__(ctx)

    def train_model(self) -> nn.Module:
        model = self.ctx.model_factory()
        if not isinstance(model, nn.Sequential):
            raise ValueError(
                "fedmef needs a flat sequential ReLU-conv model (tinycnn, cnn_digits_pool, mlp...)"
            )
        return to_fedmef_model(
            model,
            keep=1.0 - self.mopts.activation_sparsity,
            gamma=self.mopts.gamma,
            nsconv=self.mopts.nsconv,
            literal=self.mopts.ns_form == "literal",
        )

    def local_training(
        self,
        model: nn.Module,
        masks: dict[str, torch.Tensor],
        device: DeviceContext,
        config: dict[str, Any],
    ) -> dict[str, float]:
        """Normal rounds as FedTiny; adjustment rounds run budget-aware extrusion (§3.1, §3.4)."""
        if not (config.get("adjust") and self.mopts.extrusion):
            return super().local_training(model, masks, device, config)
        eta_r = float(config["lr"])
        eta0 = float(self.ctx.train.lr)
        xi = {k: int(v) for k, v in dict(config.get("xi", {})).items()}
        params = dict(model.named_parameters())
        low = {
            n: torch.from_numpy(
                smallest_active(params[n].detach().numpy(), masks[n].numpy() > 0, xi.get(n, 0))
            )
            for n in self.prunable
        }
        lam = self.mopts.extrusion_lambda
        l1 = self.mopts.penalty == "l1"

        def low_values() -> list[torch.Tensor]:
            return [params[n].reshape(-1)[idx] for n, idx in low.items() if len(idx)]

        def penalty(_: nn.Module) -> torch.Tensor:
            vals = low_values()
            if not vals:
                return torch.zeros(())
            return lam * sum((v.abs().sum() if l1 else v.pow(2).sum() for v in vals), torch.zeros(()))

        def low_norm() -> float:
            with torch.no_grad():
                return math.sqrt(sum(float(v.pow(2).sum()) for v in low_values()))

        n = len(device.data.y_train)
        budget = self.ctx.train.local_epochs * math.ceil(n / self.ctx.train.batch_size)
        start = low_norm()
        metrics = local_sgd(
            model,
            device.data.x_train,
            device.data.y_train,
            self.ctx.train,
            device.seed,
            masks=masks,
            lr=lambda t: extrusion_lr(t, budget, low_norm(), eta0, eta_r),
            penalty=penalty,
        )
        end = low_norm()
        if start > 0:  # θ_low is all zeros when it is exactly the weights grown at the last update
            metrics["extrusion_ratio"] = end / start
        return metrics


def layer_io(model: nn.Module, layer: str, x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s input and output for the batch ``x``, the model in eval mode and without grad
    (the statistics of check 7 are about the trained model as it would be used)."""
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    mod = dict(model.named_modules())[layer]
    h = mod.register_forward_hook(lambda m, i, o: found.append((i[0].detach(), o.detach())))
    try:
        model.eval()
        with torch.no_grad():
            model(torch.tensor(x, dtype=torch.float32))  # a copy: x may be a read-only memory map
    finally:
        h.remove()
    return found[0]


def conv_output_stats(model: nn.Module, layer: str, x: np.ndarray) -> tuple[float, int]:
    """Check 7 (Fig. 3): mean over live channels of |mean| / std of ``layer``'s outputs on ``x``.

    Returns (ratio, dead channels). A channel whose output is constant (a filter with no kept weight,
    or one whose standardised weights vanish, §9.11) has std 0 and no defined ratio; it is counted
    as dead instead of dividing by 0.
    """
    _, o = layer_io(model, layer, x)
    out = o.transpose(0, 1).reshape(o.shape[1], -1).double()
    mean, std = out.mean(1), out.std(1)
    live = std > 1e-6 * float(std.max().clamp_min(1e-30))
    ratio = (mean[live].abs() / std[live]).mean()
    return float(ratio), int((~live).sum())


def input_mean_spread(model: nn.Module, layer: str, x: np.ndarray) -> float:
    """Theorem 1's other assumption, measured: ``layer``'s input coordinates (channel × position) on
    ``x`` should share one mean μ_f, so that a filter whose weights sum to 0 has outputs of mean 0.
    Returns the coefficient of variation (std / mean) of the per-coordinate input means: 0 when the
    assumption holds; with it > 0 a zero-sum filter still has a mean of Σ_j Ŵ_j (E[x_j] − μ̄)."""
    i, _ = layer_io(model, layer, x)
    means = i.double().mean(0).flatten()
    return float(means.std() / means.mean().abs().clamp_min(1e-30))
