"""CLIP / SigLIP: a two-tower image-text model trained contrastively.

An image tower (any registered image encoder: ``timm`` for timm's backbones, or mmvl's ``cnn``,
``resnet``, ...) and a text tower (:mod:`mmvl.models.modules.text_towers`: mmvl's own causal
transformer in open_clip's layout, or a transformers BERT such as MiniLM) are projected to
``embed_dim`` and L2-normalised. ``logit_scale`` is a learnable log temperature, its exponent
clamped at 100; ``init_logit_bias`` adds SigLIP's learnable bias. The losses (``clip``,
``siglip``) read the features; ``scores`` are the batch's text x image logits, so recall@k and
the other metrics read them as they read any model's.

Batch keys: ``image`` (B x 3 x H x W), ``input_ids`` and ``attention_mask`` (B x L) - what
``image_text_shards`` and ``coco_captions`` yield.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from mmvl.config.access import plain_dict
from mmvl.errors import UserError
from mmvl.models.base import BaseModel
from mmvl.models.modules.image_encoders import build_image_encoder
from mmvl.models.modules.open_clip_weights import load_open_clip
from mmvl.models.modules.text_towers import build_text_tower
from mmvl.registry import register_model

#: the largest ``exp(logit_scale)`` (CLIP's clamp: a temperature of at least 0.01)
MAX_LOG_SCALE = math.log(100.0)


@register_model("clip")
class Clip(BaseModel):
    """``forward(batch) -> {image_features, text_features, logit_scale[, logit_bias], scores}``."""

    config_path = "models/clip.yaml"
    PARTS = {"image_encoder": ("image_encoder",), "text_encoder": ("text_encoder",),
             "projections": ("image_projection", "text_projection"), "logit_scale": ("logit_scale", "logit_bias")}
    #: what ``base`` leaves trainable: the projections and the temperature (``freeze: [base]`` locks both towers)
    HEAD = ("image_projection", "text_projection", "logit_scale", "logit_bias")

    def __init__(self, config: DictConfig):
        super().__init__(config)
        cfg = plain_dict(config)
        embed = int(cfg["embed_dim"])
        self.image_encoder = build_image_encoder(cfg.get("image_encoder"))
        self.text_encoder = build_text_tower(cfg, "clip")
        self.image_projection = nn.Linear(self.image_encoder.out_dim, embed, bias=False)
        self.text_projection = nn.Linear(self.text_encoder.width, embed, bias=False)
        nn.init.normal_(self.image_projection.weight, std=self.image_encoder.out_dim ** -0.5)
        nn.init.normal_(self.text_projection.weight, std=self.text_encoder.width ** -0.5)
        # shape [1], not a scalar: fsdp's fully_shard refuses scalar parameters (forward returns scalars)
        self.logit_scale = nn.Parameter(torch.tensor([float(cfg["init_logit_scale"])]))
        bias = cfg.get("init_logit_bias")
        self.logit_bias = nn.Parameter(torch.tensor([float(bias)])) if bias is not None else None
        if cfg.get("open_clip_weights"):
            load_open_clip(self, str(cfg["open_clip_weights"]))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """``B x 3 x H x W`` -> ``B x embed_dim``, L2-normalised."""
        pooled = getattr(self.image_encoder, "pooled", None)
        x = pooled(images) if pooled is not None else self.image_encoder(images).mean(dim=(2, 3))
        return F.normalize(self.image_projection(x), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``B x L`` token ids and their mask (1: a real token) -> ``B x embed_dim``, L2-normalised."""
        return F.normalize(self.text_projection(self.text_encoder(input_ids, attention_mask)), dim=-1)

    def scale(self) -> torch.Tensor:
        """``exp(logit_scale)``, at most 100."""
        return self.logit_scale.clamp(max=MAX_LOG_SCALE).exp().reshape(())

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        if "image" not in batch or "input_ids" not in batch:
            raise UserError(f"clip needs batch keys 'image' and 'input_ids' (image-text pairs); got {sorted(batch)}. "
                            "Use image_text_shards or coco_captions with pixels (no region features).")
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        image = self.encode_image(batch["image"])
        text = self.encode_text(input_ids, torch.ones_like(input_ids) if mask is None else mask)
        scale = self.scale()
        scores = scale * text @ image.T.to(text.dtype)
        out = {"image_features": image, "text_features": text, "logit_scale": scale}
        if self.logit_bias is not None:
            bias = self.logit_bias.reshape(())
            out["logit_bias"] = bias
            scores = scores + bias
        out["scores"] = scores  # [texts, images]: row i's own image is column i
        return out

    def shard_units(self) -> list[nn.Module]:
        """The towers' transformer blocks (FSDP shards each on its own): the text transformer's (or BERT's)
        layers, and a timm backbone's ``blocks`` when it has them (ViTs)."""
        text = self.text_encoder
        units = list(text.transformer.resblocks) if hasattr(text, "transformer") else list(text.bert.encoder.layer)
        blocks = getattr(getattr(self.image_encoder, "model", None), "blocks", None)
        return units + (list(blocks) if isinstance(blocks, nn.Sequential | nn.ModuleList) else [])

    def enable_gradient_checkpointing(self) -> None:
        for tower in (self.image_encoder, self.text_encoder):
            if hasattr(tower, "enable_gradient_checkpointing"):
                tower.enable_gradient_checkpointing()
