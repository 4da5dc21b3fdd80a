"""Which rows of an evaluation batch a rank owns, and in which order rank 0 writes them.

Rank ``r`` of ``W`` is handed the dataset positions ``r, r + W, ...``; the sampler pads the last
round with duplicates so every rank sees as many batches. Each rank knows the position of every
sample it sees, so it drops the padding itself before anything is counted.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mmvl.data.processors.vlm_processor import IMAGES, first_images
from mmvl.errors import UserError


def owned(count: int, total: int, env: Any) -> int:
    """How many of this rank's first ``count`` samples are real (the rest pad the last round)."""
    if env.world_size == 1:
        return min(count, total)
    # this rank's k-th sample is dataset position k * W + r: real while < total
    real = max(0, -(-(total - env.rank) // env.world_size))
    return min(count, real)


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """The number of samples in ``batch`` (the first per-sample entry's length)."""
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
        if isinstance(v, (list, tuple)):
            return len(v)
    raise UserError(f"evaluation: cannot tell the batch size of a batch with keys {sorted(batch)}.")


def first_rows(batch: Mapping[str, Any], n: int, size: int) -> dict[str, Any]:
    """The first ``n`` samples of every per-sample entry (the rest are the sampler's padding)."""
    if n == size:
        return dict(batch)
    out = {}
    for k, v in batch.items():
        if k == IMAGES and isinstance(v, Mapping):  # a released VLM's image tensors: cut by their rows per sample
            v = first_images(v, n)
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size:
            v = v[:n]
        elif isinstance(v, (list, tuple)) and len(v) == size:
            v = v[:n]
        out[k] = v
    return out


def in_dataset_order(parts: list[list[Any]]) -> list[Any]:
    """Rank r's j-th row of a batch round is dataset position (round start + j) * W + r."""
    longest = max((len(p) for p in parts), default=0)
    return [p[j] for j in range(longest) for p in parts if j < len(p)]
