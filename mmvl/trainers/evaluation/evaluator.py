"""The run's one evaluator: every split in bounded memory, each sample counted once, with progress.

:class:`Evaluator` is built once (:func:`mmvl.trainers.parts.build_parts`) from the typed
``evaluation`` section and the run's datasets. At start it checks what its metrics need; then
:meth:`Evaluator.evaluate` is the one call that the evaluation callback (during training) and
:func:`mmvl.trainers.trainer.run` (the val and test stages) make, and :meth:`Evaluator.reuses`
says when a stage may take the last evaluation instead.

For each batch the model's scores are folded into the metrics (:mod:`mmvl.metrics`: counts, one
value per sample, or fixed-size summaries), into sample-weighted sums of the losses and, when
predictions are asked for, into rows appended to the predictions file. Nothing of size samples x
classes outlives its batch.

Distributed: each rank drops the sampler's padding itself (:mod:`.rows`); at the end metrics
``sync()`` their states (sums all-reduced, per-sample values gathered in dataset order) and the loss
sums are all-reduced, so every sample counts exactly once and the result equals a single-process
run. Prediction rows travel to rank 0 batch by batch and are written in dataset order.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ContextManager

import torch

from mmvl.config import schema
from mmvl.data.loaders import eval_loader, resolve_pin_memory
from mmvl.data.predictions import PredictionWriter
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.metrics import Metric
from mmvl.trainers.evaluation.decoding import Decoding
from mmvl.trainers.evaluation.progress import Progress
from mmvl.trainers.evaluation.rows import batch_size_of, first_rows, in_dataset_order, owned
from mmvl.trainers.evaluation.sums import LossSums, NoWriter
from mmvl.trainers.state import Evaluation

log = logging.getLogger("mmvl")


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


class Evaluator:
    """Scores the run's datasets: owns the metric checks made at start, the generation cap and
    decoding, the prediction writers and the row counts.

    ``section``: the typed ``evaluation`` section; ``training``: the typed ``training`` section (its
    loader settings, progress bar and early-stop criterion); ``save_dir``: where predictions go.
    """

    def __init__(self, section: schema.Evaluation, training: schema.Training, save_dir: str, *, engine: Engine,
                 model: torch.nn.Module, builders: Mapping[str, Any], metrics: Mapping[str, list[Any]],
                 losses: list[tuple[str, Any]], batch_size: int, model_name: str):
        self.section, self.training, self.save_dir = section, training, save_dir
        self.engine, self.model, self.builders = engine, model, builders
        self.metrics, self.losses, self.batch_size = metrics, losses, batch_size
        check_metrics(model_name, training.early_stop.criteria, engine.unwrap_model(model), builders, metrics, losses)

    def reuses(self, last: Evaluation | None, update: int, split: str) -> bool:
        """Whether a stage of ``split`` at ``update`` may take ``last`` instead of scoring again: the
        same split at the same update, and never a capped generation score (it is not the split's)."""
        fresh = last is not None and last.update == update and last.split == split
        return fresh and self.section.generate_max_samples is None

    @torch.no_grad()
    def evaluate(self, split: str, during_training: bool = False,
                 weights: Iterable[Callable[[str], ContextManager[Any]]] = ()) -> dict[str, dict[str, float]]:
        """Metrics (and losses) over the whole ``split`` of each dataset (every rank calls it).
        ``during_training``: a periodic evaluation, whose generation metrics score the split's first
        ``evaluation.generate_max_samples``; ``weights``: callbacks' ``evaluating(split)``, which may
        put other weights in place for it (the EMA's)."""
        prepare_split(self.builders, split, self.engine.is_main_process)
        self.model.eval()
        try:
            with contextlib.ExitStack() as stack:
                for swap in weights:
                    stack.enter_context(swap(split))
                return {name: self._dataset(name, builder, split, during_training)
                        for name, builder in self.builders.items()}
        finally:
            self.model.train()

    def _dataset(self, name: str, builder: Any, split: str, during_training: bool) -> dict[str, float]:
        env, engine = self.engine.env, self.engine
        dataset = builder.build(split)
        total = len(dataset)
        if total == 0:
            raise UserError(f"{name}: the {split} split has no samples; check its files or choose another run_type.")
        loader = eval_loader(dataset, batch_size=self.batch_size, collate_fn=builder.collate, rank=env.rank,
                             world_size=env.world_size, num_workers=int(self.training.num_workers),
                             pin_memory=resolve_pin_memory(self.training.pin_memory, env.device))
        metrics = [as_metric(m) for m in self.metrics[name]]
        for m in metrics:
            m.reset()
        encoders = self._bind_two_tower(builder, metrics)
        cap = self.section.generate_max_samples if during_training else None
        fold = _Fold(self, builder, metrics, encoders, Decoding(engine, self.model, total, metrics, cap),
                     self._writer(name, split, builder))
        progress = Progress(f"{split} {name}", total, len(loader), env.is_main_process, bool(self.training.progress_bar))
        seen = 0  # samples this rank was handed, padding included
        try:
            for batch in loader:
                size = batch_size_of(batch)
                valid = max(0, min(size, owned(seen + size, total, env) - owned(seen, total, env)))
                fold.batch(batch, seen, size, valid)
                seen += size
                progress.update(valid * env.world_size if env.world_size > 1 else valid)
        except BaseException:
            fold.abort()
            progress.close()
            raise
        progress.close()
        values = fold.result(split)
        fold.decoding.log_cap(f"{split} {name}", fold.active or [], env.is_main_process)
        fold.close(split)
        progress.log_done()
        return values

    def _writer(self, name: str, split: str, builder: Any) -> Any:
        """Rank 0's prediction file of ``name``'s ``split`` (the other ranks send rows), or None."""
        if not self.section.predict:
            return None
        if not self.engine.is_main_process:
            return NoWriter()
        return PredictionWriter(self.save_dir, name, split, builder.prediction_format)

    def _bind_two_tower(self, builder: Any, metrics: list[Metric]) -> set[Metric]:
        """Bind the metrics that encode with the model themselves (``uses_model``: zero-shot, retrieval)
        to the unwrapped model; they are scored through its encoders, not its forward."""
        encoders = {m for m in metrics if getattr(m, "uses_model", False)}
        if encoders and self.engine.strategy.shards_parameters:
            raise UserError(f"metrics {sorted(m.name for m in encoders)} call the model's encoders, which FSDP's "
                            "sharded parameters do not allow; evaluate under distributed.strategy=ddp (or single).")
        if encoders:
            model = self.engine.unwrap_model(self.model)
            for m in encoders:
                with self.engine.autocast():
                    m.bind(model, lambda: builder.text_processor)
        return encoders


class _Fold:
    """One dataset's evaluation, batch by batch: what each batch adds to the metrics, the loss sums,
    the decoded rows and the prediction file."""

    def __init__(self, evaluator: Evaluator, builder: Any, metrics: list[Metric], encoders: set[Metric],
                 decoding: Decoding, writer: Any):
        self.evaluator, self.engine, self.builder = evaluator, evaluator.engine, builder
        self.metrics, self.encoders, self.decoding, self.writer = metrics, encoders, decoding, writer
        self.active: list[Metric] | None = None  # decided on the first batch: an unlabelled split has no targets
        self.losses = LossSums(self.engine)

    def batch(self, batch: Any, seen: int, size: int, valid: int) -> None:
        engine, writer = self.engine, self.writer
        scored = self.decoding.rows(seen, size, valid, engine.env)  # of them, the rows the generation metrics score
        batch = engine.to_device(batch)
        if self.active is None:
            self.active = [m for m in self.metrics if all(k in batch for k in m.required_keys)]
        forward = writer is not None or not self.active or any(m not in self.encoders for m in self.active)
        with engine.autocast():  # a split scored only through the model's encoders skips the forward
            output = self.evaluator.model(batch) if forward else {"scores": torch.empty(size, 0)}
        batch, scores = first_rows(batch, valid, size), output["scores"].float()[:valid]
        out = {"scores": scores}
        for m in self.active if valid else []:
            if not m.generates:
                with engine.autocast() if m in self.encoders else contextlib.nullcontext():
                    m.update(batch, out)
        if forward:
            configured = self.evaluator.losses if "targets" in batch else []
            self.losses.add(output.get("losses") or {}, configured, batch, out, valid)
        written = writer is not None and self.decoding.generate is not None
        busiest = self.decoding.busiest(seen, size, written) if self.decoding.lockstep else 0
        generated = self.decoding.run(batch, valid if written else scored, busiest)  # a generative model's new ids
        if scored:
            texts = self.builder.generated_text(generated[:scored])
            for m in (m for m in self.active if m.generates):
                m.update(first_rows(batch, scored, valid), {"generated": texts})
        if writer is not None:
            if written and valid:  # rows of decoded text, not scores
                scores = generated
            rows = self.builder.predictions(batch, scores) if valid else []
            writer.write(in_dataset_order(engine.gather_object(rows)))

    def result(self, split: str) -> dict[str, float]:
        values = self.losses.reduce()  # every rank joins these collectives, labelled split or not
        for m in self.metrics:
            if m in (self.active or []):
                m.sync()
        for m in self.active or []:
            values.update({k: float(v) for k, v in m.compute().items()})
        values.update(self.builder.extra_metrics(split))
        return values

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()

    def close(self, split: str) -> None:
        if self.writer is not None:
            path = self.writer.close()
            if self.engine.is_main_process:
                log.info("Wrote %s predictions to %s", split, path)


def check_metrics(model_name: str, criteria: str | None, model: torch.nn.Module, builders: Mapping[str, Any],
                  metrics: Mapping[str, list[Any]], losses: list[tuple[str, Any]]) -> None:
    """Before the first update: a metric of generated text needs a model that generates and a dataset
    that decodes its ids (under sharded parameters the ranks decode in lockstep); ``training.early_stop.criteria``
    must name a value the run computes, where its metrics say beforehand what they compute."""
    for name, listed in metrics.items():
        generating = sorted(m.name for m in listed if getattr(m, "generates", False))
        if not generating:
            continue
        if not callable(getattr(model, "generate", None)):
            raise UserError(f"metrics {generating} of {name} score generated text, and model {model_name!r} does not "
                            "generate; use a generative model (model=vlm) or drop them from metrics.")
        if not callable(getattr(builders[name], "generated_text", None)):
            raise UserError(f"metrics {generating} score generated text, and dataset {name!r} has no text targets to "
                            "decode against; use a generative dataset (e.g. easy_vqa_generative) or drop them.")
    if not criteria or not metrics:
        return
    dataset = next((d for d in metrics if str(criteria).startswith(d + "/")), next(iter(metrics)))
    metric = str(criteria)[len(dataset) + 1:] if str(criteria).startswith(dataset + "/") else str(criteria)
    declared = [m.result_names() if hasattr(m, "result_names") else None for m in metrics[dataset]]
    if not declared or any(names is None for names in declared):
        return  # some metric tells its names only once computed: checked at the first evaluation
    known = sorted({n for names in declared for n in names} | {n for n, _ in losses} | {"total_loss"})
    if metric not in known:
        raise UserError(f"training.early_stop.criteria={criteria!r}: the run does not compute {metric!r} for "
                        f"{dataset}; use one of {', '.join(f'{dataset}/{k}' for k in known)}.")


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
