"""Visual inputs as token sequences: region features with boxes, or an image encoder's grid.

Region features come from the dataset's ``features`` processor as
``batch["features"]`` (B x M x F), ``feature_mask`` (B x M, 0 on padded
regions) and optional ``boxes`` (B x M x 4: x1, y1, x2, y2 in [0, 1]). The
helpers here read and check them once for every model, so a model only decides
how a region and its box become a token.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmvl.errors import UserError
from mmvl.models.modules.image_encoders import build_image_encoder

#: width of :func:`box_features`: x1, y1, x2, y2 and the box's area
BOX_DIM = 5


def box_features(boxes: torch.Tensor) -> torch.Tensor:
    """``(x1, y1, x2, y2)`` -> ``(x1, y1, x2, y2, area)``: where a region is and how much of the image it covers."""
    area = ((boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])).unsqueeze(-1)
    return torch.cat([boxes, area], dim=-1)


def region_inputs(batch: dict[str, Any], feature_dim: int,
                  model: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(features B x M x F float, mask B x M long, box features B x M x 5 or None)`` from a batch.

    Raises a one-line :class:`UserError` when the batch has no features or they
    are not ``feature_dim`` wide (the config and the data disagree).
    """
    feats = batch.get("features")
    if feats is None:
        raise UserError(f"{model}: feature_dim is set but the batch has no 'features'; configure the "
                        "dataset's features processor or set feature_dim: null to use images.")
    if feats.shape[-1] != feature_dim:
        raise UserError(f"{model}: features are {feats.shape[-1]}-d but feature_dim={feature_dim}; "
                        f"set model_config.{model}.feature_dim={feats.shape[-1]}.")
    feats = feats.float()  # fp16 on the host (half the bytes); the model computes in its own precision
    mask = batch.get("feature_mask")
    mask = torch.ones(feats.shape[:2], dtype=torch.long, device=feats.device) if mask is None else mask.long()
    boxes = batch.get("boxes")
    return feats, mask, None if boxes is None else box_features(boxes.to(feats.dtype))


def require_image(batch: dict[str, Any], model: str) -> torch.Tensor:
    image = batch.get("image")
    if image is None:
        raise UserError(f"{model}: the batch has no 'image'; give the dataset an image_processor, or set "
                        f"model_config.{model}.feature_dim to use region features.")
    return image


class VisualTokens(nn.Module):
    """Pixels (through an image encoder) or region features -> ``(tokens B x M x D, mask B x M)``.

    ``feature_dim`` null: pixels, D = the encoder's ``out_dim``. Set: region
    features of that width, with boxes and their area added through a linear
    map; D = ``feature_dim``. (mmbt and concat_bert pool these tokens.)
    """

    def __init__(self, cfg: dict[str, Any], model: str):
        super().__init__()
        self.model = model
        self.feature_dim = cfg.get("feature_dim")
        if self.feature_dim:
            self.out_dim = int(self.feature_dim)
            self.box_proj = nn.Linear(BOX_DIM, self.out_dim)
            self.image_encoder = None
        else:
            self.image_encoder = build_image_encoder(cfg.get("image_encoder") or {"type": "cnn"})
            self.out_dim = int(self.image_encoder.out_dim)

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.image_encoder is None:
            feats, mask, boxes = region_inputs(batch, self.out_dim, self.model)
            if boxes is not None:
                feats = feats + self.box_proj(boxes)
            return feats, mask
        grid = self.image_encoder(require_image(batch, self.model))
        tokens = grid.flatten(2).transpose(1, 2)
        return tokens, torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)


def pool_tokens(tokens: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked means over ``n`` contiguous groups of the M tokens -> ``(B x n x D, B x n)``.

    A group without real tokens is zero and masked out; ``n=1`` is the masked mean.
    """
    m = tokens.shape[1]
    group = (torch.arange(m, device=tokens.device) * n) // max(m, 1)
    # M x n group membership; one_hot would read the group ids' min and max back (on the CPU)
    assign = (group.unsqueeze(1) == torch.arange(n, device=tokens.device)).to(tokens.dtype)
    weights = assign.unsqueeze(0) * mask.to(tokens.dtype).unsqueeze(-1)  # B x M x n
    counts = weights.sum(1)  # B x n
    pooled = torch.einsum("bmn,bmd->bnd", weights, tokens) / counts.clamp(min=1).unsqueeze(-1)
    return pooled, (counts > 0).long()
