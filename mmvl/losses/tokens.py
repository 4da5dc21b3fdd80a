"""``answer_tokens``: a generative model's token loss, normalised over the whole update.

The mean over a micro-batch's own answer tokens weighs a token of a short micro-batch more than
one of a long micro-batch, so gradient accumulation and data parallelism give another gradient
than one big batch (transformers #39123, LlamaFactory #7443). Here the trainer calls
:meth:`AnswerTokensLoss.begin_update` once per update with all of the update's micro-batches: it
counts their answer tokens and sums the count over ranks (one all-reduce, kept on the device: no
host sync). Each micro-batch's loss is then ``sum of its token losses / total * (G * W)`` with G
micro-batches and W ranks, so after :meth:`mmvl.engine.Engine.backward` divides by G and data
parallelism averages over W, the gradient is exactly that of the summed loss over all answer
tokens of the update divided by their number: one big batch's.

Without ``begin_update`` (evaluation, a plain forward) a batch is normalised by its own answer
tokens.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mmvl.distributed import comm
from mmvl.labels import IGNORE_INDEX
from mmvl.losses.base import Loss
from mmvl.registry import register_loss


def answer_token_count(batch: Mapping[str, Any]) -> torch.Tensor:
    """The tokens ``batch`` labels (the next-token targets that are not ignored), as a tensor."""
    return batch["targets"][:, 1:].ne(IGNORE_INDEX).sum()


@register_loss("answer_tokens")
class AnswerTokensLoss(Loss):
    """Next-token cross entropy of ``output["scores"]`` (B x L x V logits) against ``batch["targets"]``
    (B x L, -100 where not an answer token), summed and divided by the update's answer-token count."""

    name = "answer_tokens"

    def __init__(self) -> None:
        self._total: torch.Tensor | None = None
        self._scale = 1.0
        self._left = 0

    def begin_update(self, batches: Sequence[Mapping[str, Any]]) -> None:
        """Count the answer tokens of all ``batches`` (this rank's micro-batches of one update) and
        sum over ranks; the next ``len(batches)`` training calls divide by that total."""
        local = torch.stack([answer_token_count(b) for b in batches]).sum()
        self._total = comm.all_reduce(local).clamp(min=1)
        self._scale = float(len(batches) * comm.get_world_size())
        self._left = len(batches)

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:
        scores, targets = self._get(batch, output)
        logits, labels = scores[:, :-1], targets[:, 1:].to(scores.device)
        summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1).long(),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        if self._left > 0 and torch.is_grad_enabled():
            self._left -= 1
            total, scale = self._total, self._scale
            if self._left == 0:
                self._total = None
            return summed / total.to(summed.device, summed.dtype) * scale
        return summed / labels.ne(IGNORE_INDEX).sum().clamp(min=1).to(summed.dtype)
