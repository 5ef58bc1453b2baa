"""The small CNNs the five papers' specs use, each an ``nn.Sequential`` with stable layer names.

Layer names (``conv1``, ``bn1``, ``fc2`` ...) are how algorithms address layers for masks,
thresholds, cuts and per-layer aggregation, so they are chosen once here and kept.
Where a spec pins a parameter count, ``tests/test_models.py`` checks it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from shared.models.layers import Scaler, check_spatial, conv_out, image_shape


def _two_conv_net(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    channels: tuple[int, int],
    kernel: int,
    padding: int = 0,
    hidden: Sequence[int] = (),
    bias: bool = True,
    relu_between_fc: bool = True,
    batch_norm: bool = False,
) -> nn.Sequential:
    """The LeNet family: 2x [conv, ReLU, 2x2 max-pool], flatten, FC layers (``hidden`` then the
    classes) with ReLUs between them. Layers are made in forward order, so a seeded build draws the
    same initial weights as a hand-written ``nn.Sequential`` of the same layers."""
    c, h, w = image_shape(input_shape, name)
    for _ in channels:
        h, w = conv_out(h, kernel, 1, padding) // 2, conv_out(w, kernel, 1, padding) // 2
    check_spatial(name, input_shape, h, w)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    cin = c
    for i, cout in enumerate(channels, start=1):
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, kernel, padding=padding, bias=bias)
        if batch_norm:
            layers[f"bn{i}"] = nn.BatchNorm2d(cout)
        layers[f"relu{i}"] = nn.ReLU()
        layers[f"pool{i}"] = nn.MaxPool2d(2)
        cin = cout
    layers["flatten"] = nn.Flatten()
    sizes = [cin * h * w, *hidden, num_classes]
    relu = len(channels) + 1
    for j in range(len(sizes) - 1):
        layers[f"fc{j + 1}"] = nn.Linear(sizes[j], sizes[j + 1], bias=bias)
        if relu_between_fc and j < len(sizes) - 2:
            layers[f"relu{relu}"] = nn.ReLU()
            relu += 1
    return nn.Sequential(layers)


def cnn_digits(
    input_shape: tuple[int, ...], num_classes: int, *, track_running_stats: bool = True
) -> nn.Sequential:
    """EmbracingFL §8's BN ablation CNN for 8x8 digits: three 3x3 conv+BN+ReLU, GAP, FC.

    Channels 16, 32 (stride 2), 64 (stride 2); convs have no bias because BN follows.
    ``track_running_stats=False`` gives static BN (batch statistics also at evaluation).
    """
    c, h, w = image_shape(input_shape, "cnn_digits")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    channels = [c, 16, 32, 64]
    for i, stride in enumerate((1, 2, 2), start=1):
        layers[f"conv{i}"] = nn.Conv2d(channels[i - 1], channels[i], 3, stride=stride, padding=1, bias=False)
        layers[f"bn{i}"] = nn.BatchNorm2d(channels[i], track_running_stats=track_running_stats)
        layers[f"relu{i}"] = nn.ReLU()
        h, w = conv_out(h, 3, stride, 1), conv_out(w, 3, stride, 1)
    check_spatial("cnn_digits", input_shape, h, w)
    layers["pool"] = nn.AdaptiveAvgPool2d(1)
    layers["flatten"] = nn.Flatten()
    layers["fc"] = nn.Linear(64, num_classes)
    return nn.Sequential(layers)


def cnn_femnist(input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 2048) -> nn.Sequential:
    """LEAF's FEMNIST CNN (EmbracingFL's "CNN"): conv5x5 32, pool, conv5x5 64, pool, dense, out.

    "Same" padding and 2x2 max-pools, so 28x28 gives 7*7*64 = 3136 features; with ``hidden=2048``
    and 62 classes that is 6,603,710 parameters (EmbracingFL Table 1). ``hidden`` may be smaller
    for CPU-sized runs.
    """
    if hidden < 1:
        raise ValueError(f"cnn hidden must be >= 1, got {hidden}")
    return _two_conv_net(
        "cnn", input_shape, num_classes, channels=(32, 64), kernel=5, padding=2, hidden=(hidden,)
    )


def lenet5_caffe(
    input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 500, bias: bool = False
) -> nn.Sequential:
    """SpaFL's FMNIST model (Lenet-5-Caffe): conv5x5 20, pool, conv5x5 50, pool, FC 500, FC out.

    No padding and no biases by default: on 28x28 that is exactly the paper's 430,500 weights and
    580 thresholds (one per output unit of the four layers).
    """
    return _two_conv_net(
        "lenet5_caffe", input_shape, num_classes, channels=(20, 50), kernel=5, hidden=(hidden,), bias=bias
    )


def cnn7(
    input_shape: tuple[int, ...], num_classes: int, *, bias: bool = False, track_running_stats: bool = True
) -> nn.Sequential:
    """SpaFL's CIFAR-10 "CNN with seven layers" (code name ``conv4``): 4 conv5x5 + 3 FC, with BN.

    conv 64, conv 64, pool, conv 128, conv 128, pool, FC 128, FC 128, FC out; every conv/FC but the
    last is followed by BN and ReLU. On 32x32 the seven layers hold 804,800 weights and 650 output
    units, the counts of the authors' code (the paper prints 807,366 / 1,418, see spafl.md §9.11).
    """
    c, h, w = image_shape(input_shape, "cnn7")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    plan = [(c, 64, False), (64, 64, True), (64, 128, False), (128, 128, True)]
    for i, (cin, cout, pool) in enumerate(plan, start=1):
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, 5, bias=bias)
        layers[f"bn{i}"] = nn.BatchNorm2d(cout, track_running_stats=track_running_stats)
        layers[f"relu{i}"] = nn.ReLU()
        h, w = conv_out(h, 5), conv_out(w, 5)
        if pool:
            layers[f"pool{i}"] = nn.MaxPool2d(2)
            h, w = h // 2, w // 2
    check_spatial("cnn7", input_shape, h, w)
    layers["flatten"] = nn.Flatten()
    sizes = [128 * h * w, 128, 128]
    for j in range(2):
        k = 5 + j
        layers[f"fc{j + 1}"] = nn.Linear(sizes[j], sizes[j + 1], bias=bias)
        layers[f"bn{k}"] = nn.BatchNorm1d(sizes[j + 1], track_running_stats=track_running_stats)
        layers[f"relu{k}"] = nn.ReLU()
    layers["fc3"] = nn.Linear(128, num_classes, bias=bias)
    return nn.Sequential(layers)


def lenet_cifar(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Hermes' IC-CIFAR10 model (LotteryFL ``CNNCifar``): classic LeNet-5, 62,006 parameters on CIFAR-10."""
    return _two_conv_net(
        "lenet_cifar", input_shape, num_classes, channels=(6, 16), kernel=5, hidden=(120, 84)
    )


def lenet5_fmnist(
    input_shape: tuple[int, ...], num_classes: int, *, bias: bool = True, batch_norm: bool = False
) -> nn.Sequential:
    """The small LeNet-5 (LeCun et al. 1998) for 28x28 inputs, the papers' CNN scale on 2 cores.

    conv5x5 6, pool, conv5x5 16, pool, FC 120, FC 84, FC out; no padding, so 28x28 leaves 16x4x4 =
    256 features: 44,426 parameters with biases and 10 classes (44,190 without). Why this one: the
    papers' Fashion-MNIST / EMNIST models (SpaFL's Lenet-5-Caffe, 430,500 weights; Hermes' LotteryFL
    CNN, 539,358; EmbracingFL's LEAF CNN, 6.6 M; FedDSE's HeteroFL CNN, 1.56 M) are convolutional
    nets of this shape, 10-150x larger; this one runs a 3-seed, 50-round comparison in minutes on
    a CPU while keeping what the digits MLP lacks -- shared conv filters over 2-D images. ``bias``
    False is SpaFL's convention (one threshold per output unit, no biases). ``batch_norm`` puts a
    BatchNorm after each conv (conv, BN, ReLU, pool): FedMef's FedTiny baseline is the BN model, as
    ``tinycnn``'s option of the same name; added after the BN-free layers draw their weights, so the
    convs and FCs start from the same values with or without it.
    """
    return _two_conv_net(
        "lenet5_fmnist",
        input_shape,
        num_classes,
        channels=(6, 16),
        kernel=5,
        hidden=(120, 84),
        bias=bias,
        batch_norm=batch_norm,
    )


def lenet_emnist(input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 512) -> nn.Sequential:
    """Hermes' IC-EMNIST model (LotteryFL ``CNNFeMnist_sim``): 539,358 parameters with 62 classes.

    As in that code there is no ReLU between the two FC layers (hermes.md §5.2).
    """
    return _two_conv_net(
        "lenet_emnist",
        input_shape,
        num_classes,
        channels=(10, 20),
        kernel=5,
        padding=2,
        hidden=(hidden,),
        relu_between_fc=False,
    )


def cnn_digits_pool(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Hermes §8's optional digits CNN: conv3x3 8, pool, conv3x3 16, pool, FC 32, FC out."""
    return _two_conv_net(
        "cnn_digits_pool", input_shape, num_classes, channels=(8, 16), kernel=3, padding=1, hidden=(32,)
    )


def tinycnn(
    input_shape: tuple[int, ...], num_classes: int, *, batch_norm: bool = False, bias: bool = True
) -> nn.Sequential:
    """FedMef §8's ``TinyCNN``: conv3x3 16, conv3x3 32, 2x2 average pool, FC (512 features on 8x8).

    ``batch_norm=True`` is the FedTiny/FedDST baseline variant (conv, BN, ReLU); FedMef itself
    swaps the convs for its normalised sparse convs and keeps no BN.
    """
    c, h, w = image_shape(input_shape, "tinycnn")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (cin, cout) in enumerate([(c, 16), (16, 32)], start=1):
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, 3, padding=1, bias=bias)
        if batch_norm:
            layers[f"bn{i}"] = nn.BatchNorm2d(cout)
        layers[f"relu{i}"] = nn.ReLU()
    h, w = h // 2, w // 2
    check_spatial("tinycnn", input_shape, h, w)
    layers["pool"] = nn.AvgPool2d(2)
    layers["flatten"] = nn.Flatten()
    layers["fc"] = nn.Linear(32 * h * w, num_classes, bias=bias)
    return nn.Sequential(layers)


def cnn_feddse(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    rate: float = 1.0,
    channels: Sequence[int] = (64, 128, 256, 512),
    static_bn: bool = True,
) -> nn.Sequential:
    """FedDSE's (HeteroFL's) 4-conv CNN: conv3x3+Scaler+BN+ReLU, then 3x [maxpool, same], GAP, FC.

    ``rate`` builds the width-reduced sub-model (``ceil(rate * c)`` channels per layer, as HeteroFL);
    its Scaler divides by ``rate`` while training. ``static_bn`` is the papers' "static batch
    normalisation" (no running statistics). Full width, 1 input channel, 10 classes: 1,556,874
    parameters (feddse.md §4.2).
    """
    c, h, w = image_shape(input_shape, "cnn_feddse")
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"cnn_feddse rate must be in (0, 1], got {rate}")
    widths = [math.ceil(rate * int(ch)) for ch in channels]
    if not widths or min(widths) < 1:
        raise ValueError(f"cnn_feddse channels must be positive, got {list(channels)}")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    cin = c
    for i, cout in enumerate(widths, start=1):
        if i > 1:
            layers[f"pool{i - 1}"] = nn.MaxPool2d(2)
            h, w = h // 2, w // 2
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, 3, padding=1)
        layers[f"scaler{i}"] = Scaler(rate)
        layers[f"bn{i}"] = nn.BatchNorm2d(cout, momentum=None, track_running_stats=not static_bn)
        layers[f"relu{i}"] = nn.ReLU()
        cin = cout
    check_spatial("cnn_feddse", input_shape, h, w)
    layers["gap"] = nn.AdaptiveAvgPool2d(1)
    layers["flatten"] = nn.Flatten()
    fc = nn.Linear(cin, num_classes)
    nn.init.zeros_(fc.bias)
    layers["fc"] = fc
    return nn.Sequential(layers)
