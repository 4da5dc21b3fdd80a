"""Classification metrics: accuracy (per group too), VQA soft accuracy, F1, ROC-AUC.

``scores`` are the model's raw logits: [N, C] for C classes, or [N] / [N, 1] for a single binary
logit (positive when > 0). ``targets`` are class indices [N] or soft / multi-hot rows [N, C]
(their argmax is the label).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.errors import UserError
from mmvl.metrics.base import Metric, f1, labels_of, predictions_of, rate, scores_of
from mmvl.registry import register_metric

log = logging.getLogger(__name__)


@register_metric("accuracy")
class Accuracy(Metric):
    """Fraction of samples whose argmax score is the target class.

    With ``group_key`` the batch carries a group per sample (int index into
    ``group_names``, or the group's name as a string) and ``accuracy/<group>``
    is reported for every group that has samples. State: counts.
    """

    name = "accuracy"

    def __init__(self, group_key: str | None = None, group_names: Sequence[str] | None = None):
        self.group_key = group_key
        self.group_names = [str(g) for g in group_names] if group_names is not None else None
        self.required_keys = ("targets",) + ((group_key,) if group_key else ())

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        n = self.check(batch, output)
        correct = predictions_of(scores_of(output)) == labels_of(batch["targets"]).to(output["scores"].device)
        self.add("counts", "sum", torch.stack([correct.sum(), torch.tensor(n, device=correct.device)]))
        if self.group_key:
            hits: dict[str, list[int]] = {}
            for g, c in zip(self._group_of_each(batch[self.group_key]), correct.tolist()):
                pair = hits.setdefault(g, [0, 0])
                pair[0] += int(c)
                pair[1] += 1
            self.add("groups", "counter", {g: torch.tensor(p) for g, p in hits.items()})

    def compute(self) -> dict[str, float]:
        self.require_samples()
        counts = self.state("counts")
        result = {"accuracy": rate(counts[0], counts[1])}
        if self.group_key:
            groups = self.state("groups", {})
            order = self.group_names if self.group_names is not None else sorted(groups)
            for name in order:
                if name in groups and int(groups[name][1]):
                    result[f"accuracy/{name}"] = rate(groups[name][0], groups[name][1])
        return result

    def _group_of_each(self, raw: Any) -> list[str]:
        values = raw.tolist() if isinstance(raw, torch.Tensor) else list(raw)
        names = []
        for v in values:
            if isinstance(v, str):
                names.append(v)
            elif self.group_names is None:
                names.append(str(int(v)))
            elif 0 <= int(v) < len(self.group_names):
                names.append(self.group_names[int(v)])
            else:
                raise UserError(f"metric 'accuracy': {self.group_key}={v} is outside group_names "
                                f"{self.group_names}; list a name for every group index.")
        return names


@register_metric("vqa_accuracy")
class VQAAccuracy(Metric):
    """VQA accuracy: the soft score (min(#humans who gave it / 3, 1)) of the argmax answer.

    State: that one score per sample (their mean in dataset order is the result)."""

    name = "vqa_accuracy"

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        scores, targets = scores_of(output), torch.as_tensor(batch["targets"]).float().to(output["scores"].device)
        if targets.shape != scores.shape:
            raise UserError(f"metric 'vqa_accuracy' needs soft-score targets shaped like scores "
                            f"{tuple(scores.shape)}, got {tuple(targets.shape)}; use 'accuracy' for index targets.")
        self.add("picked", "cat", targets.gather(1, scores.argmax(-1, keepdim=True)).reshape(-1))

    def compute(self) -> dict[str, float]:
        self.require_samples()
        return {"vqa_accuracy": self.state("picked").cpu().reshape(-1, 1).mean().item()}


class _Confusion(Metric):
    """Counts of (prediction, label) pairs: enough for any per-class F1."""

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        pred = predictions_of(scores_of(output)).cpu()
        label = labels_of(batch["targets"]).cpu()
        pairs, counts = torch.unique(torch.stack([pred, label]), dim=1, return_counts=True)
        self.add("pairs", "counter",
                 {(int(p), int(t)): int(c) for (p, t), c in zip(pairs.t().tolist(), counts.tolist())})

    def class_counts(self, cls: int) -> tuple[int, int, int]:
        pairs = self.state("pairs", {})
        tp = pairs.get((cls, cls), 0)
        fp = sum(c for (p, t), c in pairs.items() if p == cls and t != cls)
        fn = sum(c for (p, t), c in pairs.items() if t == cls and p != cls)
        return tp, fp, fn


@register_metric("binary_f1")
class BinaryF1(_Confusion):
    """F1 of the positive class (``pos_label``, default 1); 0 when undefined. State: counts."""

    name = "binary_f1"

    def __init__(self, pos_label: int = 1):
        self.pos_label = int(pos_label)

    def compute(self) -> dict[str, float]:
        self.require_samples()
        return {"binary_f1": f1(*self.class_counts(self.pos_label))}


@register_metric("macro_f1")
class MacroF1(_Confusion):
    """Unweighted mean of per-class F1 over the classes seen in targets or predictions (as sklearn)."""

    name = "macro_f1"

    def compute(self) -> dict[str, float]:
        self.require_samples()
        classes = sorted({c for pair in self.state("pairs", {}) for c in pair})
        return {"macro_f1": sum(f1(*self.class_counts(c)) for c in classes) / len(classes)}


def binary_roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve as the Mann-Whitney U statistic.

    Equals P(score of a random positive > score of a random negative), ties
    counting 1/2, computed from average ranks in O(N log N). NaN when only one
    class is present.
    """
    scores, labels = scores.double().reshape(-1), labels.reshape(-1).bool()
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()
    average_rank = last - (counts.double() - 1) / 2  # ranks are 1-based; ties share the mean rank
    rank_sum = average_rank[inverse][labels].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


@register_metric("roc_auc")
class ROCAUC(Metric):
    """Binary ROC-AUC from the positive-class score ([N, 2] softmax or one logit); ties count 1/2.

    State: one positive-class score and one label per sample."""

    name = "roc_auc"

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        scores = scores_of(output)
        if scores.dim() == 2 and scores.size(1) == 2:
            positive = scores.softmax(-1)[:, 1]
        elif scores.dim() == 1 or scores.size(1) == 1:
            positive = scores.reshape(-1)
        else:
            raise UserError(f"metric 'roc_auc' is binary: scores must be [N, 2] or [N], got "
                            f"{tuple(scores.shape)}; use 'macro_f1' or 'accuracy' for multi-class.")
        labels = labels_of(batch["targets"])
        if not bool(((labels == 0) | (labels == 1)).all()):
            raise UserError(f"metric 'roc_auc' needs 0/1 targets, got labels {torch.unique(labels).tolist()[:10]}.")
        self.add("positive", "cat", positive)
        self.add("labels", "cat", labels.to(torch.int8))

    def compute(self) -> dict[str, float]:
        self.require_samples()
        auc = binary_roc_auc(self.state("positive").cpu(), self.state("labels").cpu())
        if auc != auc:
            log.warning("roc_auc is undefined (NaN): the evaluation set has only one class.")
        return {"roc_auc": auc}
