"""Registered losses and the helpers the trainer uses to apply them.

A loss is ``cls(**params)``; its instance is called ``loss(batch, output)`` and
returns a scalar tensor averaged over the batch. Losses read
``output["scores"]`` and ``batch["targets"]`` so models and datasets only have
to agree on those two names.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mmvl.config.access import plain
from mmvl.config.components import build_component, component_spec
from mmvl.distributed.comm import gather_with_grad, get_rank, get_world_size, neighbour_exchange
from mmvl.errors import UserError
from mmvl.registry import LOSSES, register_loss

#: the label a masked-LM / token loss ignores (``torch.nn.functional.cross_entropy``'s default)
IGNORE_INDEX = -100


class Loss:
    """Base class: checks the tensors it needs exist and names the loss in errors."""

    name = "loss"

    def _get(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "scores" not in output:
            raise UserError(
                f"loss {self.name!r} needs output['scores'] but the model returned keys "
                f"{sorted(output)}; return 'scores' from forward() or drop this loss from losses:."
            )
        if "targets" not in batch:
            raise UserError(
                f"loss {self.name!r} needs batch['targets'] but the batch has keys {sorted(batch)}; "
                "the dataset must yield 'targets' (or remove this loss for this dataset)."
            )
        return output["scores"], batch["targets"]

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


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


def build_losses(loss_configs: Sequence[Any] | None) -> list[tuple[str, Loss]]:
    """``[{type, params}, ...]`` (or plain names) -> ``[(name, loss), ...]``.

    Names are the types; a repeated type gets ``_1``, ``_2``... so every entry
    in the logged loss dict is distinct.
    """
    out: list[tuple[str, Loss]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(plain(loss_configs) or []):
        loss = build_component(LOSSES, entry, where=f"losses[{i}]")
        type_ = component_spec(entry, f"losses[{i}]")[0]
        count = seen.get(type_, 0)
        seen[type_] = count + 1
        out.append((type_ if count == 0 else f"{type_}_{count}", loss))
    return out


def compute_losses(losses: Sequence[tuple[str, Any]], batch: Mapping[str, Any],
                   output: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every configured loss plus any ``output["losses"]`` the model returned.

    Model-computed losses come first; a name used by both is an error rather
    than a silent overwrite. The trainer sums the values for backward; an empty
    dict means there is nothing to optimise (the trainer should say so in training).
    """
    result: dict[str, torch.Tensor] = {}
    model_losses = output.get("losses")
    if model_losses is not None:
        if not isinstance(model_losses, Mapping):
            raise UserError(f"model output['losses'] must be a dict of name -> scalar tensor, got "
                            f"{type(model_losses).__name__}.")
        for name, value in model_losses.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise UserError(f"model output['losses'][{name!r}] must be a scalar tensor, got "
                                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}.")
            result[str(name)] = value.reshape(())
    for name, loss in losses:
        if name in result:
            raise UserError(f"loss {name!r} is both returned by the model in output['losses'] and listed "
                            "in losses:; remove one of them.")
        result[name] = loss(batch, output)
    return result
