"""Attention of packed rows that computes each sample's own causal square, and little else.

A block-diagonal mask keeps packed samples apart but still computes every row's whole square:
rows of several samples spend most of their attention on blocks the mask throws away. Variable-
length attention (flash-attention's ``cu_seqlens``) skips them on GPUs that have it; this is the
same for every device, through torch's ``scaled_dot_product_attention``: one causal call per
bucket of samples of similar length (gathered from their rows, right-padded, one causal call; at most
:data:`mmvl.data.packing.BUCKET_WASTE` times their own squares), the outputs put back in place. The
buckets' indices come from the packer with the batch, so nothing waits on the device.

It is a transformers attention implementation, ``mmvl_sdpa_segments``: a batch that carries no
``mmvl_segments`` (evaluation, generation, padded batches) runs transformers' own ``sdpa``
unchanged, so a model keeps it once a packed batch has installed it (:func:`install`), also for the
recomputation of activation checkpointing, which replays the forward with the same arguments.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: the transformers attention implementation this module registers
NAME = "mmvl_sdpa_segments"
_registered = False


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, mmvl_segments: dict[str, Any] | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``B x heads x L x d`` (key and value may have fewer
    heads) -> ``B x L x heads x d``. With ``mmvl_segments`` (the packer's
    :func:`mmvl.data.packing.attention_buckets`), each bucket's samples are gathered from the rows,
    attend causally within themselves in one call, and their real outputs go back to their positions
    in one copy (the rows' padding gets zeros); without, transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mmvl_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, length, dim = query.shape
    groups = heads // key.size(1)
    p = dropout if module.training else 0.0
    q, k, v = (t.transpose(1, 2).reshape(rows * length, t.size(1), dim) for t in (query, key, value))
    outs = []
    for index in mmvl_segments["buckets"]:
        n, longest = index.shape
        pick = index.reshape(-1)
        qb, kb, vb = (t.index_select(0, pick).view(n, longest, t.size(1), dim).transpose(1, 2) for t in (q, k, v))
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            kb, vb = kb.repeat_interleave(groups, 1), vb.repeat_interleave(groups, 1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=p, is_causal=True, scale=scaling)
        outs.append(ob.transpose(1, 2).reshape(n * longest, heads, dim))
    real = torch.cat(outs).index_select(0, mmvl_segments["slots"])
    out = q.new_zeros((rows * length, heads, dim)).index_copy(0, mmvl_segments["positions"], real)
    return out.view(rows, length, heads, dim), None


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
