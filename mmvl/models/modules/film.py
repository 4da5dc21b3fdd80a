"""A question-conditioned pixel encoder (FiLM, Perez et al. 2018) for VisualBERT.

Why: in Sort-of-CLEVR-style questions ("is the red object on the left?") the
hard part is binding a word to the right object. Late fusion in a transformer
has to discover that binding through attention from scratch, which stayed at
chance for thousands of updates in our runs. Modulating a per-pixel (1x1)
colour/texture layer by the question, before the conv stack, lets the word
select which pixels survive; the rest of the encoder then solves a
single-object problem, learnt in a few hundred updates.
"""
from __future__ import annotations

import torch
from torch import nn

from mmvl.models.modules.image_encoders import IMAGE_ENCODERS, CNNEncoder, add_coords


class FiLMCNNEncoder(CNNEncoder):
    """``CNNEncoder`` after a 1x1 conv whose channels are scaled/shifted by a condition vector.

    ``forward(images, cond)`` with ``cond`` of shape ``(B, cond_dim)``; without
    ``cond`` the modulation is the identity.
    """

    conditioned = True

    def __init__(self, cond_dim: int, film_channels: int = 24, in_channels: int = 3, **kwargs):
        super().__init__(in_channels=film_channels, **kwargs)
        self.pixel = nn.Conv2d(in_channels, film_channels, 1)
        # normalised first: word embeddings start tiny (std 0.02), which would stall FiLM's gradient
        self.cond_norm = nn.LayerNorm(cond_dim, elementwise_affine=False)
        self.film = nn.Linear(cond_dim, 2 * film_channels)

    def forward(self, images: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pixel(images)
        if cond is not None:
            gamma, beta = self.film(self.cond_norm(cond.to(x.dtype))).chunk(2, dim=-1)
            x = x * (1 + gamma[:, :, None, None]) + beta[:, :, None, None]
        x = torch.relu(x)
        return self.run_stages(add_coords(x) if self.coords else x)


IMAGE_ENCODERS["film_cnn"] = FiLMCNNEncoder
