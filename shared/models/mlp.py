"""The fully connected model used by most small-scale reproductions (digits, HAR)."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn


class MLP(nn.Sequential):
    """Flatten, then ``fc1, relu1, ..., fcN``; a Sequential so layer names and order are stable.

    Algorithms address layers by name (thresholds, masks, per-layer aggregation), so the names
    ``fc1..fcN`` are part of the wire contract, not decoration.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: Sequence[int] = (128, 64),
        bias: bool = True,
    ) -> None:
        widths = [int(h) for h in hidden]
        if any(h < 1 for h in widths):
            raise ValueError(f"mlp hidden widths must be positive, got {list(hidden)}")
        in_features = math.prod(int(d) for d in input_shape)
        layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
        sizes = [in_features, *widths, num_classes]
        for i, (a, b) in enumerate(itertools.pairwise(sizes), start=1):
            layers[f"fc{i}"] = nn.Linear(a, b, bias=bias)
            if i < len(sizes) - 1:
                layers[f"relu{i}"] = nn.ReLU()
        super().__init__(layers)
        self.hidden = widths
