"""Models for the step benchmarks, written with plain ``torch.nn`` (no torchvision).

``resnet50`` has exactly torchvision's ResNet-50 parameter list (161 tensors,
25.56M elements at width 64): conv1/bn1, four stages of bottlenecks (3, 4, 6,
3 blocks, a projection shortcut in each stage's first block) and the fc layer.
"""
from __future__ import annotations

from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool) -> None:
        super().__init__()
        width, out = planes, planes * 4
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(
            nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out),
        ) if downsample else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50(nn.Module):
    def __init__(self, width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, inplanes = [], width
        for stage, blocks in enumerate((3, 4, 6, 3)):
            planes = width * 2 ** stage
            stride = 1 if stage == 0 else 2
            blocks_ = [Bottleneck(inplanes, planes, stride, True)]
            inplanes = planes * 4
            blocks_ += [Bottleneck(inplanes, planes, 1, False) for _ in range(blocks - 1)]
            layers.append(nn.Sequential(*blocks_))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet50(width: int = 64, num_classes: int = 1000) -> nn.Module:
    return ResNet50(width, num_classes)
