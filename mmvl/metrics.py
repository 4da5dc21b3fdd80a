"""Registered evaluation metrics, computed once over a whole evaluation set.

Metrics such as ROC-AUC, F1 and retrieval recall are not averages of per-batch
values, so the trainer keeps the tensors each metric needs
(``Metric.required_keys`` from the batch, ``Metric.output_keys`` from the model
output), joins them with :func:`concat_for_metrics`, gathers them across ranks
and calls every metric once: ``metric(batch, output) -> {name: float}``.
``update``/``compute``/``reset`` wrap the same thing for streaming use.

``scores`` are the model's raw logits: [N, C] for C classes, or [N] / [N, 1]
for a single binary logit (positive when > 0). ``targets`` are class indices
[N] or soft / multi-hot rows [N, C] (their argmax is the label).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.config.access import plain
from mmvl.config.components import build_component
from mmvl.errors import UserError
from mmvl.registry import METRICS, register_metric

log = logging.getLogger(__name__)


class Metric:
    """Base class; subclasses implement :meth:`compute_metric`."""

    name = "metric"
    #: batch keys the metric reads (besides the output keys)
    required_keys: tuple[str, ...] = ("targets",)
    #: model output keys the metric reads
    output_keys: tuple[str, ...] = ("scores",)

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        for key in self.required_keys:
            if key not in batch:
                raise UserError(f"metric {self.name!r} needs batch[{key!r}] but the evaluation batch has keys "
                                f"{sorted(batch)}; make the dataset yield {key!r} or drop the metric.")
        for key in self.output_keys:
            if key not in output:
                raise UserError(f"metric {self.name!r} needs output[{key!r}] but the model returned keys "
                                f"{sorted(output)}.")
        n = len(output["scores"])
        if n == 0:
            raise UserError(f"metric {self.name!r} got 0 samples; is the evaluation split empty?")
        for key in self.required_keys:
            if len(batch[key]) != n:
                raise UserError(f"metric {self.name!r}: batch[{key!r}] has {len(batch[key])} entries but "
                                f"output['scores'] has {n}; the dataset and model disagree on sample count.")
        return self.compute_metric(batch, output)

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        raise NotImplementedError  # pragma: no cover

    # streaming use (registry contract): keep what is needed, compute at the end
    def reset(self) -> None:
        self._parts: list[tuple[dict, dict]] = []

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        if not hasattr(self, "_parts"):
            self.reset()
        keep = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
        self._parts.append(({k: keep(batch[k]) for k in self.required_keys if k in batch},
                            {k: keep(output[k]) for k in self.output_keys if k in output}))

    def compute(self) -> dict[str, float]:
        parts = getattr(self, "_parts", [])
        if not parts:
            raise UserError(f"metric {self.name!r}: compute() called before any update().")
        return self(concat_for_metrics([b for b, _ in parts]), concat_for_metrics([o for _, o in parts]))


def concat_for_metrics(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Join per-batch dicts: tensors are concatenated on dim 0, lists extended."""
    if not batches:
        return {}
    out: dict[str, Any] = {}
    for key in batches[0]:
        values = []
        for i, b in enumerate(batches):
            if key not in b:
                raise UserError(f"concat_for_metrics: batch {i} lacks key {key!r} that batch 0 has.")
            values.append(b[key])
        if all(isinstance(v, torch.Tensor) for v in values):
            values = [v.reshape(1) if v.dim() == 0 else v for v in values]
            try:
                out[key] = torch.cat([v.to(values[0].device) for v in values], dim=0)
            except RuntimeError as e:
                raise UserError(f"concat_for_metrics: cannot join {key!r} across batches "
                                f"(shapes {[tuple(v.shape) for v in values[:3]]}...): {e}") from None
        else:
            joined: list[Any] = []
            for v in values:
                joined.extend(v.tolist() if isinstance(v, torch.Tensor) else
                              v if isinstance(v, (list, tuple)) else [v])
            out[key] = joined
    return out


def _scores(output: Mapping[str, Any]) -> torch.Tensor:
    return output["scores"].detach().float().cpu()


def _labels(targets: Any) -> torch.Tensor:
    """Class indices from index targets or soft / multi-hot rows."""
    t = torch.as_tensor(targets).detach().cpu()
    return t.argmax(-1) if t.dim() == 2 else t.reshape(-1).long()


def _predictions(scores: torch.Tensor) -> torch.Tensor:
    """argmax over classes; a single binary logit predicts 1 when > 0."""
    if scores.dim() == 1 or scores.size(-1) == 1:
        return (scores.reshape(-1) > 0).long()
    return scores.argmax(-1)


def _f1(pred: torch.Tensor, label: torch.Tensor, cls: int) -> float:
    tp = ((pred == cls) & (label == cls)).sum().item()
    fp = ((pred == cls) & (label != cls)).sum().item()
    fn = ((pred != cls) & (label == cls)).sum().item()
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


@register_metric("accuracy")
class Accuracy(Metric):
    """Fraction of samples whose argmax score is the target class.

    With ``group_key`` the batch carries a group per sample (int index into
    ``group_names``, or the group's name as a string) and ``accuracy/<group>``
    is reported for every group that has samples.
    """

    name = "accuracy"

    def __init__(self, group_key: str | None = None, group_names: Sequence[str] | None = None):
        self.group_key = group_key
        self.group_names = [str(g) for g in group_names] if group_names is not None else None
        self.required_keys = ("targets",) + ((group_key,) if group_key else ())

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        correct = (_predictions(_scores(output)) == _labels(batch["targets"])).float()
        result = {"accuracy": correct.mean().item()}
        if self.group_key:
            groups = self._group_of_each(batch[self.group_key])
            order = self.group_names if self.group_names is not None else sorted(set(groups))
            for name in order:
                mask = torch.tensor([g == name for g in groups])
                if mask.any():
                    result[f"accuracy/{name}"] = correct[mask].mean().item()
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
    """VQA accuracy: the soft score (min(#humans who gave it / 3, 1)) of the argmax answer."""

    name = "vqa_accuracy"

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        scores, targets = _scores(output), torch.as_tensor(batch["targets"]).float().cpu()
        if targets.shape != scores.shape:
            raise UserError(f"metric 'vqa_accuracy' needs soft-score targets shaped like scores "
                            f"{tuple(scores.shape)}, got {tuple(targets.shape)}; use 'accuracy' for index targets.")
        picked = targets.gather(1, scores.argmax(-1, keepdim=True))
        return {"vqa_accuracy": picked.mean().item()}


@register_metric("binary_f1")
class BinaryF1(Metric):
    """F1 of the positive class (``pos_label``, default 1); 0 when undefined."""

    name = "binary_f1"

    def __init__(self, pos_label: int = 1):
        self.pos_label = int(pos_label)

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        return {"binary_f1": _f1(_predictions(_scores(output)), _labels(batch["targets"]), self.pos_label)}


@register_metric("macro_f1")
class MacroF1(Metric):
    """Unweighted mean of per-class F1 over the classes seen in targets or predictions (as sklearn)."""

    name = "macro_f1"

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        pred, label = _predictions(_scores(output)), _labels(batch["targets"])
        classes = torch.unique(torch.cat([pred, label])).tolist()
        return {"macro_f1": sum(_f1(pred, label, c) for c in classes) / len(classes)}


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
    """Binary ROC-AUC from the positive-class score ([N, 2] softmax or one logit); ties count 1/2."""

    name = "roc_auc"

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        scores = _scores(output)
        if scores.dim() == 2 and scores.size(1) == 2:
            positive = scores.softmax(-1)[:, 1]
        elif scores.dim() == 1 or scores.size(1) == 1:
            positive = scores.reshape(-1)
        else:
            raise UserError(f"metric 'roc_auc' is binary: scores must be [N, 2] or [N], got "
                            f"{tuple(scores.shape)}; use 'macro_f1' or 'accuracy' for multi-class.")
        labels = _labels(batch["targets"])
        if not bool(((labels == 0) | (labels == 1)).all()):
            raise UserError(f"metric 'roc_auc' needs 0/1 targets, got labels {torch.unique(labels).tolist()[:10]}.")
        auc = binary_roc_auc(positive, labels)
        if auc != auc:
            log.warning("roc_auc is undefined (NaN): the evaluation set has only one class.")
        return {"roc_auc": auc}


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
    """

    name = "recall@k"

    def __init__(self, k: Sequence[int] | int = (1, 5, 10), i2t: bool = False):
        self.ks = [int(x) for x in ([k] if isinstance(k, int) else k)]
        if not self.ks or min(self.ks) < 1:
            raise UserError(f"metric 'recall@k': k must be positive integers, got {k!r}.")
        self.i2t = bool(i2t)

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        scores = _scores(output)
        targets = torch.as_tensor(batch["targets"]).reshape(-1).long().cpu()
        if scores.dim() != 2 or targets.numel() and not (0 <= targets.min() and targets.max() < scores.size(1)):
            raise UserError(f"metric 'recall@k' needs scores [N_text, N_image] and targets indexing image "
                            f"columns; got scores {tuple(scores.shape)}, targets in "
                            f"[{int(targets.min())}, {int(targets.max())}].")
        rows = torch.arange(len(targets))
        match = scores[rows, targets]
        # rank = how many other images score at least as high as the matching one
        t2i_rank = (scores >= match[:, None]).sum(1) - 1
        result = {f"recall@{k}": (t2i_rank < k).float().mean().item() for k in self.ks}
        if self.i2t:
            cols = scores.t()  # [N_image, N_text]
            ranks_all = (cols[targets, :] >= match[:, None]).sum(1) - 1  # rank of each caption for its image
            best = torch.full((scores.size(1),), torch.iinfo(torch.long).max, dtype=torch.long)
            best.scatter_reduce_(0, targets, ranks_all, reduce="amin")
            best = best[torch.unique(targets)]
            result.update({f"recall@{k}/i2t": (best < k).float().mean().item() for k in self.ks})
        return result


def build_metrics(configs: Sequence[Any] | None) -> list[Metric]:
    """``[{type, params}, ...]`` (or plain names) -> metric instances."""
    return [build_component(METRICS, entry, where=f"metrics[{i}]") for i, entry in enumerate(plain(configs) or [])]
