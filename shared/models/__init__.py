"""Torch models by name: the MLP, the specs' small CNNs and CIFAR ResNets, with stable layer names."""

from shared.models.factory import (
    ALIASES,
    INITS,
    MODEL_NAMES,
    MODELS,
    build_model,
    he_normal_,
    initialise,
    model_options,
    num_parameters,
)
from shared.models.layers import Scaler
from shared.models.mlp import MLP
from shared.models.resnet import BasicBlock, ResNet

__all__ = [
    "ALIASES",
    "INITS",
    "MLP",
    "MODELS",
    "MODEL_NAMES",
    "BasicBlock",
    "ResNet",
    "Scaler",
    "build_model",
    "he_normal_",
    "initialise",
    "model_options",
    "num_parameters",
]
