"""Build a model by name, so experiment configs (``model.name`` + ``model.options``) choose it."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shared.models.cnn import (
    cnn7,
    cnn_digits,
    cnn_digits_pool,
    cnn_feddse,
    cnn_femnist,
    lenet5_caffe,
    lenet5_fmnist,
    lenet_cifar,
    lenet_emnist,
    tinycnn,
)
from shared.models.mlp import MLP
from shared.models.resnet import resnet18, resnet20


def _mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: list[int] | tuple[int, ...] = (128, 64),
    bias: bool = True,
) -> nn.Module:
    """Flatten + ReLU MLP; the default on digits is 64-128-64-10 (17,226 parameters), the benchmark model."""
    return MLP(input_shape, num_classes, hidden=hidden, bias=bias)


Builder = Callable[..., nn.Module]

#: model name -> builder(input_shape, num_classes, **options)
MODELS: dict[str, Builder] = {
    "mlp": _mlp,
    "cnn_digits": cnn_digits,
    "cnn": cnn_femnist,
    "lenet5_caffe": lenet5_caffe,
    "lenet5_fmnist": lenet5_fmnist,
    "cnn7": cnn7,
    "lenet_cifar": lenet_cifar,
    "lenet_emnist": lenet_emnist,
    "cnn_digits_pool": cnn_digits_pool,
    "tinycnn": tinycnn,
    "cnn_feddse": cnn_feddse,
    "resnet20": resnet20,
    "resnet18": resnet18,
}
#: other names the specs use for the same models
ALIASES: dict[str, str] = {
    "cnn_femnist": "cnn",
    "lenet5": "lenet5_caffe",
    "conv4": "cnn7",
    "cnn_spafl": "cnn7",
}
MODEL_NAMES: tuple[str, ...] = tuple(MODELS)


def model_options(name: str) -> tuple[str, ...]:
    """The keyword options model ``name`` accepts (besides ``seed``)."""
    builder = MODELS[_canonical(name)]
    params = inspect.signature(builder).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int | None = None, **kwargs: Any
) -> nn.Module:
    """Build model ``name`` for samples of ``input_shape`` and ``num_classes`` outputs (logits).

    Initialisation draws from torch's global RNG, so ``torch.manual_seed(s)`` before the call makes
    it reproducible. Passing ``seed`` instead seeds a forked RNG and leaves the global one alone,
    which is how the server and every client agree on w(0) without shipping it.
    Unknown options raise ``ValueError`` naming the valid ones: a typo in a config must not
    silently build a different model.
    """
    key = _canonical(name)
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"input_shape must be non-empty and positive, got {tuple(input_shape)}")
    valid = model_options(key)
    for option in kwargs:
        if option not in valid:
            hint = difflib.get_close_matches(option, valid, n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            listed = ", ".join(valid) if valid else "none"
            raise ValueError(f"model {key!r} has no option {option!r}{did_you_mean}; valid options: {listed}")
    builder = MODELS[key]
    if seed is None:
        return builder(shape, int(num_classes), **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(shape, int(num_classes), **kwargs)


def he_normal_(model: nn.Module, seed: int) -> None:
    """Re-initialise every ``Linear``/``Conv`` weight as N(0, 2/fan_in) and zero its bias, in place.

    He et al.'s init for ReLU networks, the usual choice of a hand-written numpy MLP (and, by our
    measurement, of the Hermes spec's prototype). Drawn from a generator seeded by ``seed`` so the
    global torch RNG is left alone; BatchNorm and other layers keep their own init.
    """
    gen = torch.Generator().manual_seed(seed % (2**63))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.normal_(0.0, math.sqrt(2.0 / fan_in), generator=gen)
                if m.bias is not None:
                    m.bias.zero_()


INITS: dict[str, Callable[[nn.Module, int], None] | None] = {"default": None, "he_normal": he_normal_}


def initialise(model: nn.Module, scheme: str, seed: int) -> nn.Module:
    """Apply the named init ``scheme`` (``model.init`` of the config) to ``model``; returns it."""
    if scheme not in INITS:
        raise ValueError(f"unknown init {scheme!r}; valid: {', '.join(INITS)}")
    fn = INITS[scheme]
    if fn is not None:
        fn(model, seed)
    return model


def num_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter entries (BN's gamma/beta included, its running statistics not: buffers)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _canonical(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    return key
