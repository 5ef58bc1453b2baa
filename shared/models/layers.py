"""Small building blocks shared by the model definitions."""

from __future__ import annotations

import torch
from torch import nn


class Scaler(nn.Module):
    """HeteroFL's scaler: divide by the width ``rate`` in training mode only.

    A width-``rate`` sub-model's activations are about ``rate`` times the full model's; scaling
    them back while training lets the sub-model's weights be averaged into the full model's.
    At evaluation the module is the identity, as in HeteroFL and FedDSE.
    """

    def __init__(self, rate: float) -> None:
        super().__init__()
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"scaler rate must be in (0, 1], got {rate}")
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if self.training else x

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Output length of a convolution or pooling along one axis (floor mode, as PyTorch)."""
    return (size + 2 * padding - kernel) // stride + 1


def image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """``(C, H, W)`` of an image input, with an error naming ``model`` when it is not one."""
    if len(input_shape) != 3 or any(int(d) < 1 for d in input_shape):
        raise ValueError(f"model {model!r} needs an image input shape (C, H, W), got {tuple(input_shape)}")
    c, h, w = (int(d) for d in input_shape)
    return c, h, w


def check_spatial(model: str, input_shape: tuple[int, ...], h: int, w: int) -> None:
    """Refuse inputs too small for the model's convolutions and pools (they would fail in forward)."""
    if h < 1 or w < 1:
        raise ValueError(f"input {tuple(input_shape)} is too small for model {model!r} (feature map {h}x{w})")
