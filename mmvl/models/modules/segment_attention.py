"""Attention of packed rows that computes each sample's own causal square, and little else.

A block-diagonal mask keeps packed samples apart but still computes every row's whole square:
rows of several samples spend most of their attention on blocks the mask throws away. Variable-
length attention (flash-attention's ``cu_seqlens``) skips them on GPUs that have it; this is the
same for every device, through torch's ``scaled_dot_product_attention``: one causal call per
bucket of samples of similar length (the split that computes least, counting each call's cost:
:func:`mmvl.data.packing.bucket_groups`). Query, key and value are gathered into the buckets in one
gather each and the outputs go back in one, whose gradients are gathers too (``index_select``'s own
backward, a scatter-add into a zeroed full-size copy, cost three such copies a bucket and layer).
The buckets' indices come from the packer with the batch, so nothing waits on the device.

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


class _Regather(torch.autograd.Function):
    """``x.index_select(0, index)`` with ``zero`` rows zeroed, whose gradient is the same kind of gather
    back (``back``, ``zero_back``), not a scatter-add into a zeroed copy. Exact when each row of ``x``
    feeds at most one non-zeroed output row, and rows read more often (a bucket's right pads all read
    position 0) get exactly zero gradient: what causal buckets guarantee (a real position never
    attends a right pad, and a pad's output is never read)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, zero: torch.Tensor, back: torch.Tensor,
                zero_back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back, zero_back, index, zero)
        out = x.index_select(0, index)
        return out.index_fill_(0, zero, 0) if zero.numel() else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back, zero_back, index, zero = ctx.saved_tensors
        return _Regather.apply(grad, back, zero_back, index, zero), None, None, None, None


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, mmvl_segments: dict[str, Any] | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``B x heads x L x d`` (key and value may have fewer
    heads) -> ``B x L x heads x d``. With ``mmvl_segments`` (the packer's
    :func:`mmvl.data.packing.attention_buckets`), the samples are gathered from the rows into their
    buckets (one gather each for query, key and value), each bucket attends causally in one call, and
    the outputs go back to their positions in one gather (the rows' padding gets zeros); without,
    transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mmvl_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, length, dim = query.shape
    groups = heads // key.size(1)
    p = dropout if module.training else 0.0
    gather, scatter = mmvl_segments["gather"], mmvl_segments["scatter"]
    pad_slots, row_pads = mmvl_segments["pad_slots"], mmvl_segments["row_pads"]
    none = gather[:0]
    q, k, v = (_Regather.apply(t.transpose(1, 2).reshape(rows * length, t.size(1), dim), gather, none, scatter,
                               row_pads) for t in (query, key, value))
    shapes = mmvl_segments["shapes"]
    sizes = [n * longest for n, longest in shapes]  # split, not sliced: the gradients join in one cat
    outs = []
    for (n, longest), qb, kb, vb in zip(shapes, *(t.split(sizes) for t in (q, k, v))):
        qb, kb, vb = (t.view(n, longest, t.size(1), dim).transpose(1, 2) for t in (qb, kb, vb))
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            kb, vb = kb.repeat_interleave(groups, 1), vb.repeat_interleave(groups, 1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=p, is_causal=True, scale=scaling)
        outs.append(ob.transpose(1, 2).reshape(n * longest, heads, dim))
    out = _Regather.apply(torch.cat(outs) if len(outs) > 1 else outs[0], scatter, row_pads, gather, pad_slots)
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
