"""The gradient sets the benchmarks use, written with plain ``torch.nn`` (no torchvision).

Two families of parameter lists, each scalable to a target size while keeping
its tensor count and its mix of large and small tensors:

- ``resnet50``: exactly torchvision's ResNet-50 parameter list (161 tensors,
  25,557,032 elements at width 64 with 1000 classes): conv1/bn1, four stages
  of bottlenecks (3, 4, 6, 3 blocks, a projection shortcut in each stage's
  first block) and the fc layer. ``ResNet50`` is the trainable module,
  ``resnet50_shapes`` its parameter shapes.
- ``transformer``: a GPT-2-style decoder's parameter shapes (147 tensors).
- ``linear-stack``: few large tensors, a transformer's MLPs alone: 3 blocks
  of ``Linear(d, 4d)`` and ``Linear(4d, d)`` (12 tensors; at d=512 six
  512x2048 weights, 6,299,136 elements). ``LinearStack`` is the trainable
  module (the sharded benchmark's); it is not in ``TENSOR_LISTS``.

``resnet50_for_size`` / ``transformer_for_size`` pick the width whose
parameter count is nearest a requested element count (the CLI's ``--sizes``);
the class count and the vocabulary grow with the width, so every size has the
same proportions as the full model.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

Shape = Tuple[int, ...]

RESNET50_FULL_WIDTH = 64
TRANSFORMER_FULL_WIDTH = 384
LINEAR_STACK_FULL_WIDTH = 512
LINEAR_STACK_BLOCKS = 3


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
    """ResNet-50 at any ``width`` (64 is torchvision's), for the training-step benchmarks."""

    def __init__(self, width: int = RESNET50_FULL_WIDTH, num_classes: int = 1000) -> None:
        super().__init__()
        self.num_classes = num_classes
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


def resnet50_classes(width: int) -> int:
    """The class count that keeps the fc layer's share of the model at every width."""
    return max(1, round(1000 * width / RESNET50_FULL_WIDTH))


def resnet50_shapes(width: int = RESNET50_FULL_WIDTH, num_classes: int = 1000) -> List[Shape]:
    """The parameter shapes of ``ResNet50(width, num_classes)``, in ``named_parameters`` order.

    Bottleneck blocks (1x1, 3x3, 1x1 convolutions, each followed by batch-norm
    weight and bias) in four stages of 3, 4, 6 and 3 blocks; the first block of
    each stage has a 1x1 downsample convolution and its batch norm.
    """
    shapes: List[Shape] = [(width, 3, 7, 7), (width,), (width,)]
    inplanes = width
    for planes, blocks in ((width, 3), (2 * width, 4), (4 * width, 6), (8 * width, 3)):
        outplanes = 4 * planes
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (outplanes, planes, 1, 1), (outplanes,), (outplanes,)]
            if block == 0:
                shapes += [(outplanes, inplanes, 1, 1), (outplanes,), (outplanes,)]
            inplanes = outplanes
    return shapes + [(num_classes, inplanes), (num_classes,)]


def transformer_vocab(d_model: int) -> int:
    """The vocabulary that keeps the embedding at 23% of the model, as at d=384, 16384 tokens."""
    return max(1, round(16384 * d_model / TRANSFORMER_FULL_WIDTH))


def transformer_shapes(d_model: int = TRANSFORMER_FULL_WIDTH, n_layers: int = 12,
                       vocab: int = 16384) -> List[Shape]:
    """A GPT-2-style decoder: token embedding, ``n_layers`` blocks, final layer norm.

    Each block has layer norm 1 (weight, bias), the fused QKV projection
    ``3d x d`` and bias, the output projection ``d x d`` and bias, layer norm 2,
    and the MLP ``4d x d`` + bias, ``d x 4d`` + bias: 12 tensors per block.
    GPT-2 small's depth and mix of a few large matrices and many small vectors
    at half its width and a 16384-token vocabulary: 27.6M elements by default.
    """
    d = d_model
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
             (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d)] + block * n_layers + [(d,), (d,)]


def n_elements(shapes: Sequence[Shape]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def _nearest_width(count: Callable[[int], int], target: int, full_width: int,
                   full_count: int) -> int:
    # the count grows as width**2 (plus a linear term from the vectors): start
    # from the quadratic estimate and step to the nearest integer width
    width = max(1, round(full_width * math.sqrt(target / full_count)))
    while width > 1 and abs(count(width - 1) - target) <= abs(count(width) - target):
        width -= 1
    while abs(count(width + 1) - target) < abs(count(width) - target):
        width += 1
    return width


def resnet50_width_for_size(n: int) -> int:
    """The ResNet-50 width whose parameter count is nearest ``n`` elements."""
    def count(width: int) -> int:
        return n_elements(resnet50_shapes(width, resnet50_classes(width)))
    return _nearest_width(count, n, RESNET50_FULL_WIDTH, count(RESNET50_FULL_WIDTH))


def resnet50_for_size(n: int) -> ResNet50:
    """A ``ResNet50`` with about ``n`` parameters (161 tensors at any size)."""
    width = resnet50_width_for_size(n)
    return ResNet50(width, resnet50_classes(width))


def resnet50_shapes_for_size(n: int) -> List[Shape]:
    width = resnet50_width_for_size(n)
    return resnet50_shapes(width, resnet50_classes(width))


def transformer_shapes_for_size(n: int) -> List[Shape]:
    """The ``transformer_shapes`` (12 blocks, 147 tensors) with about ``n`` elements."""
    def count(d: int) -> int:
        return n_elements(transformer_shapes(d, vocab=transformer_vocab(d)))
    d = _nearest_width(count, n, TRANSFORMER_FULL_WIDTH, count(TRANSFORMER_FULL_WIDTH))
    return transformer_shapes(d, vocab=transformer_vocab(d))


class MLPBlock(nn.Module):
    """``x + Linear(4d, d)(gelu(Linear(d, 4d)(x)))``: a transformer's MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class LinearStack(nn.Module):
    """``n_blocks`` ``MLPBlock``s of width ``d``: few large tensors, the shape
    on which a sharded step's cost is its elements, not its tensor count."""

    def __init__(self, d: int = LINEAR_STACK_FULL_WIDTH,
                 n_blocks: int = LINEAR_STACK_BLOCKS) -> None:
        super().__init__()
        self.width = d
        self.blocks = nn.Sequential(*(MLPBlock(d) for _ in range(n_blocks)))

    def forward(self, x):
        return self.blocks(x)


def linear_stack_shapes(d: int = LINEAR_STACK_FULL_WIDTH,
                        n_blocks: int = LINEAR_STACK_BLOCKS) -> List[Shape]:
    """The parameter shapes of ``LinearStack(d, n_blocks)``: per block the
    ``4d x d`` weight and bias, the ``d x 4d`` weight and bias."""
    return [(4 * d, d), (4 * d,), (d, 4 * d), (d,)] * n_blocks


def linear_stack_width_for_size(n: int) -> int:
    """The ``LinearStack`` width whose parameter count is nearest ``n`` elements."""
    def count(d: int) -> int:
        return n_elements(linear_stack_shapes(d))
    return _nearest_width(count, n, LINEAR_STACK_FULL_WIDTH, count(LINEAR_STACK_FULL_WIDTH))


def linear_stack_for_size(n: int) -> LinearStack:
    """A ``LinearStack`` with about ``n`` parameters (12 tensors at any size)."""
    return LinearStack(linear_stack_width_for_size(n))


def linear_stack_shapes_for_size(n: int) -> List[Shape]:
    return linear_stack_shapes(linear_stack_width_for_size(n))


# the kernel benchmark's tensor lists: name -> shapes for a target element count
TENSOR_LISTS: Dict[str, Callable[[int], List[Shape]]] = {
    "resnet50": resnet50_shapes_for_size,
    "transformer": transformer_shapes_for_size,
}


def gradients(model: str, n: int, dtype: torch.dtype, device: torch.device,
              seed: int) -> List[torch.Tensor]:
    """Random gradients shaped like ``TENSOR_LISTS[model]`` at about ``n``
    parameters (``seed``: the rank, so that every rank holds different ones)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device, dtype)
            for shape in TENSOR_LISTS[model](n)]


def resnet50_gradients(n: int, dtype: torch.dtype, device: torch.device,
                       seed: int) -> List[torch.Tensor]:
    """``gradients("resnet50", ...)``: a ``ResNet50``'s of about ``n`` parameters."""
    return gradients("resnet50", n, dtype, device, seed)
