"""VisualBERT (Li et al., 2019): one BERT encoder over text tokens followed by visual tokens.

Visual tokens are the cells of an image encoder's feature grid (learned 2-D
row/column position embeddings) or, with ``feature_dim`` set, precomputed
region features whose position comes from their box (x1, y1, x2, y2 and area
through a linear layer); both get a visual token type, and padded regions are
masked out of attention.

``embeddings: visual_bert`` is the paper's architecture instead (transformers'
``VisualBertModel``, MMF's ``visual_bert``): each visual vector, a region feature
(boxes unused: VisualBERT has none) or a grid cell, is projected into BERT's
embedding space with its own token-type and position tables and normalised
together with the text (:mod:`mmvl.models.modules.visualbert_embeddings`).
``pretrained_path`` loads released weights into it
(:mod:`mmvl.models.modules.visualbert_weights`).

``training_head_type: classification`` scores ``num_labels`` classes from
BERT's pooled ``[CLS]`` output (VQA soft scores with ``logit_bce``, Hateful
Memes, COCO matching: the loss comes from ``losses:``). ``pretraining`` is
VisualBERT's task-agnostic pretraining: masked language modelling on the text
tokens and image-text matching on the pooled output; forward returns both
losses itself (``losses:`` must then be empty) and the matching logits as
``scores``.
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from mmvl.errors import UserError
from mmvl.models.modules import film  # noqa: F401  (registers the film_cnn image encoder)
from mmvl.models.modules.bert import (TextBertModel, bidirectional_mask, enable_bert_checkpointing, plain_config,
                                      require_num_labels, unpadded)
from mmvl.models.modules.heads import PretrainingHeads
from mmvl.models.modules.image_encoders import build_image_encoder
from mmvl.models.modules.visual_embeddings import RegionEmbeddings, VisualEmbeddings
from mmvl.models.modules.visualbert_embeddings import VisualBertVisualEmbeddings
from mmvl.models.modules.visualbert_weights import Released, load_released, read_released, released_bert_config
from mmvl.models.modules.visual_tokens import region_inputs, require_image
from mmvl.registry import register_model

HEAD_TYPES = ("classification", "pretraining")
#: ``embeddings``: mmvl's visual tokens (their own LayerNorm, 2-D grid / box positions) or VisualBERT's
EMBEDDINGS = ("mmvl", "visual_bert")
#: ``classifier_head``: Linear-GELU-LayerNorm-Linear (MMF's VisualBERT head) or one Linear (transformers' QA head)
CLASSIFIER_HEADS = ("mlp", "linear")
#: what the classification head reads, concatenated: the pooled [CLS], the flattened grid of
#: visual tokens, their mean, their max (final hidden states), the text token before [SEP]
#: (``last_text_token``: MMF's ``pooler_strategy: vqa``)
CLASSIFIER_PARTS = ("pooled", "visual", "mean", "max", "last_text_token")
CLASSIFIER_ALIASES = {"pooled_and_visual": ["pooled", "visual"], "pooled_and_pools": ["pooled", "mean", "max"]}


@register_model("visual_bert")
class VisualBert(TextBertModel):
    """Single-stream vision-and-language BERT (``forward(batch) -> {"scores"[, "losses"]}``)."""

    config_path = "models/visual_bert.yaml"
    PARTS = {"text_encoder": ("bert",), "embeddings": ("bert.embeddings",), "image_encoder": ("image_encoder",),
             "visual_embeddings": ("visual_embeddings", "region_embeddings"), "classifier": ("classifier", "heads")}
    HEAD = ("classifier", "heads")

    def __init__(self, config: DictConfig):
        super().__init__(config)
        cfg = plain_config(config)
        self.head_type = str(cfg.get("training_head_type") or "classification")
        if self.head_type not in HEAD_TYPES:
            raise UserError(f"visual_bert: training_head_type={self.head_type!r}; use 'classification' or "
                            "'pretraining'.")
        if self.head_type == "pretraining" and cfg.get("losses"):
            raise UserError("visual_bert: training_head_type=pretraining computes its own losses (mlm, itm); set "
                            "model_config.visual_bert.losses: [] so the matching loss is not counted twice.")
        released = self._build_bert(cfg)
        bc = self.bert.config
        hidden = bc.hidden_size
        self.feature_dim = int(cfg["feature_dim"]) if cfg.get("feature_dim") else None
        # ``classifier_input``: a list of CLASSIFIER_PARTS (or one part, or an alias). ``pooled``:
        # VisualBERT's head on the pooled [CLS]. ``visual`` reads every visual token's final state in
        # grid order, so a position-specific answer ("is it on the left?") need not squeeze through
        # one attention-pooled vector. ``mean`` / ``max`` pool the visual tokens: one set of weights
        # reads every position (the flattened grid learns each cell's weights from the ~1/25 of the
        # samples whose object sits there), as FiLM's own classifier pools.
        self.classifier_parts = classifier_parts(cfg.get("classifier_input") or "pooled")
        self.image_encoder: nn.Module | None = None
        if self.feature_dim and "visual" in self.classifier_parts:
            raise UserError(f"visual_bert: classifier_input {self.classifier_parts} reads the flattened grid "
                            "('visual'), which needs a fixed image grid; with feature_dim set use pooled, "
                            "mean and max.")
        if self.exact:
            self._build_visualbert_embeddings(cfg, released)
        elif self.feature_dim:
            self.region_embeddings = RegionEmbeddings(self.feature_dim, hidden, bc.hidden_dropout_prob,
                                                      bc.layer_norm_eps, bc.initializer_range,
                                                      box_norm=bool(cfg.get("box_norm")))
        else:
            self.image_encoder = self._build_image_encoder(cfg)
            self.visual_embeddings = VisualEmbeddings(self.image_encoder.out_dim, hidden,
                                                      int(cfg.get("max_grid_size", 32)), bc.hidden_dropout_prob,
                                                      bc.layer_norm_eps, bc.initializer_range)
        self.heads = None
        if self.head_type == "pretraining":
            self.heads = PretrainingHeads(hidden, bc.vocab_size, bc.layer_norm_eps, bc.initializer_range)
        else:
            self.classifier = self._build_classifier(cfg, hidden, bc)
        if released is not None:
            load_released(self, released)

    def _build_bert(self, cfg: dict[str, Any]) -> Released | None:
        """``self.bert`` from the size keys or the text encoder's checkpoint, or, with ``pretrained_path``,
        in the released model's shape (its weights load once every layer exists)."""
        self.exact = str(cfg.get("embeddings") or "mmvl") == "visual_bert"
        if str(cfg.get("embeddings") or "mmvl") not in EMBEDDINGS:
            raise UserError(f"visual_bert: embeddings={cfg.get('embeddings')!r}; use 'mmvl' (mmvl's visual "
                            "tokens) or 'visual_bert' (VisualBERT's, which released weights need).")
        path = cfg.get("pretrained_path")
        if not path:
            self.build_text("visual_bert", labels=self.head_type == "classification")
            return None
        if not self.exact:
            raise UserError(f"visual_bert: pretrained_path={path!r} holds VisualBERT's architecture; set "
                            "model_config.visual_bert.embeddings=visual_bert.")
        if dict(cfg.get("text_encoder") or {}).get("pretrained_path"):
            raise UserError("visual_bert: pretrained_path and text_encoder.pretrained_path are both set; the "
                            "released VisualBERT holds the text encoder too, so set text_encoder.pretrained_path=null.")
        if self.head_type == "classification":
            require_num_labels(cfg, "visual_bert")
        released = read_released(str(path))
        from transformers import BertModel

        bert_config = released_bert_config(released, cfg)
        bert_config._attn_implementation = cfg.get("attn_implementation") or "sdpa"
        self.bert = BertModel(bert_config)
        return released

    def _build_image_encoder(self, cfg: dict[str, Any]) -> nn.Module:
        encoder_spec = dict(cfg.get("image_encoder") or {"type": "cnn"})
        if encoder_spec.get("type") == "film_cnn":  # conditioned on the question's word embeddings
            encoder_spec["params"] = {**dict(encoder_spec.get("params") or {}), "cond_dim": self.bert.config.hidden_size}
        return build_image_encoder(encoder_spec)

    def _build_visualbert_embeddings(self, cfg: dict[str, Any], released: Released | None) -> None:
        """VisualBERT's visual embeddings over region features or the image encoder's grid cells."""
        if not self.feature_dim:
            self.image_encoder = self._build_image_encoder(cfg)
        dim = int(self.feature_dim or self.image_encoder.out_dim)
        if released is not None and dim != released.visual_dim:
            source = "feature_dim" if self.feature_dim else "the image encoder's out_dim"
            raise UserError(f"visual_bert: {source} is {dim} but pretrained_path has visual_embedding_dim="
                            f"{released.visual_dim}; give visual vectors of that width (feature_dim or image_encoder).")
        self.visual_embeddings = VisualBertVisualEmbeddings(dim, self.bert.embeddings, self.bert.config.initializer_range)

    def _build_classifier(self, cfg: dict[str, Any], hidden: int, bc: Any) -> nn.Module:
        head_in = hidden * len(self.classifier_parts)
        if "visual" in self.classifier_parts:
            size = int(cfg.get("image_size") or 75)
            with torch.no_grad():
                grid = self.image_encoder(torch.zeros(1, 3, size, size))
            self.num_visual_tokens = grid.shape[-2] * grid.shape[-1]
            head_in += hidden * (self.num_visual_tokens - 1)
        kind = str(cfg.get("classifier_head") or "mlp")
        if kind not in CLASSIFIER_HEADS:
            raise UserError(f"visual_bert: classifier_head={kind!r}; use 'mlp' or 'linear'.")
        dropout = nn.Dropout(float(cfg.get("classifier_dropout", bc.hidden_dropout_prob)))
        labels = int(cfg["num_labels"])
        classifier = nn.Sequential(dropout, nn.Linear(head_in, labels)) if kind == "linear" else nn.Sequential(
            dropout, nn.Linear(head_in, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=bc.layer_norm_eps),
            nn.Linear(hidden, labels))
        projections = [] if self.image_encoder is None or self.exact else [self.visual_embeddings.proj]
        self.init_new_layers(*projections, classifier)
        return classifier

    def encode(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden B x (L + M) x D, pooled B x D, text mask B x L, visual mask B x M)``: the encoder's output
        over text then visual tokens (VisualBertModel's last_hidden_state and pooler_output)."""
        input_ids = batch["input_ids"]
        visual, visual_mask = self._visual_tokens(batch)
        if self.exact:
            embeddings = self.visual_embeddings(self.bert.embeddings, input_ids, batch.get("token_type_ids"), visual)
        else:
            text = self.bert.embeddings(input_ids=input_ids, token_type_ids=batch.get("token_type_ids"))
            embeddings = torch.cat([text, visual.to(text.dtype)], dim=1)
        text_mask = batch.get("attention_mask")
        text_mask = torch.ones_like(input_ids) if text_mask is None else text_mask.long()
        attention = None  # no text token and no region padded: no mask, so attention may use flash
        if not unpadded(batch):
            mask = torch.cat([text_mask, visual_mask.to(text_mask.dtype)], dim=1)
            attention = bidirectional_mask(self.bert, embeddings, mask)
        hidden = self.bert.encoder(embeddings, attention_mask=attention)[0]
        return hidden, self.bert.pooler(hidden), text_mask, visual_mask

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        hidden, pooled, text_mask, visual_mask = self.encode(batch)
        length = text_mask.shape[1]
        if self.heads is not None:
            return self.heads(hidden[:, :length], pooled, batch, self.bert.embeddings.word_embeddings.weight)
        visual_out = hidden[:, length:]
        pools = masked_mean_max(visual_out, visual_mask) if {"mean", "max"} & set(self.classifier_parts) else (None, None)
        parts = {"pooled": pooled, "mean": pools[0], "max": pools[1]}
        if "last_text_token" in self.classifier_parts:  # the token before [SEP], not the pooler
            last = (text_mask.sum(1) - 2).clamp(min=0)
            parts["last_text_token"] = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        features = [self._flat_grid(visual_out) if p == "visual" else parts[p] for p in self.classifier_parts]
        return {"scores": self.classifier(torch.cat(features, dim=1))}

    def _flat_grid(self, visual_out: torch.Tensor) -> torch.Tensor:
        if visual_out.shape[1] != self.num_visual_tokens:
            raise UserError(f"visual_bert: classifier_input 'visual' was built for {self.num_visual_tokens} visual "
                            f"tokens but got {visual_out.shape[1]}; set model_config.visual_bert.image_size to the "
                            "input image size.")
        return visual_out.flatten(1)

    def _visual_tokens(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens B x M x hidden, mask B x M)``: regions with their boxes, or every grid cell; with VisualBERT's
        embeddings the raw visual vectors (B x M x feature width), which it embeds together with the text."""
        if self.image_encoder is None:
            feats, mask, boxes = region_inputs(batch, int(self.feature_dim), "visual_bert")
            return (feats, mask) if self.exact else (self.region_embeddings(feats, boxes), mask)
        grid = self._encode_image(batch)
        tokens = grid.flatten(2).transpose(1, 2) if self.exact else self.visual_embeddings(grid)
        return tokens, torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)

    def _encode_image(self, batch: dict[str, Any]) -> torch.Tensor:
        image = require_image(batch, "visual_bert")
        if not getattr(self.image_encoder, "conditioned", False):
            return self.image_encoder(image)
        mask = batch.get("attention_mask")
        words = self.bert.embeddings.word_embeddings(batch["input_ids"])
        mask = torch.ones_like(batch["input_ids"]) if mask is None else mask
        m = mask.unsqueeze(-1).to(words.dtype)
        return self.image_encoder(image, (words * m).sum(1) / m.sum(1).clamp(min=1))

    def enable_gradient_checkpointing(self) -> None:
        enable_bert_checkpointing(self.bert)
        if self.image_encoder is not None:
            self.image_encoder.enable_gradient_checkpointing()


def classifier_parts(value: Any) -> list[str]:
    """``classifier_input`` (a part, an alias or a list of parts) -> the list of parts, checked."""
    parts = CLASSIFIER_ALIASES.get(value, [value]) if isinstance(value, str) else [str(p) for p in value]
    bad = [p for p in parts if p not in CLASSIFIER_PARTS]
    if bad or not parts or len(set(parts)) != len(parts):
        raise UserError(f"visual_bert: classifier_input={value!r}; give a list of distinct parts from "
                        f"{', '.join(CLASSIFIER_PARTS)} (or {', '.join(CLASSIFIER_ALIASES)}).")
    return parts


def masked_mean_max(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and max over the real tokens (``mask`` 1) of ``tokens`` B x M x D -> two B x D."""
    m = mask.to(tokens.dtype).unsqueeze(-1)
    mean = (tokens * m).sum(1) / m.sum(1).clamp(min=1)
    maxed = tokens.masked_fill(m == 0, torch.finfo(tokens.dtype).min).amax(1)
    return mean, torch.where(m.sum(1) > 0, maxed, torch.zeros_like(maxed))  # no real token: zeros
