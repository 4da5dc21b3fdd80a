"""Image encoders that turn pixels into a grid of feature vectors (B x C x H x W).

Every encoder normalises per sample (LayerNorm/GroupNorm, or frozen BatchNorm
statistics for pretrained ResNets), never over the batch, so gradient
accumulation and data-parallel runs compute exactly what one big batch would.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmvl.config.components import build_component
from mmvl.errors import UserError, did_you_mean
from mmvl.registry import IMAGE_ENCODERS, register_image_encoder


def add_coords(x: torch.Tensor) -> torch.Tensor:
    """Append two channels holding the pixel's x and y in [-1, 1] (CoordConv), so features know where they are."""
    b, _, h, w = x.shape
    ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype).view(1, 1, h, 1).expand(b, 1, h, w)
    xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype).view(1, 1, 1, w).expand(b, 1, h, w)
    return torch.cat([x, xs, ys], dim=1)


def _groups(channels: int, preferred: int = 8) -> int:
    g = min(preferred, channels)
    while channels % g:
        g -= 1
    return g


class _Checkpointable(nn.Module):
    """Runs ``self.stages`` one by one, under activation checkpointing when enabled and training."""

    stages: nn.ModuleList
    gradient_checkpointing: bool = False

    def enable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = True

    def run_stages(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(stage, x, use_reentrant=False)
            else:
                x = stage(x)
        return x


@register_image_encoder("patch")
class PatchEncoder(_Checkpointable):
    """ViT-style patch embedding: one linear map per non-overlapping ``patch_size`` square."""

    def __init__(self, in_channels: int = 3, out_dim: int = 128, patch_size: int = 15, coords: bool = True):
        super().__init__()
        if patch_size < 1:
            raise UserError(f"patch image encoder: patch_size={patch_size} must be positive.")
        self.coords = coords
        self.out_dim = out_dim
        conv = nn.Conv2d(in_channels + 2 * coords, out_dim, patch_size, stride=patch_size)
        self.stages = nn.ModuleList([nn.Sequential(conv, nn.GroupNorm(1, out_dim))])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.run_stages(add_coords(images) if self.coords else images)


@register_image_encoder("cnn")
class CNNEncoder(_Checkpointable):
    """A small conv stack (conv -> GroupNorm -> ReLU per layer) trained from pixels.

    ``strides`` set the output grid: four stride-2 layers take 75x75 to 5x5.
    ``kernel_size``: one size for every layer, or one per layer (e.g. a cheap 5x5 stride-4 stem:
    ``kernel_size: [5, 3, 3]``, ``strides: [4, 2, 2]``).
    ``coords`` adds CoordConv channels so each cell's feature carries its position.
    """

    def __init__(self, in_channels: int = 3, channels: list[int] | None = None, strides: list[int] | None = None,
                 kernel_size: int | list[int] = 3, coords: bool = True, groups: int = 8):
        super().__init__()
        channels = list(channels or [32, 64, 64, 64])
        strides = list(strides or [2] * len(channels))
        kernels = [int(kernel_size)] * len(channels) if isinstance(kernel_size, int) else list(kernel_size)
        if len(strides) != len(channels) or len(kernels) != len(channels):
            raise UserError(f"cnn image encoder: strides {strides}, kernel sizes {kernel_size} and channels "
                            f"{channels} must have equal lengths.")
        self.coords = coords
        self.out_dim = channels[-1]
        layers, prev = [], in_channels + 2 * coords
        for ch, stride, kernel in zip(channels, strides, kernels):
            layers.append(nn.Sequential(
                nn.Conv2d(prev, ch, kernel, stride=stride, padding=kernel // 2),
                nn.GroupNorm(_groups(ch, groups), ch), nn.ReLU(inplace=True)))
            prev = ch
        self.stages = nn.ModuleList(layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.run_stages(add_coords(images) if self.coords else images)


@register_image_encoder("resnet")
class ResNetEncoder(_Checkpointable):
    """A torchvision ResNet trunk (no pooling/fc) of depth 18, 34, 50, 101 or 152, random init or local
    weights (``pretrained_path``: a torchvision state-dict file, e.g. ``resnet152(weights=...).state_dict()``).

    ``norm``: ``group`` (GroupNorm, for training from scratch) or ``frozen_bn``
    (BatchNorm with fixed statistics, for pretrained weights); both are
    independent of the batch. ``stages`` (1..4) trims the trunk for small images.
    """

    def __init__(self, depth: int = 18, stages: int = 4, pretrained_path: str | None = None,
                 norm: str | None = None, freeze: bool = False):
        super().__init__()
        import torchvision
        from torchvision.ops.misc import FrozenBatchNorm2d

        builders = {18: torchvision.models.resnet18, 34: torchvision.models.resnet34,
                    50: torchvision.models.resnet50, 101: torchvision.models.resnet101,
                    152: torchvision.models.resnet152}  # 152: MMBT's and MMF's image encoder
        if depth not in builders:
            raise UserError(f"resnet image encoder: depth={depth}; use one of {sorted(builders)}.")
        if not 1 <= stages <= 4:
            raise UserError(f"resnet image encoder: stages={stages} must be in 1..4.")
        norm = norm or ("frozen_bn" if pretrained_path else "group")
        norms: dict[str, Callable[[int], nn.Module]] = {
            "group": lambda c: nn.GroupNorm(_groups(c, 32), c), "frozen_bn": FrozenBatchNorm2d}
        if norm not in norms:
            raise UserError(f"resnet image encoder: norm={norm!r}; use 'group' or 'frozen_bn'.{did_you_mean(norm, norms)}")
        net = builders[depth](weights=None, norm_layer=norms[norm])
        if pretrained_path:
            if not os.path.isfile(os.path.expanduser(str(pretrained_path))):
                raise UserError(f"resnet image encoder: pretrained_path {str(pretrained_path)!r} does not exist; "
                                "give a local torchvision state-dict file.")
            state = torch.load(os.path.expanduser(str(pretrained_path)), map_location="cpu", weights_only=True)
            state = {k: v for k, v in state.items() if not k.startswith("fc.")}
            missing, unexpected = net.load_state_dict(state, strict=False)
            bad = [k for k in missing if not k.startswith("fc.")] + list(unexpected)
            if bad:
                raise UserError(f"resnet image encoder: {pretrained_path!r} does not match resnet{depth} "
                                f"with norm={norm!r} (e.g. {bad[:3]}); use norm: frozen_bn for BatchNorm weights.")
        stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        blocks = [net.layer1, net.layer2, net.layer3, net.layer4][:stages]
        self.stages = nn.ModuleList([nn.Sequential(stem, blocks[0]), *blocks[1:]])
        self.out_dim = [64, 128, 256, 512][stages - 1] * (4 if depth >= 50 else 1)
        if freeze:
            self.requires_grad_(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.run_stages(images)


def build_image_encoder(spec: Any) -> nn.Module:
    """``{type: <registered image encoder>, params: {...}}`` (type defaults to cnn) -> an encoder with
    an ``out_dim`` attribute."""
    spec = {"type": "cnn", **dict(spec or {})}
    return build_component(IMAGE_ENCODERS, spec, where="image_encoder")
