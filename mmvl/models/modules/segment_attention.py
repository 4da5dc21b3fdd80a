"""Attention of packed rows that computes each sample's own causal square and nothing else.

A block-diagonal mask keeps packed samples apart but still computes every row's whole square:
rows of several samples spend most of their attention on blocks the mask throws away. Variable-
length attention (flash-attention's ``cu_seqlens``) skips them on GPUs that have it; this is the
same for every device, through torch's ``scaled_dot_product_attention``: one causal call per
sample, on its slice of the row, its output written back in place. The samples' spans come from the
packer on the host (``segments``: ``(row, start, end)``), so nothing waits on the device.

It is a transformers attention implementation, ``mmvl_sdpa_segments``: a batch that carries no
``mmvl_segments`` (evaluation, generation, padded batches) runs transformers' own ``sdpa``
unchanged, so a model keeps it once a packed batch has installed it (:func:`install`), also for the
recomputation of activation checkpointing, which replays the forward with the same arguments.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: the transformers attention implementation this module registers
NAME = "mmvl_sdpa_segments"
_registered = False


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, mmvl_segments: Sequence[tuple[int, int, int]] | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``B x heads x L x d`` (key and value may have fewer
    heads) -> ``B x L x heads x d``. With ``mmvl_segments``, each span attends causally within itself
    (positions outside every span, the rows' padding, get zeros); without, transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mmvl_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.size(1) // key.size(1)
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    p = dropout if module.training else 0.0
    out = query.new_zeros(query.shape)
    for row, start, end in mmvl_segments:
        out[row, :, start:end] = F.scaled_dot_product_attention(
            query[row, :, start:end], key[row, :, start:end], value[row, :, start:end], dropout_p=p, is_causal=True,
            scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def available() -> bool:
    """Whether this transformers registers attention implementations (``AttentionInterface``, 4.53+)."""
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError:
        return False
    return True


def install(config: Any) -> bool:
    """Make the transformers LM of ``config`` (its text config) attend through :func:`attention` when
    it runs sdpa; returns whether it does (else the caller masks)."""
    global _registered
    impl = str(getattr(config, "_attn_implementation", None) or "")
    if impl == NAME:
        return True
    if impl != "sdpa" or not available():
        return False
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)  # padded batches: sdpa's own mask
        _registered = True
    config._attn_implementation = NAME
    return True
