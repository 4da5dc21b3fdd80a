"""Region embeddings: with ``box_norm`` the box weighs as much as a wide region feature."""
from __future__ import annotations

import torch

from mmvl.models.modules.visual_embeddings import RegionEmbeddings
from mmvl.models.modules.visual_tokens import box_features


def box_share(box_norm: bool) -> float:
    """How far moving every box moves the tokens, relative to the tokens' size."""
    torch.manual_seed(0)
    emb = RegionEmbeddings(507, 64, dropout=0.0, eps=1e-12, std=0.1, box_norm=box_norm).eval()
    features = torch.rand(8, 6, 507)
    corners = torch.rand(8, 6, 2) * 0.8
    near = box_features(torch.cat([corners, corners + 0.15], -1))
    far = box_features(torch.cat([1 - corners - 0.15, 1 - corners], -1))
    one, other = emb(features, near), emb(features, far)
    return ((one - other).norm(dim=-1) / one.norm(dim=-1)).mean().item()


def test_box_norm_gives_the_box_an_equal_say():
    plain, normed = box_share(False), box_share(True)
    assert plain < 0.1  # 5 box numbers against 507 feature numbers under one LayerNorm
    assert normed > 3 * plain and normed > 0.3
