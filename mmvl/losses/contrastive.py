"""Losses over every pair of a (global) batch: ``clip`` (InfoNCE) and ``siglip`` (pairwise sigmoid)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from mmvl.distributed.comm import gather_with_grad, get_rank, get_world_size, neighbour_exchange
from mmvl.errors import UserError
from mmvl.losses.base import Loss
from mmvl.registry import register_loss


class ContrastiveLoss(Loss):
    """A loss over the pairs of a whole batch (every image against every text), not per sample.

    It reads ``output[k]`` for ``k`` in :attr:`feature_keys` (rows = samples) and the shared
    scalars ``logit_scale`` (already exponentiated) and ``logit_bias``. Because every sample
    contrasts with every other, accumulating gradients over micro-batches must keep the whole
    update's batch in the contrast: the trainer caches every micro-batch's features without
    gradients and recomputes one at a time against the cached rest (see
    :mod:`mmvl.trainers.contrastive_step`). ``cache_features=false`` with
    ``training.gradient_accumulation > 1`` is refused: per-micro-batch contrast is another loss.
    """

    feature_keys = ("image_features", "text_features")

    def __init__(self, cache_features: bool = True):
        self.cache_features = bool(cache_features)

    def _features(self, output: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        missing = [k for k in (*self.feature_keys, "logit_scale") if k not in output]
        if missing:
            if "scores" in output and len(output) == 1:
                raise _ScoresOnly()
            raise UserError(f"loss {self.name!r} needs output keys {missing} but the model returned "
                            f"{sorted(output)}; use a two-tower model such as 'clip'.")
        return output["image_features"], output["text_features"], output["logit_scale"]

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:
        """The loss of the batch; given only ``scores`` (an evaluation batch's [texts x images] logits,
        scale and bias applied), the loss of this rank's batch alone, with no collective."""
        try:
            return self.global_loss(*self._features(output), output)
        except _ScoresOnly:
            return self.batch_loss(output["scores"].float())

    def global_loss(self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor,
                    output: Mapping[str, Any]) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def batch_loss(self, scores: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class _ScoresOnly(Exception):
    """The output holds only scores (the evaluation loop's view): take the in-batch loss."""


@register_loss("clip")
class ClipLoss(ContrastiveLoss):
    """Symmetric InfoNCE over the global batch (CLIP).

    Features are gathered from every rank with gradients (:func:`gather_with_grad`), so each
    rank's loss is the loss of the whole global batch. ``local_loss``: each rank scores only its
    own rows against every column (a B x N instead of an N x N logit matrix per rank); the
    gradients are the same, the memory is a world size smaller.
    """

    name = "clip"

    def __init__(self, local_loss: bool = False, cache_features: bool = True):
        super().__init__(cache_features)
        self.local_loss = bool(local_loss)

    def batch_loss(self, scores: torch.Tensor) -> torch.Tensor:
        labels = torch.arange(scores.shape[0], device=scores.device)
        return (F.cross_entropy(scores, labels) + F.cross_entropy(scores.T, labels)) / 2

    def global_loss(self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor,
                    output: Mapping[str, Any]) -> torch.Tensor:
        all_image, all_text = gather_with_grad(image), gather_with_grad(text)
        if self.local_loss:
            per_image, per_text = scale * image @ all_text.T, scale * text @ all_image.T
            labels = torch.arange(image.shape[0], device=image.device) + image.shape[0] * get_rank()
        else:
            per_image = scale * all_image @ all_text.T
            per_text = per_image.T
            labels = torch.arange(all_image.shape[0], device=image.device)
        return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2


@register_loss("siglip")
class SigLipLoss(ContrastiveLoss):
    """The pairwise sigmoid loss (SigLIP): each rank's images against every rank's texts.

    The text blocks travel round the ring of ranks by neighbour exchange (point to point, with
    gradients), so no rank ever holds the global logit matrix or an all-gather of the features.
    The value is the sum over this rank's image rows of all their pairs, divided by the local
    batch size (as the paper and open_clip define it); it needs ``output["logit_bias"]``.
    """

    name = "siglip"

    @staticmethod
    def _pairs(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
               positives: bool) -> torch.Tensor:
        logits = scale * image @ text.T + bias
        signs = -torch.ones_like(logits)
        if positives:
            signs = signs + 2 * torch.eye(logits.shape[0], device=logits.device, dtype=logits.dtype)
        return -F.logsigmoid(signs * logits).sum() / image.shape[0]

    def batch_loss(self, scores: torch.Tensor) -> torch.Tensor:
        signs = 2 * torch.eye(scores.shape[0], device=scores.device, dtype=scores.dtype) - 1
        return -F.logsigmoid(signs * scores).sum() / scores.shape[0]

    def global_loss(self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor,
                    output: Mapping[str, Any]) -> torch.Tensor:
        if output.get("logit_bias") is None:
            raise UserError("loss 'siglip' needs output['logit_bias']; set the model's logit_bias "
                            "(e.g. model_config.clip.logit_bias: -10.0) or use loss 'clip'.")
        bias = output["logit_bias"]
        loss = self._pairs(image, text, scale, bias, positives=True)
        world, rank = get_world_size(), get_rank()
        block = text
        for _ in range(world - 1):  # after step s this rank holds rank (r - s)'s texts: all negatives
            block = neighbour_exchange(block, send_to=(rank + 1) % world, recv_from=(rank - 1) % world)
            loss = loss + self._pairs(image, block, scale, bias, positives=False)
        return loss
