"""The unit graph of a flat sequential MLP/CNN: which slice of which tensor belongs to which unit.

Why a module of its own: Hermes (structured masks, :mod:`shared.models.hermes_layers`) and the
width-slice family (FedDSE, HeteroFL, FedRolex, Federated Dropout, FjORD,
:mod:`shared.models.width_slice`) cut the same thing — whole output units of hidden layers — and
both must agree on what a unit owns, how many output positions a layer has (for FLOPs) and which
architectures they refuse. One walk over the model, here, answers that for both; the two modules
only add what differs (boolean keep vectors vs sorted index selections).

The model contract: a flat ``nn.Sequential`` of ``Linear``/``Conv2d`` weight layers, optional
``BatchNorm1d/2d`` (and, where a subclass allows it, HeteroFL's ``Scaler``) after a weight layer,
and unit-preserving modules in between (activations, pools, dropout, ``Flatten``). Every weight
layer but the last (the classifier, whose rows are class logits) is *hidden*: its output units can
be cut. Unit ``u`` of a hidden layer owns row/filter ``u`` of the weight, bias ``u``, BatchNorm entry
``u`` and the input columns of the next weight layer that ``u`` feeds (one column, one channel, or —
after ``conv → Flatten`` — the ``H'·W'`` consecutive features of channel ``u``). ResNets (skip
connections couple units across layers) are refused with ``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from shared.models.layers import Scaler

#: activations: where a hidden layer's units are scored (FedDSE) or silenced (FjORD)
ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid)
#: modules that map unit ``u`` of their input to unit ``u`` of their output (or are shape-only)
PASSTHROUGH = (
    *ACTIVATIONS,
    nn.Dropout,
    nn.Dropout2d,
    nn.Identity,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.Flatten,
)


@dataclass(frozen=True)
class WeightLayer:
    """One ``Linear``/``Conv2d`` layer of the chain."""

    name: str
    kind: Literal["linear", "conv"]
    units: int
    #: the weight layer feeding this one (None for the first) and the input features each of its
    #: units feeds (1, or H'·W' for the first Linear after conv + Flatten)
    source: str | None
    group: int
    in_dim: int
    hidden: bool
    #: kernel area (1 for Linear) and output positions per sample (H_out·W_out, 1 for Linear):
    #: forward MACs = kept weights · positions
    kernel: int
    positions: int


@dataclass(frozen=True)
class TensorRule:
    """Which hidden layer's units govern axis 0 (``out``) and axis 1 (``src``, expanded by ``group``)."""

    out: str | None
    src: str | None
    group: int


def output_shapes(model: nn.Sequential, input_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each child's output shape for a zero batch of 2, in eval mode (BN statistics untouched)."""
    shapes: dict[str, tuple[int, ...]] = {}
    x = torch.zeros((2, *input_shape))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for name, m in model.named_children():
                x = m(x)
                shapes[name] = tuple(int(d) for d in x.shape)
    finally:
        model.train(was)
    return shapes


class UnitGraph:
    """Layers, unit owners and per-tensor rules of one architecture (see the module docstring).

    Subclasses set :attr:`PURPOSE` (for error messages), :attr:`ALLOW_SCALER` and
    :attr:`MIN_WEIGHT_LAYERS`, and add the operations their algorithms need.
    """

    PURPOSE: ClassVar[str] = "unit-structured cutting"
    ALLOW_SCALER: ClassVar[bool] = False
    MIN_WEIGHT_LAYERS: ClassVar[int] = 1

    def __init__(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        if not isinstance(model, nn.Sequential):
            raise ValueError(f"{self.PURPOSE} needs a flat nn.Sequential model, got {type(model).__name__}")
        self.input_shape = tuple(int(d) for d in input_shape)
        children = list(model.named_children())
        out_shapes = output_shapes(model, self.input_shape)
        weight_names = [n for n, m in children if isinstance(m, nn.Linear | nn.Conv2d)]
        if len(weight_names) < self.MIN_WEIGHT_LAYERS:
            raise ValueError(
                f"{self.PURPOSE} needs at least {self.MIN_WEIGHT_LAYERS} Linear/Conv2d layer(s), "
                f"the model has {len(weight_names)}"
            )
        layers: list[WeightLayer] = []
        owner: dict[str, str] = {}  # BN / Scaler module -> the weight layer whose units it carries
        score_at: dict[str, str] = {}  # hidden layer -> module whose output is its activation
        prev: WeightLayer | None = None
        supported = "Linear, Conv2d, BatchNorm, " + ("Scaler, " if self.ALLOW_SCALER else "")
        for name, m in children:
            if isinstance(m, nn.Linear | nn.Conv2d):
                prev = self._weight_layer(name, m, prev, out_shapes[name], name != weight_names[-1])
                layers.append(prev)
            elif isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                if prev is None or m.num_features != prev.units:
                    raise ValueError(f"{name}: BatchNorm must follow a weight layer with as many units")
                owner[name] = prev.name
            elif self.ALLOW_SCALER and isinstance(m, Scaler):
                if prev is None:
                    raise ValueError(f"{name}: Scaler must follow a weight layer")
                owner[name] = prev.name
            elif isinstance(m, PASSTHROUGH):
                if (
                    isinstance(m, ACTIVATIONS)
                    and prev is not None
                    and prev.hidden
                    and prev.name not in score_at
                ):
                    score_at[prev.name] = name
            else:
                raise ValueError(
                    f"{name}: {type(m).__name__} is not supported by {self.PURPOSE} "
                    f"(supported: {supported}activations, pools, dropout, Flatten)"
                )
        self.layers: dict[str, WeightLayer] = {layer.name: layer for layer in layers}
        self.hidden: list[str] = [layer.name for layer in layers if layer.hidden]
        self.classifier: str = layers[-1].name
        self.owner = owner
        #: the module whose output scores a hidden layer's units: its first activation (post-ReLU);
        #: a layer with no activation before the next weight layer is scored at its own output
        self.score_at = {h: score_at.get(h, h) for h in self.hidden}
        self.rules: dict[str, TensorRule] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.param_names: list[str] = [n for n, _ in model.named_parameters()]
        for key, t in model.state_dict().items():
            if not t.is_floating_point():
                continue  # BN's num_batches_tracked: stays on the server
            module = key.rsplit(".", 1)[0]
            self.shapes[key] = tuple(t.shape)
            if module in self.layers:
                layer = self.layers[module]
                src = layer.source if key.endswith(".weight") else None
                self.rules[key] = TensorRule(module if layer.hidden else None, src, layer.group if src else 1)
            elif module in owner:
                carrier = owner[module]
                self.rules[key] = TensorRule(carrier if self.layers[carrier].hidden else None, None, 1)
            else:
                raise ValueError(f"{key}: a tensor of a module {self.PURPOSE} does not support")
        self.total_params = sum(math.prod(self.shapes[n]) for n in self.param_names)
        #: per-sample activation sizes (elements) of each child's output, for memory estimates
        self.child_out = [int(math.prod(out_shapes[n][1:])) for n, _ in children]
        self.input_numel = int(math.prod(self.input_shape))

    @staticmethod
    def _weight_layer(
        name: str,
        m: nn.Linear | nn.Conv2d,
        prev: WeightLayer | None,
        out_shape: tuple[int, ...],
        hidden: bool,
    ) -> WeightLayer:
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or (prev is not None and prev.kind == "linear")):
            raise ValueError(f"{name}: grouped convs and convs after Linear layers are not supported")
        fan_in = m.in_features if isinstance(m, nn.Linear) else m.in_channels
        group = 1
        if prev is not None:
            if fan_in % prev.units:
                raise ValueError(
                    f"{name}: {fan_in} inputs are not a whole number per unit of {prev.name} "
                    f"({prev.units} units)"
                )
            group = fan_in // prev.units
            if isinstance(m, nn.Conv2d) and group != 1:
                raise ValueError(f"{name}: input channels do not match {prev.name}'s filters")
        return WeightLayer(
            name=name,
            kind="linear" if isinstance(m, nn.Linear) else "conv",
            units=m.out_features if isinstance(m, nn.Linear) else m.out_channels,
            source=prev.name if prev is not None else None,
            group=group,
            in_dim=fan_in,
            hidden=hidden,
            kernel=1 if isinstance(m, nn.Linear) else int(math.prod(m.kernel_size)),
            # (batch, units, *spatial): the spatial positions, 1 for a Linear's (batch, units)
            positions=int(math.prod(out_shape[2:])),
        )
