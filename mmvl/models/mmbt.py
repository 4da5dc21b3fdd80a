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
``feature_mask`` and optional ``boxes``. The helpers below are shared with
``concat_bert``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from mmvl.errors import UserError
from mmvl.models.base import BaseModel
from mmvl.models.modules.image_encoders import build_image_encoder
from mmvl.models.visual_bert import _BERT_KEYS, load_bert_weights
from mmvl.models.visual_bert import _cfg as plain_config
from mmvl.registry import register_model



def _checkpoint_dir(path: str, model: str) -> Path:
    from mmvl.data.processors.text import minilm_dir

    if str(path) == "minilm":
        return minilm_dir()
    folder = Path(os.path.expanduser(str(path)))
    if not (folder / "config.json").is_file():
        raise UserError(f"{model}: text_encoder.pretrained_path {str(path)!r} is not a transformers checkpoint "
                        "folder (no config.json there); give a local folder or 'minilm'.")
    return folder


def build_text_bert(cfg: dict[str, Any], model: str, add_pooling_layer: bool = True) -> nn.Module:
    """A ``BertModel`` from the size keys, or from ``text_encoder.pretrained_path`` with its weights."""
    from transformers import BertConfig, BertModel

    text = dict(cfg.get("text_encoder") or {})
    pretrained = text.get("pretrained_path")
    if pretrained:
        folder = _checkpoint_dir(pretrained, model)
        bert_config = BertConfig.from_pretrained(str(folder))
        if cfg.get("vocab_size") not in (None, bert_config.vocab_size):
            raise UserError(f"{model}: vocab_size={cfg['vocab_size']} but checkpoint {pretrained!r} has "
                            f"{bert_config.vocab_size}; use the checkpoint's tokenizer (tokenizer_path: {pretrained}).")
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if cfg.get(key) is not None:
                setattr(bert_config, key, cfg[key])
    else:
        if cfg.get("vocab_size") is None:
            raise UserError(f"{model}: model_config.{model}.vocab_size is null and no dataset filled it in; set it "
                            "or use a dataset that provides model_info().")
        bert_config = BertConfig(**{k: cfg[k] for k in _BERT_KEYS if cfg.get(k) is not None})
    bert_config._attn_implementation = cfg.get("attn_implementation") or "sdpa"
    bert = BertModel(bert_config, add_pooling_layer=add_pooling_layer)
    if pretrained:
        load_bert_weights(bert, folder)
        keep = text.get("num_layers")
        if keep:
            bert.encoder.layer = bert.encoder.layer[: int(keep)]
    return bert


def require_num_labels(cfg: dict[str, Any], model: str) -> int:
    if cfg.get("num_labels") is None:
        raise UserError(f"{model}: model_config.{model}.num_labels is null; set it or let the dataset fill it.")
    return int(cfg["num_labels"])


class VisualTokens(nn.Module):
    """Pixels (through an image encoder) or region features -> ``(tokens B x M x D, mask B x M)``.

    ``feature_dim`` null: pixels, D = the encoder's ``out_dim``. Set: region
    features of that width, with boxes (x1, y1, x2, y2 in [0, 1]) and their area
    added through a linear map; D = ``feature_dim``.
    """

    def __init__(self, cfg: dict[str, Any], model: str):
        super().__init__()
        self.model = model
        self.feature_dim = cfg.get("feature_dim")
        if self.feature_dim:
            self.out_dim = int(self.feature_dim)
            self.box_proj = nn.Linear(5, self.out_dim)
            self.image_encoder = None
        else:
            self.image_encoder = build_image_encoder(cfg.get("image_encoder") or {"type": "cnn"})
            self.out_dim = int(self.image_encoder.out_dim)

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.image_encoder is None:
            feats = batch.get("features")
            if feats is None:
                raise UserError(f"{self.model}: feature_dim is set but the batch has no 'features'; configure the "
                                "dataset's features processor or set feature_dim: null to use images.")
            if feats.shape[-1] != self.out_dim:
                raise UserError(f"{self.model}: features are {feats.shape[-1]}-d but feature_dim={self.out_dim}; "
                                f"set model_config.{self.model}.feature_dim={feats.shape[-1]}.")
            feats = feats.float()
            mask = batch.get("feature_mask")
            mask = torch.ones(feats.shape[:2], dtype=torch.long, device=feats.device) if mask is None else mask
            boxes = batch.get("boxes")
            if boxes is not None:
                boxes = boxes.to(feats.dtype)
                area = ((boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])).unsqueeze(-1)
                feats = feats + self.box_proj(torch.cat([boxes, area], dim=-1))
            return feats, mask.long()
        image = batch.get("image")
        if image is None:
            raise UserError(f"{self.model}: the batch has no 'image'; give the dataset an image_processor, or set "
                            f"model_config.{self.model}.feature_dim to use region features.")
        grid = self.image_encoder(image)
        tokens = grid.flatten(2).transpose(1, 2)
        return tokens, torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)


def pool_tokens(tokens: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked means over ``n`` contiguous groups of the M tokens -> ``(B x n x D, B x n)``.

    A group without real tokens is zero and masked out; ``n=1`` is the masked mean.
    """
    m = tokens.shape[1]
    group = (torch.arange(m, device=tokens.device) * n) // max(m, 1)
    assign = nn.functional.one_hot(group, n).to(tokens.dtype)  # M x n
    weights = assign.unsqueeze(0) * mask.to(tokens.dtype).unsqueeze(-1)  # B x M x n
    counts = weights.sum(1)  # B x n
    pooled = torch.einsum("bmn,bmd->bnd", weights, tokens) / counts.clamp(min=1).unsqueeze(-1)
    return pooled, (counts > 0).long()


def bidirectional_mask(bert: nn.Module, embeddings: torch.Tensor, mask: torch.Tensor) -> Any:
    """The attention mask argument ``bert.encoder`` expects, across transformers 4 and 5."""
    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:  # transformers 4.x
        return bert.get_extended_attention_mask(mask, mask.shape)
    return create_bidirectional_mask(config=bert.config, inputs_embeds=embeddings, attention_mask=mask)


def enable_bert_checkpointing(bert: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(bert, "activation_checkpointing_enable"):  # transformers >= 5
        bert.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@register_model("mmbt")
class MMBT(BaseModel):
    """Image tokens prepended to the text inside one BERT; ``forward(batch) -> {"scores"}``."""

    config_path = "models/mmbt.yaml"

    def __init__(self, config: DictConfig):
        super().__init__(config)
        cfg = plain_config(config)
        num_labels = require_num_labels(cfg, "mmbt")
        self.bert = build_text_bert(cfg, "mmbt")
        bc = self.bert.config
        self.num_image_tokens = int(cfg.get("num_image_tokens") or 1)
        if self.num_image_tokens + 2 > bc.max_position_embeddings:
            raise UserError(f"mmbt: num_image_tokens={self.num_image_tokens} exceeds max_position_embeddings.")
        self.image_type = 1 if bc.type_vocab_size > 1 else 0
        self.visual = VisualTokens(cfg, "mmbt")
        self.image_proj = nn.Linear(self.visual.out_dim, bc.hidden_size)
        self.classifier = nn.Sequential(nn.Dropout(float(cfg.get("classifier_dropout", bc.hidden_dropout_prob))),
                                        nn.Linear(bc.hidden_size, num_labels))
        for module in (self.image_proj, self.classifier[1]):
            nn.init.normal_(module.weight, std=bc.initializer_range)
            nn.init.zeros_(module.bias)

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
        ones = text_mask.new_ones(b, 1)
        full_mask = torch.cat([ones, image_mask.to(text_mask.dtype), ones, text_mask[:, 1:]], dim=1)
        hidden = self.bert.encoder(embeddings, attention_mask=bidirectional_mask(self.bert, embeddings, full_mask))[0]
        return {"scores": self.classifier(self.bert.pooler(hidden))}

    def enable_gradient_checkpointing(self) -> None:
        enable_bert_checkpointing(self.bert)
        if self.visual.image_encoder is not None:
            self.visual.image_encoder.enable_gradient_checkpointing()

    def shard_units(self) -> list[nn.Module]:
        return list(self.bert.encoder.layer)
