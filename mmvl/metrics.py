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
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.config.access import plain
from mmvl.config.components import build_component
from mmvl.distributed import comm
from mmvl.errors import UserError
from mmvl.registry import METRICS, register_metric

log = logging.getLogger(__name__)
KINDS = ("sum", "max", "topk", "cat", "counter")


class Metric:
    """Base class: streaming state (``add``), cross-rank ``sync`` and whole-set ``__call__``."""

    name = "metric"
    #: batch keys the metric reads (besides the output keys)
    required_keys: tuple[str, ...] = ("targets",)
    #: model output keys the metric reads
    output_keys: tuple[str, ...] = ("scores",)

    # -- whole set ------------------------------------------------------------------------------
    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        """The metric over one whole set in this process: ``reset``, ``update``, ``compute``."""
        self.reset()
        self.update(batch, output)
        return self.compute()

    # -- streaming ------------------------------------------------------------------------------
    def reset(self) -> None:
        self._state: dict[str, tuple[str, Any, Any]] = {}  # name -> (kind, value, option)
        self.samples = 0

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        """Default (earlier contract): keep this batch's inputs for ``compute_metric``."""
        self.check(batch, output)
        for key in self.required_keys:
            self.add(f"batch.{key}", "cat", _detach(batch[key]))
        for key in self.output_keys:
            self.add(f"output.{key}", "cat", _detach(output[key]))

    def compute(self) -> dict[str, float]:
        """Default (earlier contract): ``compute_metric`` over everything ``update`` kept."""
        self.require_samples()
        batch = {k: self.state(f"batch.{k}") for k in self.required_keys}
        output = {k: self.state(f"output.{k}") for k in self.output_keys}
        if type(self).compute_metric is Metric.compute_metric and type(self).__call__ is not Metric.__call__:
            return self(batch, output)  # a subclass that overrides __call__ over the whole set
        return self.compute_metric(batch, output)

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        raise UserError(f"metric {self.name!r} ({type(self).__qualname__}) implements neither update()/compute() "
                        "nor compute_metric(batch, output); see the METRICS contract in mmvl/registry.py.")

    def check(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> int:
        """Raise a UserError unless the inputs the metric reads are there and agree; the sample count."""
        if not hasattr(self, "_state"):
            self.reset()
        for key in self.required_keys:
            if key not in batch:
                raise UserError(f"metric {self.name!r} needs batch[{key!r}] but the evaluation batch has keys "
                                f"{sorted(batch)}; make the dataset yield {key!r} or drop the metric.")
        for key in self.output_keys:
            if key not in output:
                raise UserError(f"metric {self.name!r} needs output[{key!r}] but the model returned keys "
                                f"{sorted(output)}.")
        n = len(output["scores"]) if "scores" in output else len(batch[self.required_keys[0]])
        for key in self.required_keys:
            if len(batch[key]) != n:
                raise UserError(f"metric {self.name!r}: batch[{key!r}] has {len(batch[key])} entries but "
                                f"output['scores'] has {n}; the dataset and model disagree on sample count.")
        self.samples += n
        return n

    def require_samples(self) -> None:
        if not getattr(self, "samples", 0):
            raise UserError(f"metric {self.name!r} got 0 samples; is the evaluation split empty?")

    # -- state ----------------------------------------------------------------------------------
    def add(self, name: str, kind: str, value: Any, option: Any = None) -> None:
        """Fold ``value`` into state ``name``: ``sum``/``max`` elementwise (the same shape on every rank),
        ``topk`` (keep the ``option`` largest along dim 0), ``cat`` (append; joined along dim 0 or as one
        list), ``counter`` (a dict: add the counts of equal keys)."""
        if not hasattr(self, "_state"):
            self.reset()
        old = self._state.get(name)
        if old is None:
            new = [value] if kind == "cat" else dict(value) if kind == "counter" else value
            if kind == "topk":
                new = _topk(value, option)
            self._state[name] = (kind, new, option)
            return
        current = old[1]
        if kind == "sum":
            current = current + value
        elif kind == "max":
            current = torch.maximum(current, value)
        elif kind == "topk":
            current = _topk(torch.cat([current, value]), option)
        elif kind == "cat":
            current.append(value)
        elif kind == "counter":
            for k, v in value.items():
                current[k] = current.get(k, 0) + v
        else:
            raise ValueError(f"unknown state kind {kind!r}; use one of {KINDS}")
        self._state[name] = (kind, current, option)

    def state(self, name: str, default: Any = None) -> Any:
        """The state's value (``cat``: joined); ``default`` when nothing was added."""
        entry = getattr(self, "_state", {}).get(name)
        if entry is None:
            return default
        kind, value, _ = entry
        return _join(value) if kind == "cat" else value

    def sync(self) -> None:
        """Combine every rank's state (a collective: every rank calls it, in the same metric order)."""
        if comm.get_world_size() == 1:
            return
        if not hasattr(self, "_state"):
            self.reset()
        local = {name: _describe(kind, value, option) for name, (kind, value, option) in self._state.items()}
        described = comm.all_gather_object((local, self.samples))
        self.samples = sum(n for _, n in described)
        merged: dict[str, Any] = {}
        for states, _ in described:
            for name, desc in states.items():
                merged.setdefault(name, desc)
        for name in sorted(merged):
            kind, spec, option = merged[name]
            entry = self._state.get(name)
            value = entry[1] if entry is not None else None
            if kind == "cat":
                value = _join(value) if value is not None else _empty_like_spec(spec)
                result = comm.gather_for_metrics(value, None)
                self._state[name] = (kind, [result], option)
                continue
            if kind == "counter":
                total: dict[Any, Any] = {}
                for counts in comm.all_gather_object(value or {}):
                    for k, v in counts.items():
                        total[k] = total.get(k, 0) + v
                self._state[name] = (kind, total, option)
                continue
            value = value if value is not None else _filled(kind, spec)
            if kind == "topk":
                value = _topk(torch.cat(comm.all_gather(value)), option)
            else:
                value = comm.all_reduce(value, "max" if kind == "max" else "sum")
            self._state[name] = (kind, value, option)


def _detach(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else list(value)


def _join(parts: list[Any]) -> Any:
    if all(isinstance(p, torch.Tensor) for p in parts):
        parts = [p.reshape(1) if p.dim() == 0 else p for p in parts]
        return torch.cat([p.to(parts[0].device) for p in parts]) if len(parts) > 1 else parts[0]
    joined: list[Any] = []
    for p in parts:
        joined.extend(p.tolist() if isinstance(p, torch.Tensor) else p)
    return joined


def _topk(t: torch.Tensor, k: int) -> torch.Tensor:
    return t.topk(min(k, t.shape[0]), dim=0).values if t.shape[0] > k else t


def _describe(kind: str, value: Any, option: Any) -> tuple[str, Any, Any]:
    if kind == "cat":
        joined = _join(value)
        if isinstance(joined, torch.Tensor):
            return kind, ("tensor", tuple(joined.shape[1:]), joined.dtype), option
        return kind, ("list",), option
    if kind == "counter":
        return kind, None, option
    return kind, (tuple(value.shape), value.dtype), option


def _empty_like_spec(spec: Any) -> Any:
    if spec[0] == "list":
        return []
    return torch.empty((0, *spec[1]), dtype=spec[2])


def _filled(kind: str, spec: Any) -> torch.Tensor:
    shape, dtype = spec
    if kind == "sum":
        return torch.zeros(shape, dtype=dtype)
    low = -float("inf") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, low, dtype=dtype)


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
    return output["scores"].detach().float()


def _labels(targets: Any) -> torch.Tensor:
    """Class indices from index targets or soft / multi-hot rows."""
    t = torch.as_tensor(targets).detach()
    return t.argmax(-1) if t.dim() == 2 else t.reshape(-1).long()


def _predictions(scores: torch.Tensor) -> torch.Tensor:
    """argmax over classes; a single binary logit predicts 1 when > 0."""
    if scores.dim() == 1 or scores.size(-1) == 1:
        return (scores.reshape(-1) > 0).long()
    return scores.argmax(-1)


def _rate(count: Any, total: Any) -> float:
    """``count / total`` in float32, as ``tensor.float().mean()`` of 0/1 values computes it."""
    as_f32 = lambda v: torch.as_tensor(v, dtype=torch.float32).cpu()  # noqa: E731
    return (as_f32(count) / as_f32(total)).item()


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


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
        correct = _predictions(_scores(output)) == _labels(batch["targets"]).to(output["scores"].device)
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
        result = {"accuracy": _rate(counts[0], counts[1])}
        if self.group_key:
            groups = self.state("groups", {})
            order = self.group_names if self.group_names is not None else sorted(groups)
            for name in order:
                if name in groups and int(groups[name][1]):
                    result[f"accuracy/{name}"] = _rate(groups[name][0], groups[name][1])
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
        scores, targets = _scores(output), torch.as_tensor(batch["targets"]).float().to(output["scores"].device)
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
        pred = _predictions(_scores(output)).cpu()
        label = _labels(batch["targets"]).cpu()
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
        return {"binary_f1": _f1(*self.class_counts(self.pos_label))}


@register_metric("macro_f1")
class MacroF1(_Confusion):
    """Unweighted mean of per-class F1 over the classes seen in targets or predictions (as sklearn)."""

    name = "macro_f1"

    def compute(self) -> dict[str, float]:
        self.require_samples()
        classes = sorted({c for pair in self.state("pairs", {}) for c in pair})
        return {"macro_f1": sum(_f1(*self.class_counts(c)) for c in classes) / len(classes)}


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
        self.add("positive", "cat", positive)
        self.add("labels", "cat", labels.to(torch.int8))

    def compute(self) -> dict[str, float]:
        self.require_samples()
        auc = binary_roc_auc(self.state("positive").cpu(), self.state("labels").cpu())
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

    State, never the score matrix: per k, how many captions rank their image in
    the top k; for ``i2t``, per image, the best score of one of its own captions,
    whether it has one, and the ``max(k) + 1`` highest scores any caption gave
    it: an image's best caption ranks in the top k exactly when at most k of
    those are at least its best own score.
    """

    name = "recall@k"

    def __init__(self, k: Sequence[int] | int = (1, 5, 10), i2t: bool = False):
        self.ks = [int(x) for x in ([k] if isinstance(k, int) else k)]
        if not self.ks or min(self.ks) < 1:
            raise UserError(f"metric 'recall@k': k must be positive integers, got {k!r}.")
        self.i2t = bool(i2t)

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        scores = _scores(output)
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
        result = {f"recall@{k}": _rate(hits[i], self.samples) for i, k in enumerate(self.ks)}
        if self.i2t:
            best_own, top = self.state("best_own").cpu(), self.state("top").cpu()
            captioned = self.state("has_caption").cpu() > 0
            at_least = (top >= best_own[None, :]).sum(0)[captioned]  # = the rank + 1 when <= max(k)
            result.update({f"recall@{k}/i2t": _rate((at_least <= k).sum(), captioned.sum()) for k in self.ks})
        return result


def build_metrics(configs: Sequence[Any] | None) -> list[Metric]:
    """``[{type, params}, ...]`` (or plain names) -> metric instances."""
    return [build_component(METRICS, entry, where=f"metrics[{i}]") for i, entry in enumerate(plain(configs) or [])]
