"""Retrieval metrics: image-text recall@k from similarity rows, without the score matrix."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.distributed import comm
from mmvl.errors import UserError
from mmvl.metrics.base import Metric, rate, scores_of
from mmvl.registry import register_metric


@register_metric("recall@k")
class RecallAtK(Metric):
    """Image-text retrieval recall@k.

    ``output["scores"]`` is the [N_text, N_image] similarity of every caption
    with every image of the evaluation gallery (the model scores each batch's
    captions against the whole gallery, so rows concatenate across batches) and
    ``batch["targets"]`` [N_text] is the column of each caption's image.
    ``recall@k`` is the fraction of captions whose image ranks in the top k
    (text -> image). With ``i2t`` also ``recall@k/i2t``: the fraction of images
    (with at least one caption) whose best-ranked caption is in the top k.
    Ties rank against the match (a constant scorer gets no credit).

    State, never the score matrix: per k, how many captions rank their image in
    the top k; for ``i2t``, per image, the best score of one of its own captions,
    whether it has one, and the ``max(k) + 1`` highest scores any caption gave
    it: an image's best caption ranks in the top k exactly when at most k of
    those are at least its best own score.

    A two-tower model's embeddings are ranked by the ``retrieval`` metric
    (:mod:`mmvl.metrics.two_tower`) with the same rule, through :func:`gallery_ranks`.
    """

    name = "recall@k"

    def __init__(self, k: Sequence[int] | int = (1, 5, 10), i2t: bool = False):
        self.ks = [int(x) for x in ([k] if isinstance(k, int) else k)]
        if not self.ks or min(self.ks) < 1:
            raise UserError(f"metric 'recall@k': k must be positive integers, got {k!r}.")
        self.i2t = bool(i2t)

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        scores = scores_of(output)
        targets = torch.as_tensor(batch["targets"]).reshape(-1).long().to(scores.device)
        if scores.dim() != 2 or targets.numel() and not (0 <= targets.min() and targets.max() < scores.size(1)):
            raise UserError(f"metric 'recall@k' needs scores [N_text, N_image] and targets indexing image "
                            f"columns; got scores {tuple(scores.shape)}, targets in "
                            f"[{int(targets.min())}, {int(targets.max())}].")
        gallery = self.state("gallery")
        if gallery is not None and int(gallery) != scores.size(1):
            raise UserError(f"metric 'recall@k': batches score {int(gallery)} and {scores.size(1)} images; every "
                            "batch must score its captions against the same gallery.")
        self.add("gallery", "max", torch.tensor(scores.size(1)))
        match = scores[torch.arange(len(targets), device=scores.device), targets]
        t2i_rank = (scores >= match[:, None]).sum(1) - 1  # other images scoring at least the match
        self.add("t2i_hits", "sum", torch.stack([(t2i_rank < k).sum() for k in self.ks]))
        if self.i2t:
            best_own = torch.full((scores.size(1),), -float("inf"), device=scores.device)
            best_own.scatter_reduce_(0, targets, match, reduce="amax")
            self.add("best_own", "max", best_own)
            self.add("has_caption", "sum", torch.bincount(targets, minlength=scores.size(1)))
            self.add("top", "topk", scores, max(self.ks) + 1)

    def compute(self) -> dict[str, float]:
        self.require_samples()
        hits = self.state("t2i_hits").cpu()
        result = {f"recall@{k}": rate(hits[i], self.samples) for i, k in enumerate(self.ks)}
        if self.i2t:
            best_own, top = self.state("best_own").cpu(), self.state("top").cpu()
            captioned = self.state("has_caption").cpu() > 0
            at_least = (top >= best_own[None, :]).sum(0)[captioned]  # = the rank + 1 when <= max(k)
            result.update({f"recall@{k}/i2t": rate((at_least <= k).sum(), captioned.sum()) for k in self.ks})
        return result


def gallery_ranks(queries: torch.Tensor, query_keys: torch.Tensor, gallery: torch.Tensor,
                  gallery_keys: torch.Tensor, depth: int, block_size: int) -> torch.Tensor:
    """How many negatives score at least each query's best positive, counted up to ``depth``.

    ``queries`` [n, D] are this rank's; the gallery is the union of every rank's ``gallery``
    [m_r, D] (a collective: every rank calls it, with its own, possibly empty, part). A gallery
    row is a positive of a query when their keys are equal, a negative otherwise. The rule is
    :class:`RecallAtK`'s (ties rank against the match): the best positive ranks in the top k
    exactly when the result is < k. Values are capped at ``depth`` (also for a query without a
    positive), so the answer holds for every k <= ``depth``.

    Never more than ``block_size`` gallery rows are held besides this rank's own, and never more
    than ``block_size`` x ``block_size`` scores: each rank's gallery is broadcast in blocks and
    every query keeps only its best positive score and its ``depth`` highest negative scores
    (merged block by block), so memory is linear in the local rows whatever the gallery's size.
    """
    if block_size < 1 or depth < 1:
        raise UserError(f"retrieval: block_size ({block_size}) and depth ({depth}) must be positive.")
    device, dim = queries.device, queries.shape[1]
    best_pos = torch.full((len(queries),), -float("inf"), device=device)
    top_neg = torch.full((len(queries), depth), -float("inf"), device=device)
    world, rank = comm.get_world_size(), comm.get_rank()
    sizes = [int(gallery.shape[0])] if world == 1 else [int(n) for n in comm.all_gather_object(int(gallery.shape[0]))]
    for src, size in enumerate(sizes):
        for start in range(0, size, block_size):
            n = min(block_size, size - start)
            if src == rank:
                block = gallery[start:start + n].float().contiguous()
                keys = gallery_keys[start:start + n].to(device).long().contiguous()
            else:
                block = torch.empty((n, dim), device=device)
                keys = torch.empty((n,), dtype=torch.long, device=device)
            block, keys = comm.broadcast(block, src), comm.broadcast(keys, src)
            for q in range(0, len(queries), block_size):
                scores = queries[q:q + block_size].float() @ block.T
                positive = query_keys[q:q + block_size, None].to(device) == keys[None, :]
                best_pos[q:q + block_size] = torch.maximum(
                    best_pos[q:q + block_size], scores.masked_fill(~positive, -float("inf")).amax(1))
                merged = torch.cat([top_neg[q:q + block_size], scores.masked_fill(positive, -float("inf"))], 1)
                top_neg[q:q + block_size] = merged.topk(depth, dim=1).values
    return (top_neg >= best_pos[:, None]).sum(1)
