"""Training FLOPs of a task, so virtual compute time = FLOPs / device FLOP/s.

Counting rule (the usual one in the FL papers, e.g. FedMef and Hermes report it this way):

- only ``nn.Linear`` and ``nn.Conv1d/2d/3d`` layers count; they hold >95% of the arithmetic in the
  networks here. Biases, BatchNorm, activations, pooling and the optimizer step are ignored;
- forward = 2 x MACs. A Linear layer does ``rows x kept_weights`` MACs (rows = batch x any leading
  dims), a conv layer ``batch x output_positions x kept_weights`` (each weight meets each output
  position once; padding positions are counted as dense implementations compute them);
- backward = grad w.r.t. the weights (= forward, only if the weight trains) + grad w.r.t. the input
  (= forward, only if the layer's input needs a gradient, i.e. some trainable layer lies upstream). So
  a fully trained network costs ~3x forward, except that **the first layer skips the grad w.r.t. the
  data** (autograd never computes it), and a frozen prefix costs forward only. This follows autograd
  exactly rather than the rougher "backward = 2 x forward everywhere";
- masks: with a mask for ``<layer>.weight`` only kept weights count, in forward and both backward
  terms: the idealised sparse cost that pruning papers report (a dense kernel multiplying zeros does
  the full work; that is the implementation's business, not the device budget's).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .memory import _predicate, _probe

__all__ = ["LayerFlops", "forward_flops", "layer_flops", "training_flops"]

Mask = np.ndarray | torch.Tensor

_COUNTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class LayerFlops:
    """Per-sample FLOPs of one layer in one training step."""

    name: str
    kind: str
    forward: int
    backward_input: int
    backward_weight: int

    @property
    def total(self) -> int:
        return self.forward + self.backward_input + self.backward_weight


def _kept(name: str, weight: torch.Tensor, masks: Mapping[str, Mask] | None) -> int:
    if masks is None or name not in masks:
        return weight.numel()
    mask = masks[name]
    arr = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if tuple(arr.shape) != tuple(weight.shape):
        raise ValueError(f"mask '{name}' has shape {tuple(arr.shape)}, the weight {tuple(weight.shape)}")
    return int(np.count_nonzero(arr))


def layer_flops(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    masks: Mapping[str, Mask] | None = None,
    trainable_params: Collection[str] | None = None,
    input_dtype: torch.dtype = torch.float32,
) -> list[LayerFlops]:
    """Per-sample FLOPs of every Linear/Conv layer, in call order (a layer called twice appears twice).

    Runs one forward pass on a single zero sample in eval mode (shapes do not depend on the batch,
    and eval mode lets BatchNorm accept one sample); autograd is on only to learn which layer inputs
    need a gradient under the given trainable set.
    """
    param_names = {name for name, _ in model.named_parameters()}
    if masks is not None:
        unknown = sorted(set(masks) - param_names)
        if unknown:
            raise ValueError(f"masks name unknown parameters: {unknown[:5]}")
    pred = _predicate(trainable_params)
    rows: list[LayerFlops] = []
    hooks = []

    def make_hook(mod_name: str) -> Any:
        weight_name = f"{mod_name}.weight" if mod_name else "weight"

        def hook(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            kept = _kept(weight_name, weight, masks)
            if isinstance(module, nn.Linear):
                positions = output.numel() // module.out_features
            else:
                out_channels = weight.shape[0]
                positions = output.numel() // out_channels  # batch (=1) x output spatial positions
            fwd = 2 * positions * kept
            x = inputs[0] if inputs else None
            needs_input_grad = isinstance(x, torch.Tensor) and x.requires_grad
            rows.append(
                LayerFlops(
                    name=mod_name,
                    kind=type(module).__name__,
                    forward=fwd,
                    backward_input=fwd if needs_input_grad else 0,
                    backward_weight=fwd if pred(weight_name) else 0,
                )
            )

        return hook

    for mod_name, module in model.named_modules():
        if isinstance(module, _COUNTED):
            hooks.append(module.register_forward_hook(make_hook(mod_name)))
    try:
        with _probe(model, trainable_params, train=False), torch.enable_grad():
            model(torch.zeros((1, *input_shape), dtype=input_dtype))
    finally:
        for h in hooks:
            h.remove()
    return rows


def forward_flops(
    model: nn.Module,
    input_shape: Sequence[int],
    batch_size: int = 1,
    *,
    masks: Mapping[str, Mask] | None = None,
) -> int:
    """Forward-only FLOPs for ``batch_size`` samples (inference, evaluation, a frozen prefix pass)."""
    return batch_size * sum(r.forward for r in layer_flops(model, input_shape, masks=masks))


def training_flops(
    model: nn.Module,
    input_shape: Sequence[int],
    batch_size: int,
    num_batches: int,
    *,
    masks: Mapping[str, Mask] | None = None,
    trainable_params: Collection[str] | None = None,
    input_dtype: torch.dtype = torch.float32,
) -> int:
    """FLOPs of ``num_batches`` training steps at ``batch_size`` (forward + backward, rules above).

    ``input_shape`` is one sample's shape; ``trainable_params`` = names of the parameters that train
    (None = all); ``masks`` = ``{param_name: bool array}`` of kept weights.
    """
    if batch_size < 0 or num_batches < 0:
        raise ValueError("batch_size and num_batches must be >= 0")
    rows = layer_flops(
        model, input_shape, masks=masks, trainable_params=trainable_params, input_dtype=input_dtype
    )
    return batch_size * num_batches * sum(r.total for r in rows)
