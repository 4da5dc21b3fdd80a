"""Text towers of a two-tower (CLIP-style) model: ``tower(input_ids, attention_mask) -> B x width``.

- ``transformer``: a small causal transformer of mmvl's own, laid out as open_clip's text
  transformer (token and position embeddings, pre-norm residual blocks of
  ``nn.MultiheadAttention`` and a GELU MLP, a final LayerNorm), so open_clip's text weights map
  onto it key for key (:mod:`mmvl.models.modules.open_clip_weights`). It pools the last real
  token of each row (open_clip's end-of-text token, which its ``argmax`` pooling finds).
- ``bert``: a transformers BERT (size keys, or a local checkpoint folder such as ``minilm``),
  mean-pooled over the real tokens as sentence-transformers pools MiniLM, or its ``[CLS]``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmvl.errors import UserError, library_input
from mmvl.models.modules.bert import bidirectional_mask, build_text_bert, enable_bert_checkpointing


class ResidualBlock(nn.Module):
    """Pre-norm attention + MLP block (open_clip's ``ResidualAttentionBlock`` names)."""

    def __init__(self, width: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(width, hidden))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class _Blocks(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.resblocks = nn.ModuleList([ResidualBlock(width, heads, mlp_ratio) for _ in range(layers)])
        self.checkpointing = False

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for block in self.resblocks:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return x


class CausalTextTransformer(nn.Module):
    """The causal text transformer; ``width`` is its output size (projected by the model)."""

    def __init__(self, vocab_size: int, width: int = 512, layers: int = 12, heads: int = 8,
                 context_length: int = 77, mlp_ratio: float = 4.0):
        super().__init__()
        self.width, self.context_length = int(width), int(context_length)
        self.token_embedding = nn.Embedding(int(vocab_size), self.width)
        self.positional_embedding = nn.Parameter(torch.empty(self.context_length, self.width))
        self.transformer = _Blocks(self.width, int(layers), int(heads), float(mlp_ratio))
        self.ln_final = nn.LayerNorm(self.width)
        causal = torch.full((self.context_length, self.context_length), float("-inf")).triu(1)
        self.register_buffer("causal_mask", causal, persistent=False)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        for block in self.transformer.resblocks:  # open_clip's scheme: small residual branches when deep
            std = self.width ** -0.5 * (2 * int(layers)) ** -0.5
            nn.init.normal_(block.attn.in_proj_weight, std=self.width ** -0.5)
            nn.init.normal_(block.attn.out_proj.weight, std=std)
            nn.init.normal_(block.mlp.c_fc.weight, std=(2 * self.width) ** -0.5)
            nn.init.normal_(block.mlp.c_proj.weight, std=std)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.context_length:
            raise UserError(f"clip text transformer: sequences of {length} tokens exceed context_length="
                            f"{self.context_length}; lower the text processor's max_seq_length or raise it.")
        x = self.token_embedding(input_ids) + self.positional_embedding[:length]
        x = self.transformer(x, self.causal_mask[:length, :length].to(x.dtype))
        x = self.ln_final(x)
        last = attention_mask.long().sum(1).clamp(min=1) - 1  # the end-of-text token of each row
        return x[torch.arange(x.shape[0], device=x.device), last]

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.checkpointing = True


class BertTextTower(nn.Module):
    """A transformers BERT pooled to one vector per text (``pool``: mean or cls)."""

    def __init__(self, cfg: dict[str, Any], model: str, pool: str = "mean"):
        super().__init__()
        if pool not in ("mean", "cls"):
            raise UserError(f"{model}: text_encoder.pool={pool!r}; use mean or cls.")
        self.bert = build_text_bert(cfg, model, add_pooling_layer=False)
        self.pool, self.width = pool, int(self.bert.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.bert.embeddings(input_ids=input_ids)
        x = self.bert.encoder(x, attention_mask=bidirectional_mask(self.bert, x, attention_mask))[0]
        if self.pool == "cls":
            return x[:, 0]
        weights = attention_mask.to(x.dtype).unsqueeze(-1)
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)

    def enable_gradient_checkpointing(self) -> None:
        enable_bert_checkpointing(self.bert)


def build_text_tower(cfg: dict[str, Any], model: str) -> nn.Module:
    """``model_config.<model>.text_encoder`` -> a tower with a ``width`` attribute."""
    text = dict(cfg.get("text_encoder") or {})
    kind = text.get("type", "transformer")
    if kind == "bert":
        if not text.get("pretrained_path"):
            raise UserError(f"{model}: text_encoder.type=bert needs text_encoder.pretrained_path (a local "
                            "transformers folder, or minilm); for a tower trained from scratch use type transformer.")
        bert_cfg = {"vocab_size": cfg.get("vocab_size"), "text_encoder": text, "attn_implementation": "sdpa"}
        return BertTextTower(bert_cfg, model, str(text.get("pool") or "mean"))
    if kind == "transformer":
        if cfg.get("vocab_size") is None:
            raise UserError(f"{model}: model_config.{model}.vocab_size is null and no dataset filled it in; set it.")
        sizes = ", ".join(f"{k} {text.get(k)}" for k in ("width", "heads", "layers", "context_length"))
        with library_input(f"model_config.{model}.text_encoder ({sizes}) does not build",
                           "e.g. width a multiple of heads."):
            return CausalTextTransformer(int(cfg["vocab_size"]), width=int(text["width"]), layers=int(text["layers"]),
                                         heads=int(text["heads"]), context_length=int(text["context_length"]),
                                         mlp_ratio=float(text.get("mlp_ratio", 4.0)))
    raise UserError(f"{model}: text_encoder.type={kind!r}; use transformer (mmvl's own, open_clip's layout) or bert.")
