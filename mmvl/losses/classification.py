"""Per-sample classification losses: ``cross_entropy``, ``logit_bce``, ``soft_label_cross_entropy``."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mmvl.errors import UserError
from mmvl.losses.base import Loss
from mmvl.registry import register_loss


@register_loss("cross_entropy")
class CrossEntropyLoss(Loss):
    """Softmax cross entropy against class indices ``targets`` (long, shape [N])."""

    name = "cross_entropy"

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0,
                 weight: Sequence[float] | None = None):
        self.ignore_index = int(ignore_index)
        self.label_smoothing = float(label_smoothing)
        self.weight = torch.tensor(list(weight), dtype=torch.float) if weight is not None else None
        self._placed: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def weight_like(self, scores: torch.Tensor) -> torch.Tensor | None:
        """The class weights on ``scores``' device and dtype, copied there once (a host-to-device copy
        on every update would make the host wait for it)."""
        if self.weight is None:
            return None
        key = (scores.device, scores.dtype)
        placed = self._placed.get(key)
        if placed is None:
            placed = self._placed[key] = self.weight.to(scores.device, scores.dtype)
        return placed

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:
        scores, targets = self._get(batch, output)
        if targets.dim() == scores.dim() and targets.dtype.is_floating_point:
            raise UserError(
                f"loss 'cross_entropy' got float targets of shape {tuple(targets.shape)}; it expects class "
                "indices (long, [N]). Use 'soft_label_cross_entropy' or 'logit_bce' for soft targets."
            )
        return F.cross_entropy(scores, targets.long(), weight=self.weight_like(scores),
                               ignore_index=self.ignore_index, label_smoothing=self.label_smoothing)


@register_loss("logit_bce")
class LogitBinaryCrossEntropy(Loss):
    """Sigmoid BCE against float targets in [0, 1] (e.g. VQA soft answer scores).

    Like MMF, the element-wise mean is multiplied by the number of classes, so the
    value is the per-sample *sum* over classes averaged over the batch; this keeps
    the gradient scale independent of the answer vocabulary size and makes MMF
    learning rates transfer unchanged.
    """

    name = "logit_bce"

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:
        scores, targets = self._get(batch, output)
        if targets.shape != scores.shape:
            raise UserError(
                f"loss 'logit_bce' needs targets shaped like scores {tuple(scores.shape)}, got "
                f"{tuple(targets.shape)}; give the dataset soft/multi-hot targets or use 'cross_entropy'."
            )
        loss = F.binary_cross_entropy_with_logits(scores, targets.to(scores.dtype), reduction="mean")
        return loss * targets.size(1)


@register_loss("soft_label_cross_entropy")
class SoftLabelCrossEntropy(Loss):
    """Cross entropy against a target distribution ``-sum_c t_c log softmax(s)_c``.

    Targets may be [N, C] soft labels (rows summing to 0 are ignored) or [N]
    class indices (``ignore_index`` rows ignored). With ``normalize_targets``
    each row is divided by its sum first, so multi-hot labels become uniform
    distributions. The mean runs over the rows that are not ignored.
    """

    name = "soft_label_cross_entropy"

    def __init__(self, normalize_targets: bool = True, ignore_index: int = -100):
        self.normalize_targets = bool(normalize_targets)
        self.ignore_index = int(ignore_index)

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:
        scores, targets = self._get(batch, output)
        if targets.dim() == 1:  # one-hot rows by a scatter, ignored rows zero: no value-sized indexing (a sync)
            keep = targets.ne(self.ignore_index)
            index = torch.where(keep, targets.long(), 0).unsqueeze(1)
            targets = torch.zeros_like(scores).scatter_(1, index, keep.unsqueeze(1).to(scores.dtype))
        else:
            targets = targets.to(scores.dtype)
            keep = targets.sum(-1).ne(0)
        if self.normalize_targets:
            targets = targets / targets.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)
        per_sample = -(targets * F.log_softmax(scores, dim=-1)).sum(-1)
        return per_sample.sum() / keep.sum().clamp(min=1)
