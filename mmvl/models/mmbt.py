"""MMBT, the supervised multimodal bitransformer (Kiela et al. 2019).

Image features are pooled into ``num_image_tokens`` vectors, projected to
BERT's hidden size and fed as extra token embeddings at the start of the
sequence, ``[CLS] img_1 .. img_N [SEP] words [SEP]``, with their own position
ids and token type 1; BERT's pooled ``[CLS]`` output feeds the classifier.
``[CLS]``/``[SEP]`` are the text's own (its first and last real token), so a
pretrained text encoder (``text_encoder.pretrained_path: minilm``) sees the
embeddings it was trained with.

The visual input is ``batch["image"]`` (B x 3 x H x W, through ``image_encoder``)
or, when ``feature_dim`` is set, region features ``batch["features"]`` with
``feature_mask`` and optional ``boxes`` (read by
:mod:`mmvl.models.modules.visual_tokens`, shared with ``concat_bert`` and
``visual_bert``).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from mmvl.errors import UserError
from mmvl.models.modules.bert import (TextBertModel, bidirectional_mask, build_text_bert,
                                      enable_bert_checkpointing, plain_config, require_num_labels, unpadded)
from mmvl.models.modules.visual_tokens import VisualTokens, pool_tokens
from mmvl.registry import register_model

__all__ = ["MMBT", "VisualTokens", "build_text_bert", "enable_bert_checkpointing", "plain_config", "pool_tokens",
           "require_num_labels"]


@register_model("mmbt")
class MMBT(TextBertModel):
    """Image tokens prepended to the text inside one BERT; ``forward(batch) -> {"scores"}``."""

    config_path = "models/mmbt.yaml"
    PARTS = {"text_encoder": ("bert",), "embeddings": ("bert.embeddings",), "image_encoder": ("visual",),
             "image_projection": ("image_proj",), "classifier": ("classifier",)}
    HEAD = ("classifier",)

    def __init__(self, config: DictConfig):
        super().__init__(config)
        cfg, num_labels = self.build_text("mmbt")
        bc = self.bert.config
        self.num_image_tokens = int(cfg.get("num_image_tokens") or 1)
        if self.num_image_tokens + 2 > bc.max_position_embeddings:
            raise UserError(f"mmbt: num_image_tokens={self.num_image_tokens} exceeds max_position_embeddings.")
        self.image_type = 1 if bc.type_vocab_size > 1 else 0
        self.visual = VisualTokens(cfg, "mmbt")
        self.image_proj = nn.Linear(self.visual.out_dim, bc.hidden_size)
        self.classifier = nn.Sequential(nn.Dropout(float(cfg.get("classifier_dropout", bc.hidden_dropout_prob))),
                                        nn.Linear(bc.hidden_size, num_labels))
        self.init_new_layers(self.image_proj, self.classifier)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        input_ids = batch["input_ids"]
        text_mask = batch.get("attention_mask")
        text_mask = torch.ones_like(input_ids) if text_mask is None else text_mask.long()
        b, length = input_ids.shape
        device = input_ids.device
        tokens, mask = self.visual(batch)
        pooled, image_mask = pool_tokens(tokens, mask, self.num_image_tokens)
        word = self.bert.embeddings.word_embeddings
        cls = word(input_ids[:, :1])
        sep = word(input_ids.gather(1, (text_mask.sum(1, keepdim=True) - 1).clamp(min=0)))
        image_embeds = torch.cat([cls, self.image_proj(pooled).to(cls.dtype), sep], dim=1)
        n = image_embeds.shape[1]
        image = self.bert.embeddings(
            inputs_embeds=image_embeds, position_ids=torch.arange(n, device=device).expand(b, n),
            token_type_ids=torch.full((b, n), self.image_type, dtype=torch.long, device=device))
        text_types = batch.get("token_type_ids")
        text = self.bert.embeddings(
            input_ids=input_ids[:, 1:], position_ids=torch.arange(1, length, device=device).expand(b, length - 1),
            token_type_ids=None if text_types is None else text_types[:, 1:])
        embeddings = torch.cat([image, text], dim=1)
        attention = None  # nothing padded and every image token has regions (fewer regions leave some empty)
        if not unpadded(batch) or tokens.shape[1] < self.num_image_tokens:
            ones = text_mask.new_ones(b, 1)
            full_mask = torch.cat([ones, image_mask.to(text_mask.dtype), ones, text_mask[:, 1:]], dim=1)
            attention = bidirectional_mask(self.bert, embeddings, full_mask)
        hidden = self.bert.encoder(embeddings, attention_mask=attention)[0]
        return {"scores": self.classifier(self.bert.pooler(hidden))}

    def enable_gradient_checkpointing(self) -> None:
        enable_bert_checkpointing(self.bert)
        if self.visual.image_encoder is not None:
            self.visual.image_encoder.enable_gradient_checkpointing()
