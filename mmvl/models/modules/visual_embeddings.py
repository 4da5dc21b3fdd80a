"""Visual tokens in BERT's hidden space, for single-stream models (visual_bert).

A grid cell knows where it is from learned row/column embeddings; a region
(which has no grid position) knows it from its box, through a linear layer of
(x1, y1, x2, y2, area). Both get their own visual token type and a LayerNorm,
since they are added to a sequence of already normalised text embeddings.
"""
from __future__ import annotations

import torch
from torch import nn

from mmvl.errors import UserError
from mmvl.models.modules.visual_tokens import BOX_DIM


class VisualEmbeddings(nn.Module):
    """Grid features (B x C x H x W) -> hidden-size tokens with a visual token type and 2-D position embeddings."""

    def __init__(self, in_dim: int, hidden: int, max_grid: int, dropout: float, eps: float, std: float = 0.02):
        super().__init__()
        self.proj = nn.Linear(in_dim, hidden)
        self.rows = nn.Embedding(max_grid, hidden)
        self.cols = nn.Embedding(max_grid, hidden)
        self.token_type = nn.Parameter(torch.zeros(hidden))
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.max_grid = max_grid
        for emb in (self.rows, self.cols):
            nn.init.normal_(emb.weight, std=std)

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        _, _, h, w = grid.shape
        if max(h, w) > self.max_grid:
            raise UserError(f"visual_bert: the image encoder gives a {h}x{w} grid but max_grid_size="
                            f"{self.max_grid}; raise model_config.visual_bert.max_grid_size.")
        tokens = self.proj(grid.flatten(2).transpose(1, 2))
        pos = (self.rows.weight[:h, None, :] + self.cols.weight[None, :w, :]).reshape(h * w, -1)
        return self.dropout(self.norm(tokens + pos + self.token_type))


class RegionEmbeddings(nn.Module):
    """Region features (B x M x F) and box features (B x M x 5, or None) -> B x M x hidden tokens.

    token = proj(feature) + box(x1, y1, x2, y2, area) + visual token type, then
    LayerNorm and dropout. Without boxes the regions carry no position.

    ``box_norm``: LayerNorm the feature and the box projections each before adding them (as
    LXMERT does), so a box's 5 numbers weigh as much as the feature's hundreds or thousands;
    with one shared LayerNorm the position is a few percent of the token.
    """

    def __init__(self, feature_dim: int, hidden: int, dropout: float, eps: float, std: float = 0.02,
                 box_norm: bool = False):
        super().__init__()
        self.proj = nn.Linear(feature_dim, hidden)
        self.box = nn.Linear(BOX_DIM, hidden)
        self.part_norms = nn.ModuleList([nn.LayerNorm(hidden, eps=eps) for _ in range(2)]) if box_norm else None
        self.token_type = nn.Parameter(torch.zeros(hidden))
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)
        for layer in (self.proj, self.box):
            nn.init.normal_(layer.weight, std=std)
            nn.init.zeros_(layer.bias)

    def forward(self, features: torch.Tensor, boxes: torch.Tensor | None) -> torch.Tensor:
        feats = self.proj(features)
        if self.part_norms is not None:
            feats = self.part_norms[0](feats)
        tokens = feats + self.token_type
        if boxes is not None:
            box = self.box(boxes)
            tokens = tokens + (box if self.part_norms is None else self.part_norms[1](box))
        return self.dropout(self.norm(tokens))
