"""Released VisualBERT weights from a transformers folder (``model_config.visual_bert.pretrained_path``).

A folder written by transformers' ``save_pretrained`` (``config.json`` and
``model.safetensors`` or ``pytorch_model.bin``), or the name of one in the local
Hugging Face cache (never downloaded), of any VisualBERT class: ``VisualBertModel``
or one with a head (``...ForPreTraining``, ``...ForQuestionAnswering``, ...). The
architecture (sizes, vocabulary, visual width) comes from its ``config.json``, so
the weights fit by construction, and the embeddings, encoder and pooler must load
one to one: a key left over on either side is a :class:`UserError` listing all of
them. A head loads where the model has the same one (``classifier_head: linear``
for QA / reasoning heads, ``training_head_type: pretraining`` for the pretraining
heads); otherwise it is left out, and the log line says so.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmvl.errors import UserError
from mmvl.models.modules.bert import read_checkpoint_state

log = logging.getLogger(__name__)

#: config.json fields that make the BERT inside VisualBERT
BERT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
               "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id")
#: model_config keys that still apply to a released architecture (training behaviour, not shape)
OVERRIDABLE = ("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range")
#: transformers head key prefix -> mmvl key prefix (the classifier's Linear is index 1 after its Dropout)
HEAD_PREFIXES = {
    "cls.predictions.transform.dense.": "heads.mlm.transform.0.",
    "cls.predictions.transform.LayerNorm.": "heads.mlm.transform.2.",
    "cls.predictions.bias": "heads.mlm.bias",
    "cls.seq_relationship.": "heads.itm.",
    "cls.": "classifier.1.",
}
#: the decoder shares the word embeddings (mmvl ties them, so the copies are not needed)
TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
MODEL = "visual_bert"


@dataclass
class Released:
    """A VisualBERT checkpoint folder: where it is, its ``config.json`` and its tensors (read on demand)."""

    folder: Path
    config: dict[str, Any]

    def state(self) -> dict[str, torch.Tensor]:
        return read_checkpoint_state(self.folder, MODEL)

    @property
    def visual_dim(self) -> int:
        return int(self.config.get("visual_embedding_dim", 512))


def read_released(path: str) -> Released:
    """The folder (a path or a cached Hugging Face name) with its config checked as VisualBERT's."""
    from mmvl.data.processors.text import resolve_path

    folder = resolve_path(path, f"{MODEL}: pretrained_path", needs="config.json")
    if not (folder / "config.json").is_file():
        raise UserError(f"{MODEL}: pretrained_path {str(path)!r} has no config.json; give a folder written by "
                        "transformers' save_pretrained (VisualBertModel or one of its task classes).")
    config = json.loads((folder / "config.json").read_text())
    kind = config.get("model_type")
    if kind != "visual_bert":
        hint = " (a BERT: use text_encoder.pretrained_path)" if kind == "bert" else ""
        raise UserError(f"{MODEL}: pretrained_path {str(path)!r} is a {kind!r} checkpoint, not visual_bert{hint}.")
    if config.get("bypass_transformer"):
        raise UserError(f"{MODEL}: pretrained_path {str(path)!r} has bypass_transformer=true (an extra layer over "
                        "text-only encoding), which mmvl's visual_bert does not build; use a checkpoint without it.")
    return Released(folder, config)


def released_bert_config(released: Released, cfg: dict[str, Any]) -> Any:
    """The ``BertConfig`` of the released model; dropout and init std from ``cfg`` where set."""
    from transformers import BertConfig

    fields = {k: released.config[k] for k in BERT_FIELDS if k in released.config}
    if cfg.get("vocab_size") not in (None, fields.get("vocab_size")):
        raise UserError(f"{MODEL}: vocab_size={cfg['vocab_size']} but pretrained_path {str(released.folder)!r} has "
                        f"{fields.get('vocab_size')}; use that checkpoint's tokenizer (a bert_tokenizer with its "
                        "tokenizer_path).")
    fields.update({k: cfg[k] for k in OVERRIDABLE if cfg.get(k) is not None})
    return BertConfig(**fields)


def mmvl_key(key: str) -> tuple[str, bool] | None:
    """A released key -> (mmvl key, part of the backbone); None for what mmvl has no place for."""
    key = key[len("visual_bert."):] if key.startswith("visual_bert.") else key
    if key.startswith("embeddings.visual_"):
        return "visual_embeddings." + key[len("embeddings."):], True
    if key.startswith(("embeddings.", "encoder.", "pooler.")):
        return "bert." + key, True
    for src, dst in HEAD_PREFIXES.items():
        if key == src or (src.endswith(".") and key.startswith(src)):
            return dst + key[len(src):], False
    return None


def load_released(model: nn.Module, released: Released) -> None:
    """Copy the released tensors into ``model`` (a VisualBERT-architecture ``visual_bert``), checked."""
    own = model.state_dict()
    backbone, heads, left_out, unknown = {}, {}, [], []
    for key, value in released.state().items():
        if key.endswith("position_ids") or key in TIED:  # index buffers; tied copies of word embeddings
            continue
        target = mmvl_key(key)
        if target is None:
            unknown.append(key)
        elif target[1]:
            backbone[target[0]] = value
        elif target[0] in own and own[target[0]].shape == value.shape:
            heads[target[0]] = value
        else:
            left_out.append(key)
    expected = [k for k in own if k.startswith(("bert.", "visual_embeddings."))]
    missing = [k for k in expected if k not in backbone]
    extra = unknown + [k for k in backbone if k not in own]
    shapes = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in backbone.items()
              if k in own and own[k].shape != v.shape]
    if missing or extra or shapes:
        raise UserError(f"{MODEL}: pretrained_path {str(released.folder)!r} does not match the VisualBERT "
                        f"architecture: model keys without weights {missing}; checkpoint keys with no place "
                        f"{extra}; shape mismatches {shapes}.")
    model.load_state_dict({**backbone, **heads}, strict=False)
    fresh = sorted({k.split(".")[0] for k in own if k not in backbone and k not in heads})
    log.info("%s: loaded %d VisualBERT tensors from %s (%d embeddings/encoder/pooler, %d head)%s%s", MODEL,
             len(backbone) + len(heads), released.folder, len(backbone), len(heads),
             f"; left out the checkpoint's head {left_out} (no such head here)" if left_out else "",
             f"; new layers: {fresh}" if fresh else "")
