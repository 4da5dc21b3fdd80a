"""The streaming machinery of metrics: declared states, their per-rank updates and cross-rank sync.

A metric never keeps a batch x classes matrix for the whole split. Each batch is reduced at once
to what the metric needs: counts, one value per sample or a fixed-size summary. States are
declared with :meth:`Metric.add`: ``sum``, ``max`` and ``topk`` tensors, ``cat`` (per-sample
tensors or lists) and ``counter`` (a dict of counts, e.g. per group); ``sync()`` combines them
over the ranks (sums all-reduced, per-sample values gathered in dataset order). The metric
families (:mod:`mmvl.metrics.classification`, :mod:`mmvl.metrics.retrieval`) build on this and
on the score/label helpers at the end of this module.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.distributed import comm
from mmvl.errors import UserError

log = logging.getLogger(__name__)
KINDS = ("sum", "max", "topk", "cat", "counter")


class Metric:
    """Base class: streaming state (``add``), cross-rank ``sync`` and whole-set ``__call__``."""

    name = "metric"
    #: batch keys the metric reads (besides the output keys)
    required_keys: tuple[str, ...] = ("targets",)
    #: model output keys the metric reads
    output_keys: tuple[str, ...] = ("scores",)

    #: True: the evaluation decodes the split with the model's ``generate`` and passes the text as
    #: ``output["generated"]`` (:mod:`mmvl.metrics.generation`)
    generates = False

    def result_names(self) -> tuple[str, ...] | None:
        """The names :meth:`compute` returns, where known before evaluating (``early_stop.criteria``
        is checked against them at start); None: known only once computed."""
        return None

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


def scores_of(output: Mapping[str, Any]) -> torch.Tensor:
    return output["scores"].detach().float()


def labels_of(targets: Any) -> torch.Tensor:
    """Class indices from index targets or soft / multi-hot rows."""
    t = torch.as_tensor(targets).detach()
    return t.argmax(-1) if t.dim() == 2 else t.reshape(-1).long()


def predictions_of(scores: torch.Tensor) -> torch.Tensor:
    """argmax over classes; a single binary logit predicts 1 when > 0."""
    if scores.dim() == 1 or scores.size(-1) == 1:
        return (scores.reshape(-1) > 0).long()
    return scores.argmax(-1)


def rate(count: Any, total: Any) -> float:
    """``count / total`` in float32, as ``tensor.float().mean()`` of 0/1 values computes it."""
    as_f32 = lambda v: torch.as_tensor(v, dtype=torch.float32).cpu()  # noqa: E731
    return (as_f32(count) / as_f32(total)).item()


def f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
