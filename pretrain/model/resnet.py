"""The BiT ResNet stem of the ViT hybrids (paper §3.1; VT `vit_jax/models_resnet.py`): `ResNetStem`.

No pre-activation, weight-standardized convolutions, GroupNorm(32, eps 1e-6). Official weights need TF "SAME"
padding: stride-2 layers pad the odd row/column at the bottom/right, the max-pool pads with −inf. Parameter names
are the official keys.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

GN_GROUPS = 32
GN_EPS = 1e-6  # Flax nn.GroupNorm default
WS_EPS = 1e-5  # VT's: (w - mean) / (std + eps)


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF "SAME" padding of one dim: (before, after), the odd pixel after."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """Pad NCHW so that a VALID conv/pool afterwards equals TF's SAME."""
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """Bias-free TF-SAME conv, kernel standardized per output channel (population std)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / (std + WS_EPS)
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, w, None, self.stride)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GN_GROUPS, channels, eps=GN_EPS)


class ResidualUnit(nn.Module):
    """Bottleneck unit: 1x1 → 3x3 (stride here) → 1x1 (4x), each StdConv + GN; ReLU after the residual add."""

    def __init__(self, in_channels: int, features: int, stride: int):
        super().__init__()
        out_channels = 4 * features
        self.needs_projection = in_channels != out_channels or stride != 1
        if self.needs_projection:
            self.conv_proj = StdConv2d(in_channels, out_channels, 1, stride)
            self.gn_proj = group_norm(out_channels)
        self.conv1 = StdConv2d(in_channels, features, 1)
        self.gn1 = group_norm(features)
        self.conv2 = StdConv2d(features, features, 3, stride)
        self.gn2 = group_norm(features)
        self.conv3 = StdConv2d(features, out_channels, 1)
        self.gn3 = group_norm(out_channels)
        # zero last GN scale: every unit starts as the identity (BiT / VT init)
        nn.init.zeros_(self.gn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.gn_proj(self.conv_proj(x)) if self.needs_projection else x
        y = F.relu(self.gn1(self.conv1(x)))
        y = F.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return F.relu(residual + y)


class ResNetStage(nn.Module):
    def __init__(self, in_channels: int, features: int, num_units: int, first_stride: int):
        super().__init__()
        # unit1..unitN: the official keys
        self.units = nn.ModuleDict()
        for u in range(num_units):
            stride = first_stride if u == 0 else 1
            self.units[f"unit{u + 1}"] = ResidualUnit(in_channels, features, stride)
            in_channels = 4 * features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units.values():
            x = unit(x)
        return x


class ResNetStem(nn.Module):
    """Root (StdConv 7x7/2, GN, ReLU, max-pool 3x3/2), then bottleneck stages, each after the first halving the
    resolution; `stages=()`: the root alone."""

    def __init__(self, stages: tuple[int, ...], width_factor: float = 1, in_chans: int = 3):
        super().__init__()
        width = root_width(width_factor)
        self.conv_root = StdConv2d(in_chans, width, 7, stride=2)
        self.gn_root = group_norm(width)
        self.stages = nn.ModuleDict()
        in_channels = width
        for s, num_units in enumerate(stages):
            features = width * 2**s
            self.stages[f"block{s + 1}"] = ResNetStage(in_channels, features, num_units, 1 if s == 0 else 2)
            in_channels = 4 * features
        self.out_channels = in_channels
        self.stride = stem_stride(stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) → (B, out_channels, H/stride, W/stride)
        x = F.relu(self.gn_root(self.conv_root(x)))
        x = F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)
        for stage in self.stages.values():
            x = stage(x)
        return x


def root_width(width_factor: float) -> int:
    """`conv_root`'s channels as VT computes them; stage widths derive from it."""
    return int(64 * width_factor)


def check_width_factor(width_factor: float, field: str = "width_factor") -> None:
    """ValueError naming `field` unless 32 GroupNorm groups divide the root width."""
    real = isinstance(width_factor, numbers.Real) and not isinstance(width_factor, bool)
    if not real or not (0 < width_factor < math.inf):
        raise ValueError(
            f"{field} must be a positive number (the ResNet width factor, e.g. 0.5, 1 or 2), got {width_factor!r}"
        )
    width = root_width(width_factor)
    if width < GN_GROUPS or width % GN_GROUPS:
        raise ValueError(
            f"{field}={width_factor!r} gives a ResNet root of int(64 * {width_factor!r}) = {width} channels, which "
            f"the {GN_GROUPS} groups of its GroupNorms cannot divide (the official code refuses it too); use a "
            f"multiple of {GN_GROUPS / 64:g} such as 0.5, 1, 1.5 or 2"
        )


def stem_stride(stages: tuple[int, ...]) -> int:
    return 4 * 2 ** max(len(stages) - 1, 0)


def stem_out_channels(stages: tuple[int, ...], width_factor: float = 1) -> int:
    width = root_width(width_factor)
    return 4 * width * 2 ** (len(stages) - 1) if stages else width
