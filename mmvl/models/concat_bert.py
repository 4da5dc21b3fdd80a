"""Concat-BERT: a late-fusion baseline (as in the Hateful Memes and MMF baselines).

BERT's pooled ``[CLS]`` output of the text is concatenated with the masked
mean of the image's visual tokens (an image encoder's grid cells, or region
features when ``feature_dim`` is set) and scored by an MLP. The two
modalities only meet in the head, which is what makes it a useful baseline
against early-fusion models (MMBT, VisualBERT).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from mmvl.models.modules.bert import TextBertModel, bidirectional_mask, enable_bert_checkpointing, unpadded
from mmvl.models.modules.visual_tokens import VisualTokens, pool_tokens
from mmvl.registry import register_model


@register_model("concat_bert")
class ConcatBert(TextBertModel):
    """``[BERT pooled text ; mean visual token]`` -> MLP; ``forward(batch) -> {"scores"}``."""

    config_path = "models/concat_bert.yaml"
    PARTS = {"text_encoder": ("bert",), "embeddings": ("bert.embeddings",), "image_encoder": ("visual",),
             "classifier": ("image_norm", "classifier")}
    HEAD = ("image_norm", "classifier")

    def __init__(self, config: DictConfig):
        super().__init__(config)
        cfg, num_labels = self.build_text("concat_bert")
        bc = self.bert.config
        self.visual = VisualTokens(cfg, "concat_bert")
        fused = bc.hidden_size + self.visual.out_dim
        hidden = int(cfg.get("mlp_hidden_size") or bc.hidden_size)
        dropout = float(cfg.get("classifier_dropout", bc.hidden_dropout_prob))
        self.image_norm = nn.LayerNorm(self.visual.out_dim, eps=bc.layer_norm_eps)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(fused, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=bc.layer_norm_eps),
            nn.Dropout(dropout), nn.Linear(hidden, num_labels))
        self.init_new_layers(self.classifier)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        input_ids = batch["input_ids"]
        text = self.bert.embeddings(input_ids=input_ids, token_type_ids=batch.get("token_type_ids"))
        attention = None  # no text padded: no mask, so attention may use flash
        if not unpadded(batch):  # BertModel itself would read the mask back to see whether it can drop it
            mask = batch.get("attention_mask")
            attention = bidirectional_mask(self.bert, text, torch.ones_like(input_ids) if mask is None else mask)
        pooled_text = self.bert.pooler(self.bert.encoder(text, attention_mask=attention)[0])
        tokens, visual_mask = self.visual(batch)
        image = self.image_norm(pool_tokens(tokens, visual_mask, 1)[0][:, 0])
        fused = torch.cat([pooled_text, image.to(pooled_text.dtype)], dim=-1)
        return {"scores": self.classifier(fused)}

    def enable_gradient_checkpointing(self) -> None:
        enable_bert_checkpointing(self.bert)
        if self.visual.image_encoder is not None:
            self.visual.image_encoder.enable_gradient_checkpointing()
