"""Gradient accumulation that keeps a contrastive loss's batch global (open_clip's ``accum_freq``).

A contrastive loss contrasts every sample with every other of the batch, so the plain
accumulation (each micro-batch's loss on its own, divided by their number) is another loss:
one with a batch ``gradient_accumulation`` times smaller. Here the update's micro-batches are
drawn first; their features are computed without gradients and cached; then each micro-batch
is run again with gradients and its fresh features take their place among the cached ones, so
every backward is of the whole update's loss, differentiated through that micro-batch only.
The sum of those gradients is the gradient of one step on the whole batch. The shared scalars
(``logit_scale``, ``logit_bias``) keep their gradient on the first micro-batch only, where it is
already the whole batch's. The price is one extra forward per micro-batch (no backward).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.errors import UserError
from mmvl.losses import ContrastiveLoss, compute_losses

#: model outputs that are one value for the whole batch: taken from the fresh forward, not concatenated
SHARED_KEYS = ("logit_scale", "logit_bias")


def uses_cached_contrast(losses: Sequence[tuple[str, Any]], gradient_accumulation: int) -> bool:
    """Whether an update must take the cached path; refuses what would silently change the loss."""
    contrastive = [(n, l) for n, l in losses if isinstance(l, ContrastiveLoss)]
    if gradient_accumulation == 1 or not contrastive:
        return False
    off = [n for n, l in contrastive if not l.cache_features]
    if off:
        raise UserError(f"loss {off[0]!r} has cache_features=false with training.gradient_accumulation="
                        f"{gradient_accumulation}: each micro-batch would contrast only with itself, a different "
                        "loss. Set cache_features: true, or gradient_accumulation: 1 with a larger batch_size.")
    if len(contrastive) != len(losses):
        others = [n for n, l in losses if not isinstance(l, ContrastiveLoss)]
        raise UserError(f"losses {others} cannot share an accumulated contrastive update (gradient_accumulation="
                        f"{gradient_accumulation}); use only contrastive losses, or gradient_accumulation: 1.")
    return True


def _features(output: Mapping[str, Any], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    if output.get("losses"):
        raise UserError("a model that returns output['losses'] cannot use the cached contrastive accumulation; "
                        "set training.gradient_accumulation: 1.")
    return {k: output[k] for k in keys if k in output}


def cached_contrastive_update(engine: Any, model: torch.nn.Module, losses: Sequence[tuple[str, Any]],
                              batches: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
    """Backward of the whole update's contrastive loss, one micro-batch at a time; each micro-batch's
    loss dict (plus ``total_loss``), every one the whole batch's value."""
    keys = sorted({k for _, loss in losses for k in loss.feature_keys})
    with torch.no_grad(), engine.autocast():
        cached = [_features(model(batch), keys) for batch in batches]
    micro = []
    for i, batch in enumerate(batches):
        with engine.accumulate(model):
            with engine.autocast():
                output = model(batch)
                fresh = _features(output, keys)
                merged = {k: torch.cat([c[k] for c in cached[:i]] + [fresh[k]] + [c[k] for c in cached[i + 1:]])
                          for k in fresh}
                for k in SHARED_KEYS:
                    if output.get(k) is not None:
                        merged[k] = output[k] if i == 0 else output[k].detach()
                values = compute_losses(losses, batch, merged)
            loss = sum(values.values())
            engine.backward(loss, divide=False)
        micro.append({**values, "total_loss": loss})
    return micro
