"""The parts of a generative VLM (``model: vlm``): image tokens from a grid, the projector, the LM.

An image encoder of :data:`mmvl.registry.IMAGE_ENCODERS` gives a ``B x C x h x w`` grid; its cells
become image tokens (``pixel_shuffle`` folds each ``f x f`` square of cells into one token of
``C * f * f`` channels, cutting the token count by ``f^2`` as nanoVLM and Idefics3 do), a projector
maps them to the LM's hidden size, and they replace the LM's input embeddings at the image
placeholder token.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mmvl.errors import UserError, library_input
from mmvl.labels import IGNORE_INDEX
from mmvl.models.modules import segment_attention


def grid_tokens(grid: torch.Tensor, shuffle: int = 1) -> torch.Tensor:
    """``B x C x h x w`` -> ``B x (h/f * w/f) x (C * f * f)`` tokens, row by row (``f = shuffle``);
    ``B x N x C`` tokens that are no grid (an encoder's class token kept) pass as they are."""
    if grid.dim() == 3:
        if shuffle > 1:
            raise UserError(f"vlm: pixel_shuffle={shuffle} needs an image grid, and the encoder gives {grid.size(1)} "
                            "tokens that are not one (e.g. hf_vision's full strategy keeps the class token); set "
                            "pixel_shuffle: 1 or vision_feature_select_strategy: default.")
        return grid
    if shuffle > 1:
        h, w = grid.shape[-2:]
        if h % shuffle or w % shuffle:
            raise UserError(f"vlm: pixel_shuffle={shuffle} needs an image grid divisible by it, and the encoder "
                            f"gives {h}x{w}; choose a factor dividing both or change the image size.")
        grid = F.pixel_unshuffle(grid, shuffle)
    return grid.flatten(2).transpose(1, 2)


class Projector(nn.Module):
    """Image token features -> the LM's hidden size: ``layers`` linear maps with GELU between
    (LLaVA-1.5's ``mlp2x_gelu`` at ``layers: 2``)."""

    def __init__(self, in_dim: int, out_dim: int, layers: int = 2):
        super().__init__()
        if layers < 1:
            raise UserError(f"vlm: projector_layers={layers}; use 1 (linear) or more.")
        mods: list[nn.Module] = [nn.Linear(in_dim, out_dim)]
        for _ in range(layers - 1):
            mods += [nn.GELU(), nn.Linear(out_dim, out_dim)]
        self.net = nn.Sequential(*mods)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' weight-loading progress bar off while a model loads: rank 0 owns what the run
    prints, and a bar on stderr would also break the one-line errors that follow it."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_causal_lm(path: Any, attn_implementation: str = "sdpa", key: str = "model_config.vlm.language_model") -> nn.Module:
    """A transformers causal LM from a local folder (``save_pretrained``'s layout); nothing downloads.
    What transformers refuses (a folder without a model, a config.json that is not JSON, an unknown
    ``attn_implementation``) is a one-line error naming ``key`` and the folder."""
    if not path or not os.path.isdir(str(path)):
        raise UserError(f"vlm: language_model.path={path!r} is not a folder; give a local transformers causal LM "
                        "folder (config.json + weights, e.g. written by save_pretrained).")
    from transformers import AutoModelForCausalLM

    with library_input(f"{key}.path={str(path)!r} does not load", "give a causal LM folder written by save_pretrained."), \
            quiet_loading():
        return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn_implementation,
                                                    dtype=torch.float32, local_files_only=True)


def splice_image_tokens(embeds: torch.Tensor, input_ids: torch.Tensor, image: torch.Tensor,
                        token_id: int) -> torch.Tensor:
    """``embeds`` with its rows at ``input_ids == token_id`` replaced by ``image``'s tokens: sample
    ``b``'s k-th placeholder takes ``image[b, k]``. A sample without placeholders (text-only) takes
    none of its image's tokens, and one with fewer than ``image.shape[1]`` (one image where another
    sample of the batch has two) only the first, so a batch may mix them (the processor writes the
    placeholders). No host sync: the k of every position is a running count."""
    where = input_ids.eq(token_id)
    k = (where.cumsum(1) - 1).clamp(min=0, max=image.size(1) - 1)
    picked = image.to(embeds.dtype).gather(1, k.unsqueeze(-1).expand(-1, -1, image.size(-1)))
    return torch.where(where.unsqueeze(-1), picked, embeds)


def splice_in_order(embeds: torch.Tensor, input_ids: torch.Tensor, tokens: torch.Tensor, token_id: int) -> torch.Tensor:
    """``embeds`` with the positions at ``input_ids == token_id``, row by row, taking ``tokens``' rows
    (``N x T x hidden``: every image's tokens, in the order of the placeholders) one after another:
    packed rows (:mod:`mmvl.data.packing`), where a row holds several samples' images. Tokens past
    the last placeholder (a blank image a text-only batch encodes) are placed nowhere. No host sync
    (``masked_scatter``'s backward selects by the mask, whose count the host must read): the token
    of every placeholder is a running count over the rows."""
    where = input_ids.eq(token_id)
    flat = tokens.to(embeds.dtype).reshape(-1, tokens.size(-1))
    k = (where.reshape(-1).cumsum(0) - 1).clamp(min=0, max=flat.size(0) - 1)
    return torch.where(where.unsqueeze(-1), flat.index_select(0, k).view_as(embeds), embeds)


def packed_attention_mask(position_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rows x 1 x L x L``: each position attends to the earlier positions of its own sample (a sample
    starts where its ``position_ids`` restart at 0): bool (True: attends; what sdpa takes) or, with
    ``dtype``, additive (0 or the dtype's lowest; what eager attention adds). Built on the device from
    the positions alone: no host wait."""
    length = position_ids.size(-1)
    segment = position_ids.eq(0).cumsum(-1)
    same = segment.unsqueeze(-1).eq(segment.unsqueeze(-2))
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (same & causal).unsqueeze(1)
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device).masked_fill(~allowed,
                                                                                        torch.finfo(dtype).min)


def lm_packed_inputs(config: Any, batch: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """What a transformers LM of ``config`` (its text config) takes for a packed ``batch``
    (:mod:`mmvl.data.packing`): the positions, and how attention stays within each sample. sdpa: each
    sample's own square alone (:mod:`mmvl.models.modules.segment_attention`, from the packer's
    ``segments``); eager: the block-diagonal causal mask, additive in ``dtype``; flash attention: the
    positions alone (variable-length attention)."""
    positions = batch["position_ids"]
    impl = str(getattr(config, "_attn_implementation", "sdpa") or "sdpa")
    if impl.startswith("flash"):
        return {"position_ids": positions, "attention_mask": None}
    if batch.get("segments") is not None and segment_attention.install(config):
        # a 4-D mask is taken as given (none is built); the segments make the attention
        return {"position_ids": positions, "attention_mask": positions.new_ones((1, 1, 1, 1), dtype=torch.bool),
                "mmvl_segments": batch["segments"]}
    return {"position_ids": positions,
            "attention_mask": packed_attention_mask(positions, None if impl == "sdpa" else dtype)}


def left_align(input_ids: torch.Tensor, mask: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows -> the same rows left-padded (what batched decoding continues from)."""
    length = input_ids.size(1)
    n = mask.long().sum(1, keepdim=True)
    index = (torch.arange(length, device=input_ids.device).unsqueeze(0) + n) % length
    ids, m = input_ids.gather(1, index), mask.gather(1, index)
    return ids.masked_fill(m.eq(0), pad_id), m


def prompt_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's attention mask cut before each row's first answer token (``targets`` not ignored):
    the prompt generation continues from, so one labelled evaluation batch serves the loss and
    generation; a batch without ``targets`` is all prompt."""
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch["input_ids"])
    targets = batch.get("targets")
    if targets is None:
        return mask
    labelled = targets.ne(IGNORE_INDEX)
    first = torch.where(labelled.any(1), labelled.long().argmax(1), mask.long().sum(1))
    return mask * (torch.arange(mask.size(1), device=mask.device) < first.unsqueeze(1)).to(mask.dtype)


def fixed_width(new: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    """Generated ids as exactly ``width`` columns (rows that all ended early are padded), so ranks can
    gather them."""
    if new.size(1) < width:
        new = torch.cat([new, new.new_full((new.size(0), width - new.size(1)), pad_id)], 1)
    return new[:, :width]


def checkpoint_transformers(model: nn.Module) -> None:
    """transformers' own activation checkpointing of ``model``'s layers (non-reentrant)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
