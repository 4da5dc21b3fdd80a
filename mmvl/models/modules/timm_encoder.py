"""Image encoder ``timm``: any ``timm.create_model`` backbone as an mmvl image encoder.

timm is the field's library of vision backbones (ViTs, ConvNeXts, ResNets, EVA, ...). The
encoder is always built with ``pretrained=False`` (nothing is downloaded); weights come from a
local file (``pretrained_path``: safetensors, or a ``torch.save`` state dict read weights-only).
It serves both contracts an mmvl model may want:

- ``forward(images) -> B x C x H x W``: the backbone's feature grid (``out_dim`` channels), a
  ViT's patch tokens laid back on their grid (class/register tokens dropped);
- ``pooled(images) -> B x C``: the backbone's own pooled embedding (its ``global_pool``: the
  class token, the token mean, or a CNN's average), what a CLIP image tower projects.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from mmvl.errors import UserError, library_input
from mmvl.registry import register_image_encoder


def read_weights(path: str, where: str) -> dict[str, torch.Tensor]:
    """A local state dict: ``.safetensors`` by safetensors, anything else by ``torch.load(weights_only=True)``."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise UserError(f"{where}: pretrained_path {path!r} does not exist; give a local weights file "
                        "(.safetensors or a torch.save state dict).")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    return state


@register_image_encoder("timm")
class TimmEncoder(nn.Module):
    """``timm.create_model(model_name, pretrained=False, num_classes=0, **kwargs)``, pooled by ``global_pool``.

    ``kwargs`` go to timm unchanged (e.g. ``img_size: 64``, ``depth: 2`` for a small ViT).
    ``pretrained_path``: a local state dict for the backbone; classifier weights in it are
    ignored (the encoder has none), any other key that does not fit is an error naming it.
    """

    def __init__(self, model_name: str | None = "vit_base_patch16_224", pretrained_path: str | None = None,
                 global_pool: str | None = None, kwargs: dict[str, Any] | None = None):
        super().__init__()
        import timm

        model_name = model_name or "vit_base_patch16_224"
        if not timm.is_model(model_name):
            raise UserError(f"timm image encoder: unknown model_name {model_name!r}; see timm.list_models() "
                            "(e.g. vit_tiny_patch16_224, resnet18, convnext_atto).")
        with library_input(f"timm image encoder {model_name} does not build from its kwargs",
                           "fix the kwarg it names (see timm's model signature)."):
            self.model = timm.create_model(model_name, pretrained=False, num_classes=0, **dict(kwargs or {}))
        if global_pool is not None:  # after building: the layers (and a checkpoint's keys) stay the model's own
            self.model.reset_classifier(0, global_pool=global_pool)
        self.model_name = model_name
        self.out_dim = int(self.model.num_features)
        if pretrained_path:
            self.load_weights(read_weights(pretrained_path, "timm image encoder"), str(pretrained_path))

    def load_weights(self, state: dict[str, torch.Tensor], source: str) -> None:
        own = self.model.state_dict()
        head = {k for k in state if k not in own and k.split(".")[0] in ("head", "fc", "classifier")}
        wrong = [k for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
        missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own and k not in head]
        if missing or unexpected or wrong:
            raise UserError(f"timm image encoder: {source!r} does not fit {self.model_name} (missing "
                            f"{missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]}); check "
                            "model_name and kwargs.")
        self.model.load_state_dict({k: v for k, v in state.items() if k not in head}, strict=True)

    def enable_gradient_checkpointing(self) -> None:
        self.model.set_grad_checkpointing(True)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(images)

    def pooled(self, images: torch.Tensor) -> torch.Tensor:
        """The backbone's pooled embedding, ``B x out_dim``."""
        return self.model.forward_head(self.features(images), pre_logits=True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The feature grid, ``B x out_dim x H x W``."""
        x = self.features(images)
        if x.dim() == 4:
            return x.permute(0, 3, 1, 2) if getattr(self.model, "output_fmt", "NCHW") == "NHWC" else x
        tokens = x[:, int(getattr(self.model, "num_prefix_tokens", 0)):]
        side = math.isqrt(tokens.shape[1])
        grid = getattr(getattr(self.model, "patch_embed", None), "grid_size", None)
        h, w = (int(grid[0]), int(grid[1])) if grid is not None and grid[0] * grid[1] == tokens.shape[1] \
            else (side, tokens.shape[1] // max(side, 1))
        if h * w != tokens.shape[1]:
            raise UserError(f"timm image encoder: {self.model_name} gives {tokens.shape[1]} tokens, not a grid; "
                            "use its pooled() embedding (e.g. in the clip model).")
        return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)
