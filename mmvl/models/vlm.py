"""A generative VLM, LLaVA-style: image encoder -> projector -> image tokens inside a causal LM.

The encoder (any of :data:`mmvl.registry.IMAGE_ENCODERS`) turns pixels into a grid; its cells
(``pixel_shuffle`` folds f x f cells into one token) are projected to the LM's hidden size and
replace the LM's input embeddings at the image placeholder tokens the ``prompt_answer`` processor
wrote. ``forward`` returns the LM's next-token logits as ``scores``; the ``answer_tokens`` loss
reads them against ``targets`` (answer tokens only). :meth:`generate` writes text: greedy or beam
decoding with the LM's KV cache through transformers' ``generate`` from input embeddings.

The LM comes from a local transformers folder (``language_model.path``) or, with a null path, is
a randomly initialised LM of ``language_model.random`` (a transformers config, e.g. a tiny
Llama), sized to the dataset's vocabulary: what tests and the docs' tiny run use.

Parts (``freeze``): ``image_encoder``, ``projector``, ``language_model``; ``base`` is all but the
projector, so LLaVA's stage 1 is ``freeze: [base]`` and stage 2 ``freeze: [image_encoder]``.
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mmvl.errors import UserError, library_input
from mmvl.models.base import BaseModel
from mmvl.models.modules.image_encoders import build_image_encoder
from mmvl.models.modules.vlm_parts import (Projector, checkpoint_transformers, fixed_width, grid_tokens, left_align,
                                           lm_packed_inputs, load_causal_lm, prompt_mask, splice_image_tokens,
                                           splice_in_order)
from mmvl.registry import register_model


@register_model("vlm")
class VLM(BaseModel):
    """``forward(batch) -> {"scores": B x L x vocab logits}``; ``generate(batch) -> B x new ids``."""

    config_path = "models/vlm.yaml"
    PARTS = {"image_encoder": ("image_encoder",), "projector": ("projector",), "language_model": ("lm",)}
    HEAD = ("projector",)
    packs_samples = True  # forward takes packed rows (mmvl.data.packing)

    def __init__(self, config: DictConfig):
        super().__init__(config)
        self.generation = check_generation(config.generation)  # used only when decoding: checked now
        self.shuffle = positive_int(config.get("pixel_shuffle"), "pixel_shuffle", "1 (off) or 2 (4x fewer image tokens)")
        self.summary_token = config.get("summary_token", False)
        if not isinstance(self.summary_token, bool):
            raise UserError(f"model_config.vlm.summary_token={self.summary_token!r}; use true (one more image token, "
                            "the mean of the grid's) or false.")
        expected = config.get("image_tokens")  # 0: a text-only processor writes no placeholders, nothing to check
        self.expected_tokens = None if expected in (None, 0) else positive_int(expected, "image_tokens", "the "
                                                                               "text processor's image_tokens")
        lm_cfg = config.language_model
        self.lm = (load_causal_lm(lm_cfg.path, str(lm_cfg.attn_implementation)) if lm_cfg.get("path")
                   else self._random_lm(config))
        for key in ("image_token_id", "pad_token_id", "eos_token_id"):
            if config.get(key) is None:
                raise UserError(f"model_config.vlm.{key} is null and no dataset filled it in; use a dataset with a "
                                "prompt_answer text processor (e.g. sort_of_clevr_generative) or set it.")
        self.image_token_id, self.pad_token_id = int(config.image_token_id), int(config.pad_token_id)
        self.eos_token_id = int(config.eos_token_id)
        self.image_encoder = build_image_encoder(config.image_encoder)
        hidden = int(self.lm.get_input_embeddings().embedding_dim)
        self.projector = Projector(int(self.image_encoder.out_dim) * self.shuffle ** 2, hidden,
                                   int(config.projector_layers))

    @staticmethod
    def _random_lm(config: DictConfig) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        spec = dict(OmegaConf.to_container(config.language_model.random, resolve=True) or {})
        spec = {key: value for key, value in spec.items() if value is not None}  # null: the model type's default
        if config.get("vocab_size") is None or "model_type" not in spec:
            raise UserError("model_config.vlm: with language_model.path null, language_model.random needs a "
                            "model_type (e.g. llama) and a dataset must fill vocab_size.")
        kind = spec.pop("model_type")
        ids = {k: int(config[k]) for k in ("pad_token_id", "eos_token_id") if config.get(k) is not None}
        attn = str(config.language_model.attn_implementation)
        with library_input(f"model_config.vlm.language_model.random ({kind}) does not build", "fix the setting it names."):
            lm_config = AutoConfig.for_model(kind, vocab_size=int(config.vocab_size), **ids, **spec)
            lm_config._attn_implementation = attn
            return AutoModelForCausalLM.from_config(lm_config)

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (``B x C x H x W``, or ``B x images x C x H x W`` for several a sample) -> ``B x tokens
        x hidden`` projected image tokens, each image's in turn (``summary_token``: the grid's mean
        first). Their number per image must be the placeholders' (``image_tokens``):
        ``splice_image_tokens`` would otherwise drop or repeat tokens without a word, so it is
        checked here, on shapes only (no wait on the device)."""
        if pixels.dim() == 5:  # several images a sample: encoded together, their tokens one after another
            tokens = self.image_tokens(pixels.flatten(0, 1))
            return tokens.reshape(pixels.size(0), pixels.size(1) * tokens.size(1), tokens.size(2))
        tokens = grid_tokens(self.image_encoder(pixels), self.shuffle)
        if self.summary_token:
            tokens = torch.cat([tokens.mean(1, keepdim=True), tokens], 1)
        if self.expected_tokens is not None and tokens.size(1) != self.expected_tokens:
            made = f"{tokens.size(1) - self.summary_token} grid tokens" + (" + 1 summary" if self.summary_token else "")
            raise UserError(f"vlm: a {tuple(pixels.shape[-2:])} image gives {made} (pixel_shuffle {self.shuffle}), and "
                            f"the text processor writes image_tokens={self.expected_tokens} placeholders; set the "
                            f"dataset's processors.text_processor.params.image_tokens={tokens.size(1)} (or change "
                            "pixel_shuffle, summary_token or the image size).")
        return self.projector(tokens)

    def embed(self, input_ids: torch.Tensor, pixels: torch.Tensor, in_order: bool = False) -> torch.Tensor:
        """The LM's input embeddings with the image tokens at the placeholders: each row's from its own
        images, or with ``in_order`` (packed rows) the images' tokens one after another, row by row."""
        embeds = self.lm.get_input_embeddings()(input_ids.masked_fill(input_ids.eq(self.image_token_id), 0))
        splice = splice_in_order if in_order else splice_image_tokens
        return splice(embeds, input_ids, self.image_tokens(pixels), self.image_token_id)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        ids = batch["input_ids"]
        if batch.get("position_ids") is not None:  # packed rows (training.packing): images in placeholder order
            embeds = self.embed(ids, batch["image"], in_order=True)
            out = self.lm(inputs_embeds=embeds, use_cache=False,
                          **lm_packed_inputs(self.lm.config, batch, embeds.dtype))
            return {"scores": out.logits}
        embeds = self.embed(ids, batch["image"])
        out = self.lm(inputs_embeds=embeds, attention_mask=batch.get("attention_mask"), use_cache=False)
        return {"scores": out.logits}

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], **overrides: Any) -> torch.Tensor:
        """Continue each prompt (right-padded, as collated) by greedy (``num_beams: 1``) or beam
        decoding with the KV cache; returns ``B x max_new_tokens`` ids (after the end token: pad).
        A batch with answers (``targets``) is cut before its first answer token, so one evaluation
        batch serves both the loss and generation."""
        synced = bool(overrides.pop("synced_gpus", False))  # sharded parameters: every rank steps until all end
        opts = {**self.generation, **overrides}
        ids, mask = left_align(batch["input_ids"], prompt_mask(batch), self.pad_token_id)
        embeds = self.embed(ids, batch["image"])
        new = self.lm.generate(inputs_embeds=embeds, attention_mask=mask, do_sample=False,
                               max_new_tokens=int(opts["max_new_tokens"]), num_beams=int(opts["num_beams"]),
                               pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id,
                               suppress_tokens=[self.image_token_id],  # never write a placeholder
                               synced_gpus=synced)
        return fixed_width(new, int(opts["max_new_tokens"]), self.pad_token_id)

    def enable_gradient_checkpointing(self) -> None:
        checkpoint_transformers(self.lm)
        enable = getattr(self.image_encoder, "enable_gradient_checkpointing", None)
        if enable is not None:
            enable()

    def shard_units(self) -> list[torch.nn.Module]:
        layers = getattr(getattr(self.lm, "model", None), "layers", None)
        return list(layers) if layers is not None else []


def positive_int(value: Any, key: str, example: str) -> int:
    """``model_config.vlm.<key>`` as an integer of at least 1 (0 is never read as "off")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"model_config.vlm.{key}={value!r} must be an integer of 1 or more; use {example}.")
    return value


def check_generation(section: Any) -> dict[str, Any]:
    """``model_config.vlm.generation``, checked when the model is built: decoding runs only at
    evaluation or ``mmvl_predict``, and a mistake there must not wait for a trained model."""
    generation = dict(OmegaConf.to_container(section, resolve=True) or {})
    examples = {"max_new_tokens": "e.g. 8 (the longest answer in tokens)", "num_beams": "1 (greedy) or e.g. 4"}
    for key, example in examples.items():
        positive_int(generation.get(key), f"generation.{key}", example)
    return generation
