"""Registered evaluation metrics, computed by streaming over an evaluation set.

A metric never keeps a batch x classes matrix for the whole split. Each batch is
reduced at once to what the metric needs: counts (accuracy, F1), one value per
sample (VQA accuracy: the soft score of the predicted answer; ROC-AUC: the positive
probability and the label) or a fixed-size summary (retrieval recall: each caption's
rank and, per image, its best caption score and the gallery's top scores).

The contract (see :mod:`mmvl.registry`): ``reset()``; ``update(batch, output)`` for
every batch, with only the samples this rank owns (the evaluation drops a distributed
sampler's padded duplicates first); ``sync()`` on every rank, which combines the ranks'
states (sums are all-reduced, per-sample values gathered in dataset order); and
``compute() -> {name: float}``. ``metric(batch, output)`` runs all of it on one whole
set (no sync). States are declared with :meth:`Metric.add`: ``sum``, ``max`` and
``topk`` tensors, ``cat`` (per-sample tensors or lists) and ``counter`` (a dict of
counts, e.g. per group).

Metrics written against the earlier contract (a subclass that implements only
``compute_metric(batch, output)`` over the whole set) keep working: the default
``update`` keeps their ``required_keys``/``output_keys`` for the whole split (memory
grows with the split, as it did) and ``compute`` calls ``compute_metric`` once.

``scores`` are the model's raw logits: [N, C] for C classes, or [N] / [N, 1]
for a single binary logit (positive when > 0). ``targets`` are class indices
[N] or soft / multi-hot rows [N, C] (their argmax is the label).

The streaming base is :mod:`mmvl.metrics.base`; the families register themselves on import:
:mod:`mmvl.metrics.classification`, :mod:`mmvl.metrics.retrieval`, :mod:`mmvl.metrics.two_tower`
(zero-shot classification and image-text retrieval through a two-tower model's encoders) and
:mod:`mmvl.metrics.generation` (CIDEr, BLEU-4, ROUGE-L and VQA accuracy of decoded text: a metric
with ``generates = True`` makes the evaluation decode the split with the model's ``generate``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmvl.config.access import plain
from mmvl.config.components import build_component
from mmvl.metrics import classification, generation, retrieval, two_tower  # noqa: F401  (registration)
from mmvl.metrics.base import KINDS, Metric, concat_for_metrics
from mmvl.metrics.classification import binary_roc_auc
from mmvl.registry import METRICS

__all__ = ["KINDS", "Metric", "binary_roc_auc", "build_metrics", "concat_for_metrics"]


def build_metrics(configs: Sequence[Any] | None) -> list[Metric]:
    """``[{type, params}, ...]`` (or plain names) -> metric instances."""
    return [build_component(METRICS, entry, where=f"metrics[{i}]") for i, entry in enumerate(plain(configs) or [])]
