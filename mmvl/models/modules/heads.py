"""Pretraining heads for single-stream vision-and-language BERTs (VisualBERT's two tasks).

Masked language modelling predicts the original id of every text token the
tokenizer selected (``lm_label_ids``, -100 elsewhere) with BERT's head, whose
decoder is the word-embedding matrix (passed in at call time rather than
registered twice, so checkpoints and FSDP see one parameter). Image-text
matching classifies the pooled output as match (1) / no match (0) against
``targets``; its logits are the model's ``scores``, so the dataset's metrics
(accuracy, ROC AUC) keep working.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX


class MaskedLMHead(nn.Module):
    """BERT's prediction head: dense -> GELU -> LayerNorm -> tied decoder (+ its own bias)."""

    def __init__(self, hidden: int, vocab_size: int, eps: float, std: float = 0.02):
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=eps))
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        nn.init.normal_(self.transform[0].weight, std=std)
        nn.init.zeros_(self.transform[0].bias)

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(hidden), word_embeddings, self.bias)


class PretrainingHeads(nn.Module):
    """``forward(text_hidden, pooled, batch, word_embeddings)`` -> ``{"scores": itm logits, "losses": {mlm, itm}}``.

    In training both labels are required (a missing one is a config mistake);
    in evaluation a missing label only drops its loss, so unmasked validation
    data still gives matching scores for the metrics.
    """

    def __init__(self, hidden: int, vocab_size: int, eps: float, std: float = 0.02, model: str = "visual_bert"):
        super().__init__()
        self.model = model
        self.mlm = MaskedLMHead(hidden, vocab_size, eps, std)
        self.itm = nn.Linear(hidden, 2)
        nn.init.normal_(self.itm.weight, std=std)
        nn.init.zeros_(self.itm.bias)

    def forward(self, text_hidden: torch.Tensor, pooled: torch.Tensor, batch: dict[str, Any],
                word_embeddings: torch.Tensor) -> dict[str, Any]:
        scores = self.itm(pooled)
        losses: dict[str, torch.Tensor] = {}
        labels = batch.get("lm_label_ids")
        if labels is None and self.training:
            raise UserError(f"{self.model}: training_head_type=pretraining needs batch['lm_label_ids']; set "
                            "dataset_config.<dataset>.mask_probability (e.g. 0.15) with a bert_tokenizer text "
                            "processor, or use training_head_type: classification.")
        if labels is not None:
            if labels.shape != text_hidden.shape[:2]:
                raise UserError(f"{self.model}: lm_label_ids has shape {tuple(labels.shape)} but the text is "
                                f"{tuple(text_hidden.shape[:2])}; collate lm_label_ids like input_ids (pad -100).")
            losses["mlm"] = self.masked_lm_loss(text_hidden, labels, word_embeddings)
        targets = batch.get("targets")
        if targets is None and self.training:
            raise UserError(f"{self.model}: training_head_type=pretraining needs batch['targets'] (1: the text "
                            "matches the image, 0: it does not); use a matching dataset such as coco_captions.")
        if targets is not None:
            if targets.dim() != 1 or targets.dtype.is_floating_point:
                raise UserError(f"{self.model}: image-text matching needs targets of 0/1 class indices (shape "
                                f"[N]), got {targets.dtype} {tuple(targets.shape)}; use coco_captions.")
            losses["itm"] = F.cross_entropy(scores.float(), targets.long())
        return {"scores": scores, "losses": losses}

    def masked_lm_loss(self, text_hidden: torch.Tensor, labels: torch.Tensor,
                       word_embeddings: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the selected tokens only (0 when a batch selected none, never NaN).

        Every text token is scored and the unselected ones are ignored by the loss: picking
        the selected ones first (boolean indexing) would make the host wait for the device
        to count them on every update. (BERT's own pretraining head scores every token too.)
        """
        logits = self.mlm(text_hidden, word_embeddings)
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().long(),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return total / labels.ne(IGNORE_INDEX).sum().clamp(min=1)
