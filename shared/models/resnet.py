"""CIFAR-style residual networks: ResNet20 (EmbracingFL) and ResNet-18 (SpaFL, FedMef).

Both are ``nn.Sequential`` of ``conv1, bn1, relu, layer1.., pool, flatten, fc`` so that
"the first conv + the first k residual blocks" (EmbracingFL's cut) is a prefix of
``model.children()`` plus a prefix of the blocks, with the usual ``layerS.B.conv1`` names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from shared.models.layers import check_spatial, conv_out, image_shape


class BasicBlock(nn.Module):
    """Two bias-free 3x3 convs with BN; the shortcut is a 1x1 conv + BN when ``projection``."""

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, projection: bool, track_running_stats: bool
    ) -> None:
        super().__init__()
        if not projection and (stride != 1 or in_channels != out_channels):
            raise ValueError("a block that changes shape needs a projection shortcut")
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels, track_running_stats=track_running_stats)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels, track_running_stats=track_running_stats)
        self.shortcut: nn.Module = (
            nn.Sequential(
                OrderedDict(
                    conv=nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                    bn=nn.BatchNorm2d(out_channels, track_running_stats=track_running_stats),
                )
            )
            if projection
            else nn.Identity()
        )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Sequential):
    """A 3x3-stem residual net over ``widths`` stages of ``blocks_per_stage`` basic blocks each.

    Stage ``s > 1`` starts with stride 2. ``project_every_stage`` puts a projection shortcut in
    every stage's first block even when shapes match (EmbracingFL's ResNet20); otherwise only
    where shapes change (the usual ResNet-18).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        widths: Sequence[int],
        blocks_per_stage: int,
        project_every_stage: bool,
        track_running_stats: bool = True,
        name: str = "resnet",
    ) -> None:
        c, h, w = image_shape(input_shape, name)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["conv1"] = nn.Conv2d(c, widths[0], 3, padding=1, bias=False)
        layers["bn1"] = nn.BatchNorm2d(widths[0], track_running_stats=track_running_stats)
        layers["relu"] = nn.ReLU()
        cin = widths[0]
        for s, cout in enumerate(widths, start=1):
            stride = 1 if s == 1 else 2
            stage = []
            for b in range(blocks_per_stage):
                first = b == 0
                projection = first and (project_every_stage or stride != 1 or cin != cout)
                stage.append(BasicBlock(cin, cout, stride if first else 1, projection, track_running_stats))
                cin = cout
            layers[f"layer{s}"] = nn.Sequential(*stage)
            h, w = conv_out(h, 3, stride, 1), conv_out(w, 3, stride, 1)
        check_spatial(name, input_shape, h, w)
        layers["pool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["fc"] = nn.Linear(cin, num_classes)
        super().__init__(layers)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def blocks(self) -> list[BasicBlock]:
        """All residual blocks in forward order (EmbracingFL cuts after the k-th)."""
        return [m for m in self.modules() if isinstance(m, BasicBlock)]


def resnet20(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    track_running_stats: bool = True,
    stage1_projection: bool = True,
) -> ResNet:
    """The CIFAR ResNet20 of EmbracingFL: 16/32/64 channels, 3 blocks per stage.

    With the projection shortcut also in stage 1 (``stage1_projection``, EmbracingFL Table 1's
    counting) it has exactly 272,762 parameters for 10 classes; without, the textbook 272,474.
    """
    return ResNet(
        input_shape,
        num_classes,
        widths=(16, 32, 64),
        blocks_per_stage=3,
        project_every_stage=stage1_projection,
        track_running_stats=track_running_stats,
        name="resnet20",
    )


def resnet18(
    input_shape: tuple[int, ...], num_classes: int, *, width: int = 64, track_running_stats: bool = True
) -> ResNet:
    """CIFAR ResNet-18 (3x3 stem, 2 blocks per stage, widths ``width * (1, 2, 4, 8)``).

    ``width=64`` is the full network whose conv weights SpaFL counts (11,159,232); ``width=32`` is
    the half-width variant of its code.
    """
    if width < 1:
        raise ValueError(f"resnet18 width must be >= 1, got {width}")
    return ResNet(
        input_shape,
        num_classes,
        widths=tuple(width * m for m in (1, 2, 4, 8)),
        blocks_per_stage=2,
        project_every_stage=False,
        track_running_stats=track_running_stats,
        name="resnet18",
    )
