"""VisualBERT's own embeddings (Li et al., 2019), as its released checkpoints hold them.

Text tokens are BERT's: word + token type + absolute position, from the tables in
``bert.embeddings``. Each visual vector (a region feature or an image-grid cell) is
projected into the same space and gets a visual token type (1) and visual position 0
from tables of its own (VisualBERT without image-text alignment gives every visual
token the same position). Both sequences, concatenated, go through BERT's one
embedding LayerNorm and dropout. This is the computation of transformers'
``VisualBertEmbeddings`` and MMF's ``BertVisioLinguisticEmbeddings``; having no layer of
its own beyond theirs is what lets their weights load one to one.
"""
from __future__ import annotations

import torch
from torch import nn

#: the token type of every visual token (transformers' default ``visual_token_type_ids``)
VISUAL_TOKEN_TYPE = 1


class VisualBertVisualEmbeddings(nn.Module):
    """The visual half of VisualBERT's embeddings; ``forward`` returns the whole embedded sequence.

    ``text`` is BERT's embeddings module (``bert.embeddings``): its tables embed the text and its
    LayerNorm normalises both halves. It is passed in, not kept, so its weights have one name.
    """

    def __init__(self, visual_dim: int, text: nn.Module, std: float = 0.02):
        super().__init__()
        hidden = text.word_embeddings.embedding_dim
        self.visual_projection = nn.Linear(visual_dim, hidden)
        self.visual_token_type_embeddings = nn.Embedding(text.token_type_embeddings.num_embeddings, hidden)
        self.visual_position_embeddings = nn.Embedding(text.position_embeddings.num_embeddings, hidden)
        nn.init.normal_(self.visual_projection.weight, std=std)
        nn.init.zeros_(self.visual_projection.bias)
        with torch.no_grad():  # transformers' special_visual_initialize: start from the text's tables
            self.visual_token_type_embeddings.weight.copy_(text.token_type_embeddings.weight)
            self.visual_position_embeddings.weight.copy_(text.position_embeddings.weight)

    def forward(self, text: nn.Module, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                visual: torch.Tensor) -> torch.Tensor:
        """``input_ids`` B x L, ``visual`` B x M x visual_dim -> B x (L + M) x hidden."""
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        words = text.word_embeddings(input_ids) + text.token_type_embeddings(types) + text.position_embeddings(positions)
        m = visual.shape[1]
        visual_types = torch.full((b, m), VISUAL_TOKEN_TYPE, dtype=torch.long, device=visual.device)
        visual_positions = torch.zeros((b, m), dtype=torch.long, device=visual.device)
        projected = self.visual_projection(visual)
        vis = projected + self.visual_position_embeddings(visual_positions) + self.visual_token_type_embeddings(visual_types)
        embeddings = torch.cat([words, vis.to(words.dtype)], dim=1)
        return text.dropout(text.LayerNorm(embeddings))
