"""Streaming evaluation: every split in bounded memory, each sample counted once, with progress.

For each batch the model's scores are folded into the metrics (:mod:`mmvl.metrics`:
counts, one value per sample, or fixed-size summaries), into sample-weighted sums of the
losses and, when predictions are asked for, into rows appended to the predictions file.
Nothing of size samples x classes outlives its batch.

Distributed: rank ``r`` evaluates the dataset positions ``r, r + W, ...`` (the sampler
pads the last round with duplicates). Each rank knows the position of every sample it
sees, so it drops the duplicates itself before anything is counted; at the end metrics
``sync()`` their states (sums all-reduced, per-sample values gathered in dataset order) and
the loss sums are all-reduced, so every sample counts exactly once and the result equals
a single-process run. Prediction rows travel to rank 0 batch by batch and are written in
dataset order.

Rank 0 shows a progress bar on a terminal (``training.progress_bar``) and logs the
throughput; without a terminal it logs progress every :data:`LOG_EVERY_S` seconds.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, Mapping

import torch

from mmvl.data.loaders import eval_loader, resolve_pin_memory
from mmvl.data.predictions import PredictionWriter
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.losses import compute_losses
from mmvl.metrics import Metric
from mmvl.runs import resolve_metric
from mmvl.trainers.state import Best, TrainerState

log = logging.getLogger("mmvl")
LOG_EVERY_S = 60.0


def prepare_split(builders: Mapping[str, Any], split: str, is_main: bool) -> None:
    """``builder.prepare_split(split)`` on rank 0 (``is_main``) first, which builds the caches, while
    the others wait."""
    for builder in builders.values():
        prepare = getattr(builder, "prepare_split", None)  # builders not derived from DatasetBuilder lack it
        if prepare is None:
            continue
        Engine.on_main_agreed(lambda: prepare(split), f"prepare the {split} split")
        if not is_main:
            prepare(split)


@torch.no_grad()
def evaluate(trainer: Any, split: str) -> dict[str, dict[str, float]]:
    """Metrics (and losses) over the whole ``split`` of each of the trainer's datasets."""
    prepare_split(trainer.builders, split, trainer.engine.is_main_process)
    trainer.model.eval()
    try:
        with contextlib.ExitStack() as weights:  # e.g. the EMA weights in place of the live ones
            for callback in getattr(trainer, "callbacks", ()):
                weights.enter_context(callback.evaluating(split))
            return {name: _evaluate_dataset(trainer, name, builder, split) for name, builder in trainer.builders.items()}
    finally:
        trainer.model.train()


def _evaluate_dataset(trainer: Any, name: str, builder: Any, split: str) -> dict[str, float]:
    env, engine, config = trainer.env, trainer.engine, trainer.config
    dataset = builder.build(split)
    total = len(dataset)
    if total == 0:
        raise UserError(f"{name}: the {split} split has no samples; check its files or choose another run_type.")
    loader = eval_loader(dataset, batch_size=trainer.batch_size, collate_fn=builder.collate, rank=env.rank,
                         world_size=env.world_size, num_workers=int(config.training.num_workers),
                         pin_memory=resolve_pin_memory(config.training.pin_memory, env.device))
    metrics = [as_metric(m) for m in trainer.metrics[name]]
    for m in metrics:
        m.reset()
    encoders = _bind_two_tower(trainer, builder, metrics)
    decoding = _Decoding(trainer, builder, total, metrics)
    active: list[Metric] | None = None  # decided on the first batch: an unlabelled split has no targets
    losses = _LossSums(engine)
    writer = None
    if config.evaluation.get("predict"):
        writer = PredictionWriter(str(config.env.save_dir), name, split, builder.prediction_format) \
            if env.is_main_process else _NoWriter()
    progress = _Progress(f"{split} {name}", total, len(loader), env.is_main_process,
                         bool(config.training.get("progress_bar", True)))
    seen = 0  # samples this rank was handed, padding included
    try:
        for batch in loader:
            size = _batch_size(batch)
            valid = max(0, min(size, _owned(seen + size, total, env) - _owned(seen, total, env)))
            scored = decoding.rows(seen, size, valid, env)  # of them, the rows the generation metrics score
            seen += size
            batch = engine.to_device(batch)
            if active is None:
                active = [m for m in metrics if all(k in batch for k in m.required_keys)]
            forward = writer is not None or not active or any(m not in encoders for m in active)
            with engine.autocast():  # a split scored only through the model's encoders skips the forward
                output = trainer.model(batch) if forward else {"scores": torch.empty(size, 0)}
            scores = output["scores"].float()
            batch, scores = _rows(batch, valid, size), scores[:valid]
            out = {"scores": scores}
            for m in active if valid else []:
                if m.generates:
                    continue
                with engine.autocast() if m in encoders else contextlib.nullcontext():
                    m.update(batch, out)
            if forward:
                losses.add(output.get("losses") or {}, trainer.losses if "targets" in batch else [], batch, out, valid)
            written = writer is not None and decoding.generate is not None
            generated = decoding.run(batch, valid if written else scored)  # a generative model's new token ids
            if scored:
                texts = builder.generated_text(generated[:scored])
                for m in (m for m in active or [] if m.generates):
                    m.update(_rows(batch, scored, valid), {"generated": texts})
            if writer is not None:
                if written and valid:  # rows of decoded text, not scores
                    scores = generated
                rows = builder.predictions(batch, scores) if valid else []
                writer.write(_in_dataset_order(engine.gather_object(rows)))
            progress.update(valid * env.world_size if env.world_size > 1 else valid)
    except BaseException:
        if writer is not None:
            writer.abort()
        progress.close()
        raise
    progress.close()
    values = losses.reduce()  # every rank joins these collectives, labelled split or not
    for m in metrics:
        if m in (active or []):
            m.sync()
    for m in active or []:
        values.update({k: float(v) for k, v in m.compute().items()})
    values.update(builder.extra_metrics(split))
    decoding.log_cap(f"{split} {name}", active or [], env.is_main_process)
    if writer is not None:
        path = writer.close()
        if env.is_main_process:
            log.info("Wrote %s predictions to %s", split, path)
    progress.log_done()
    return values


class _Decoding:
    """A generative model's decoding during evaluation: with the model's ``generate`` (the KV cache,
    its ``generation`` settings, under autocast), for the rows the generation metrics score (the
    split's first ``evaluation.generate_max_samples`` in dataset order, the same at any world size, in
    the evaluations during training; every row in the others and with the cap null) or, when
    predictions are written, for every row (the file holds the whole split)."""

    def __init__(self, trainer: Any, builder: Any, total: int, metrics: list[Metric]):
        self.engine = trainer.engine
        self.generate = getattr(trainer.engine.unwrap_model(trainer.model), "generate", None)
        self.scoring = any(m.generates for m in metrics)
        cap = trainer.config.evaluation.get("generate_max_samples") if trainer.state.fitting else None
        self.total, self.limit = total, total if cap is None else min(int(cap), total)

    def rows(self, seen: int, size: int, valid: int, env: Any) -> int:
        """How many of a batch's first rows the generation metrics score: this rank's samples
        ``seen .. seen + size`` that sit in the split's first ``limit`` (a prefix of the batch)."""
        if not self.scoring:
            return 0
        return max(0, min(valid, _owned(seen + size, self.limit, env) - _owned(seen, self.limit, env)))

    def run(self, batch: Mapping[str, Any], n: int) -> torch.Tensor | None:
        """New token ids (``n x max_new_tokens``) of the batch's first ``n`` rows; None for none."""
        if not n or self.generate is None:
            return None
        with self.engine.autocast():
            return self.generate(_rows(batch, n, _batch_size(batch)))

    def log_cap(self, what: str, active: list[Metric], main: bool) -> None:
        if main and self.limit < self.total and any(m.generates for m in active):
            log.info("%s: the generation metrics scored the first %d of %d samples (evaluation.generate_max_samples, "
                     "during training)",
                     what, self.limit, self.total)


def _bind_two_tower(trainer: Any, builder: Any, metrics: list[Metric]) -> set[Metric]:
    """Bind the metrics that encode with the model themselves (``uses_model``: zero-shot, retrieval) to
    the unwrapped model; they are scored through its encoders, not its forward."""
    encoders = {m for m in metrics if getattr(m, "uses_model", False)}
    if encoders and trainer.engine.strategy.shards_parameters:
        raise UserError(f"metrics {sorted(m.name for m in encoders)} call the model's encoders, which FSDP's sharded "
                        "parameters do not allow; evaluate under distributed.strategy=ddp (or single).")
    if encoders:
        model = trainer.engine.unwrap_model(trainer.model)
        for m in encoders:
            with trainer.engine.autocast():
                m.bind(model, lambda: builder.text_processor)
    return encoders


class BestTracker:
    """Keeps ``state.best``: the best validation value of ``training.early_stop.criteria``
    (``<dataset>/<metric>``; null: the first dataset's first metric that is not a loss).

    The Trainer calls :meth:`update` after every evaluation and before dispatching
    ``on_evaluation_end``; lower is better for losses unless ``minimize`` says otherwise. Every
    rank holds the same gathered results, so every rank keeps the same best.
    """

    def __init__(self, criteria: str | None, minimize: bool | None, loss_names: set[str]):
        self.criteria, self.minimize = criteria, minimize
        self.loss_names = set(loss_names)  # never the default criterion

    def saw_losses(self, names: Any) -> None:
        """Add the names of the losses a model returns itself (from an update's ``info["losses"]``)."""
        self.loss_names.update(names)

    def update(self, state: TrainerState, split: str, results: dict[str, dict[str, float]]) -> None:
        if split != "val":
            return
        dataset, metric = resolve_metric(self.criteria, results, "training.early_stop.criteria", self.loss_names)
        value = float(results[dataset][metric])
        minimize = self.minimize if self.minimize is not None else metric.endswith("loss")
        best = state.best.value
        if best is None or (value < best if minimize else value > best):
            state.best = Best(value, state.update)


def as_metric(metric: Any) -> Metric:
    """A :class:`Metric`, or a whole-set callable (``metric(data, output)`` with ``required_keys``) wrapped
    so it still runs (it sees the whole split at once, kept in memory)."""
    if isinstance(metric, Metric):
        return metric
    if callable(metric) and hasattr(metric, "required_keys"):
        return _WholeSet(metric)
    raise UserError(f"metric {metric!r} is neither an mmvl.metrics.Metric nor a callable with required_keys; "
                    "subclass Metric and implement update()/compute() (see mmvl/registry.py).")


class _WholeSet(Metric):
    def __init__(self, fn: Any):
        self.fn, self.name = fn, getattr(fn, "name", type(fn).__name__)
        self.required_keys = tuple(fn.required_keys)
        self.output_keys = tuple(getattr(fn, "output_keys", ("scores",)))

    def compute_metric(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, float]:
        return self.fn(batch, output)


def _owned(count: int, total: int, env: Any) -> int:
    """How many of this rank's first ``count`` samples are real (the rest pad the last round)."""
    if env.world_size == 1:
        return min(count, total)
    # this rank's k-th sample is dataset position k * W + r: real while < total
    real = max(0, -(-(total - env.rank) // env.world_size))
    return min(count, real)


def _batch_size(batch: Mapping[str, Any]) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
        if isinstance(v, (list, tuple)):
            return len(v)
    raise UserError(f"evaluation: cannot tell the batch size of a batch with keys {sorted(batch)}.")


def _rows(batch: Mapping[str, Any], n: int, size: int) -> dict[str, Any]:
    """The first ``n`` samples of every per-sample entry (the rest are the sampler's padding)."""
    if n == size:
        return dict(batch)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size:
            v = v[:n]
        elif isinstance(v, (list, tuple)) and len(v) == size:
            v = v[:n]
        out[k] = v
    return out


def _in_dataset_order(parts: list[list[Any]]) -> list[Any]:
    """Rank r's j-th row of a batch round is dataset position (round start + j) * W + r."""
    longest = max((len(p) for p in parts), default=0)
    return [p[j] for j in range(longest) for p in parts if j < len(p)]


class _LossSums:
    """Sample-weighted sums of each batch's losses (the model's own and the configured ones).

    Their means equal the whole-split losses for per-sample means (every loss mmvl ships);
    a loss averaged over tokens is weighted by the samples of its batch.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, model_losses: Mapping[str, Any], configured: Any, batch: Mapping[str, Any],
            output: Mapping[str, Any], n: int) -> None:
        if n == 0:
            return
        values = {k: torch.as_tensor(v).detach().float().reshape(()) for k, v in model_losses.items()}
        if configured:
            values.update({k: v.detach().float() for k, v in compute_losses(configured, batch, output).items()})
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * n
            self.counts[k] = self.counts.get(k, 0) + n

    def reduce(self) -> dict[str, float]:
        """Means over every rank's samples; ``total_loss`` is their sum (empty for unlabelled splits)."""
        parts = self.engine.gather_object({k: (float(v), self.counts[k]) for k, v in self.sums.items()})
        names = sorted({k for p in parts for k in p})
        means = {}
        for k in names:
            total = sum(p[k][1] for p in parts if k in p)
            means[k] = sum(p[k][0] for p in parts if k in p) / total if total else float("nan")
        if means:
            means["total_loss"] = sum(means.values())
        return means


class _NoWriter:
    """Ranks other than 0 send their rows (all_gather_object) but write nothing."""

    def write(self, rows: Any) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class _Progress:
    """A tqdm bar on a terminal (rank 0), else a log line every :data:`LOG_EVERY_S`; then the throughput."""

    def __init__(self, what: str, total: int, batches: int, main: bool, enabled: bool):
        self.what, self.total, self.main, self.done = what, total, main, 0
        self.start = self.last_log = time.perf_counter()
        self.bar = None
        if main and enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"eval {what}", unit="sample", dynamic_ncols=True, leave=True,
                            file=sys.stderr)

    def update(self, n: int) -> None:
        n = min(n, self.total - self.done)
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.main and time.perf_counter() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.perf_counter()
            log.info("%s: %d/%d samples (%.0f%%), %.0f samples/s", self.what, self.done, self.total,
                     100 * self.done / max(self.total, 1), self.done / max(self.last_log - self.start, 1e-9))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log_done(self) -> None:
        if self.main:
            elapsed = time.perf_counter() - self.start
            log.info("%s: evaluated %d samples in %.1f s (%.0f samples/s)", self.what, self.total, elapsed,
                     self.total / max(elapsed, 1e-9))
