"""SpaFL's masked layers: one trainable threshold per output neuron (linear) or filter (conv).

Why wrap the framework's models instead of defining SpaFL-only architectures: every client builds
its model with the experiment's deterministic ``model_factory`` (so all devices start from the same
w(0) without shipping it), and :func:`convert` then swaps each ``nn.Linear``/``nn.Conv2d`` for a
masked twin that *shares* the original weight tensor. State-dict names therefore stay the model's own
(``fc1.weight``) plus one ``fc1.tau`` per layer, and those layer names are the names on the wire
(``tau/fc1``).

The forward pass is the paper's eq. 1-2 (spec §3.1)::

    mu_i = mean_j |W_ij|          (row i; a conv filter is flattened over c_in*k*h)
    p_i  = 1 if mu_i - tau_i > 0 else 0      (strict ">", so Q = 0 prunes)
    W~   = W * p  (the whole row/filter is kept or removed)

The unit step has the identity straight-through estimator (dp/dQ := 1), so autograd gives exactly
the gradients of spec §3.2: dL/dtau_i = -sum_j G_ij W_ij, the direct weight gradient G_ij * p_i, and
(unless ``mask_path_gradient`` is off) the extra term through mu that the authors' code gets from
autograd. A bias, if the model has one, is masked with its row: a pruned neuron must output nothing,
not its bias (the paper's models have no biases; this keeps "pruned" meaning pruned for ours).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _UnitStepSTE(torch.autograd.Function):
    """Heaviside step forward, identity backward (the paper's straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor) -> torch.Tensor:
        return (q > 0).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def unit_step(q: torch.Tensor) -> torch.Tensor:
    """``1[q > 0]`` with gradient 1 everywhere (identity STE)."""
    out = _UnitStepSTE.apply(q)
    assert isinstance(out, torch.Tensor)
    return out


class MaskedLayer(nn.Module):
    """Common part of :class:`MaskedLinear` and :class:`MaskedConv2d`.

    ``last_mask`` is the row mask of the most recent forward pass (detached). The layer-collapse guard
    reads it after an optimizer step, as the reference code reads ``layer.ratio``.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    tau: nn.Parameter

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, mask_path_gradient: bool) -> None:
        super().__init__()
        if not isinstance(weight, nn.Parameter) or not (bias is None or isinstance(bias, nn.Parameter)):
            raise TypeError("a masked layer wraps the original layer's parameters (nn.Parameter)")
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.tau = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype))
        self.mask_path_gradient = mask_path_gradient
        self.last_mask: torch.Tensor = torch.ones(weight.shape[0], dtype=weight.dtype)

    @property
    def n_out(self) -> int:
        return int(self.weight.shape[0])

    @property
    def n_in(self) -> int:
        """Connected parameters per neuron/filter: n_in for linear, c_in*k*h for conv."""
        return int(self.weight[0].numel())

    def row_mean_abs(self) -> torch.Tensor:
        return self.weight.abs().flatten(1).mean(1)

    def mask(self) -> torch.Tensor:
        """The row mask p(tau) with the STE attached (differentiable w.r.t. tau, and w.r.t. W via mu)."""
        mu = self.row_mean_abs()
        if not self.mask_path_gradient:
            mu = mu.detach()
        return unit_step(mu - self.tau)

    @torch.no_grad()
    def current_mask(self) -> torch.Tensor:
        """The row mask for the current W and tau, without touching autograd."""
        return (self.row_mean_abs() - self.tau > 0).to(self.weight.dtype)

    def masked_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        p = self.mask()
        self.last_mask = p.detach().clone()
        shape = (-1,) + (1,) * (self.weight.dim() - 1)
        w = self.weight * p.view(shape)
        b = self.bias * p if self.bias is not None else None
        return w, b


class MaskedLinear(MaskedLayer):
    def __init__(self, layer: nn.Linear, *, mask_path_gradient: bool = True) -> None:
        super().__init__(layer.weight, layer.bias, mask_path_gradient=mask_path_gradient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.masked_weight_and_bias()
        return F.linear(x, w, b)


class MaskedConv2d(MaskedLayer):
    def __init__(self, layer: nn.Conv2d, *, mask_path_gradient: bool = True) -> None:
        super().__init__(layer.weight, layer.bias, mask_path_gradient=mask_path_gradient)
        if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            raise ValueError("MaskedConv2d supports numeric zero padding only")
        self.stride = layer.stride
        self.padding = layer.padding
        self.dilation = layer.dilation
        self.groups = layer.groups
        self.kernel_area = int(layer.kernel_size[0] * layer.kernel_size[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.masked_weight_and_bias()
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


def convert(
    model: nn.Module, *, exclude: tuple[str, ...] | list[str] = (), mask_path_gradient: bool = True
) -> nn.Module:
    """Replace every ``nn.Linear``/``nn.Conv2d`` of ``model`` (in place) by its masked twin.

    ``exclude`` names layers (qualified module names, e.g. ``fc`` of a ResNet) that stay unmasked;
    the paper leaves ResNet-18's final FC unmasked. The weights are shared, not copied, so the
    converted model starts from exactly the same w as the model it was built from.
    """
    excluded = set(exclude)
    unknown = excluded - {name for name, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"unmasked layer names not in the model: {sorted(unknown)}")
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if full in excluded:
                continue
            if isinstance(child, nn.Conv2d):
                setattr(parent, child_name, MaskedConv2d(child, mask_path_gradient=mask_path_gradient))
            elif isinstance(child, nn.Linear):
                setattr(parent, child_name, MaskedLinear(child, mask_path_gradient=mask_path_gradient))
    return model


def masked_layers(model: nn.Module) -> dict[str, MaskedLayer]:
    """The masked layers of ``model`` by qualified name, in definition order (the wire order)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MaskedLayer)}
