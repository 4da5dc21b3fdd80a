"""Image encoder ``hf_vision``: a transformers CLIP or SigLIP vision tower from a local folder.

LLaVA reads its image tokens from a CLIP (or SigLIP) tower the way this encoder does: the hidden
states after ``vision_feature_layer`` (an index into the tower's layer outputs, 0 the embeddings,
-1 the last layer; a list concatenates several along the features), without the first token under
``vision_feature_select_strategy: default`` (CLIP's class token) or with every token under
``full``. A ``vlm`` on it is LLaVA's architecture, so its runs export as a transformers
``LlavaForConditionalGeneration`` folder (``mmvl_export hf``).

The tower keeps only the layers it reads (LLaVA-1.5 reads CLIP's second to last of 24: one layer of
compute saved, and no layer whose weights would get no gradient, which DDP refuses); its final norm
and pooling head, never read, are frozen for the same reason. The folder may hold a whole CLIP or
SigLIP model (``model_type: clip``: its vision half loads) or a vision model alone, random or
released; nothing downloads.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from mmvl.errors import UserError, library_input
from mmvl.models.modules.vlm_parts import checkpoint_transformers, quiet_loading
from mmvl.registry import register_image_encoder

#: the folders' model types -> (the transformers vision model class, tokens ahead of the patches)
TOWERS = {"clip": ("CLIPVisionModel", 1), "clip_vision_model": ("CLIPVisionModel", 1),
          "siglip": ("SiglipVisionModel", 0), "siglip_vision_model": ("SiglipVisionModel", 0)}
STRATEGIES = ("default", "full")


def vision_config(path: str) -> Any:
    """The vision config of the CLIP or SigLIP folder ``path`` (a whole model's vision half)."""
    if not path or not os.path.isdir(os.path.expanduser(str(path))):
        raise UserError(f"hf_vision image encoder: path={path!r} is not a folder; give a local transformers CLIP or "
                        "SigLIP folder (config.json + weights, e.g. written by save_pretrained).")
    from transformers import AutoConfig

    with library_input(f"hf_vision image encoder: path={str(path)!r} does not load",
                       "give a CLIP or SigLIP folder written by save_pretrained."):
        config = AutoConfig.from_pretrained(os.path.expanduser(str(path)), local_files_only=True)
    if config.model_type not in TOWERS:
        raise UserError(f"hf_vision image encoder: {str(path)!r} holds a {config.model_type!r} model; give a CLIP or "
                        f"SigLIP folder (model types {', '.join(TOWERS)}).")
    return getattr(config, "vision_config", None) or config


def feature_layers(layer: Any, layers: int) -> list[int]:
    """``vision_feature_layer`` (an int or a list of them, negative from the end) as indices into the
    ``layers + 1`` hidden states (0: the embeddings)."""
    given = list(layer) if not isinstance(layer, (int, str)) and hasattr(layer, "__iter__") else [layer]
    out = []
    for value in given:
        if isinstance(value, bool) or not isinstance(value, int) or not -(layers + 1) <= value <= layers:
            raise UserError(f"hf_vision image encoder: vision_feature_layer={layer!r}; give an integer (or a list) "
                            f"from -{layers + 1} to {layers} for this {layers}-layer tower (LLaVA-1.5: -2).")
        out.append(value % (layers + 1))
    if not out:
        raise UserError("hf_vision image encoder: vision_feature_layer=[] reads nothing; give e.g. -2.")
    return out


@register_image_encoder("hf_vision")
class HFVisionEncoder(nn.Module):
    """``forward(images) -> B x C x h x w`` (the patch tokens on their grid) or ``B x N x C`` (tokens
    that are not a grid: CLIP's class token kept, or SigLIP's first patch dropped)."""

    def __init__(self, path: str, vision_feature_layer: Any = -2, vision_feature_select_strategy: str = "default"):
        super().__init__()
        if vision_feature_select_strategy not in STRATEGIES:
            raise UserError(f"hf_vision image encoder: vision_feature_select_strategy={vision_feature_select_strategy!r};"
                            " use default (drops the first token: CLIP's class token) or full (keeps every token).")
        config = vision_config(path)
        self.path, self.strategy = os.path.expanduser(str(path)), vision_feature_select_strategy
        self.released_layers = int(config.num_hidden_layers)
        self.layers = feature_layers(vision_feature_layer, self.released_layers)
        name, self.extra_tokens = TOWERS[config.model_type]
        import transformers

        with library_input(f"hf_vision image encoder: path={str(path)!r} does not load",
                           "give a CLIP or SigLIP folder written by save_pretrained."), quiet_loading():
            self.model = getattr(transformers, name).from_pretrained(self.path, dtype=torch.float32,
                                                                     local_files_only=True)
        tower = getattr(self.model, "vision_model", self.model)  # transformers < 5.x wraps the tower once more
        tower.encoder.layers = tower.encoder.layers[: max(self.layers)]  # the layers after the deepest read: never run
        self.model.config.num_hidden_layers = len(tower.encoder.layers)
        for unread in ("post_layernorm", "head"):
            module = getattr(tower, unread, None)
            if module is not None:
                module.requires_grad_(False)
        self.image_size, self.patch_size = int(config.image_size), int(config.patch_size)
        self.out_dim = int(config.hidden_size) * len(self.layers)

    def tokens_per_image(self) -> int:
        """How many tokens an image gives (what the text processor's ``image_tokens`` must be)."""
        return (self.image_size // self.patch_size) ** 2 + self.extra_tokens - (self.strategy == "default")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if tuple(images.shape[-2:]) != (self.image_size, self.image_size):
            raise UserError(f"hf_vision image encoder: a {tuple(images.shape[-2:])} image, and the tower in "
                            f"{self.path!r} takes {self.image_size}x{self.image_size}; set the dataset's image size "
                            f"(its Resize) to {self.image_size}.")
        states = self.model(pixel_values=images, output_hidden_states=True).hidden_states
        picked = [states[i][:, 1:] if self.strategy == "default" else states[i] for i in self.layers]
        tokens = torch.cat(picked, -1)
        side = self.image_size // self.patch_size
        if tokens.size(1) != side * side:  # not the patch grid: tokens as they are
            return tokens
        return tokens.transpose(1, 2).reshape(tokens.size(0), tokens.size(2), side, side)

    def enable_gradient_checkpointing(self) -> None:
        checkpoint_transformers(self.model)
