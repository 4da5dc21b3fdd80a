"""A generative model's decoding during evaluation, and the cap on the rows it decodes.

It decodes with the model's ``generate`` (the KV cache, its ``generation`` settings, under
autocast; in lockstep over the ranks where parameters are sharded) the rows the generation metrics score: the split's first ``evaluation.generate_max_samples``
in dataset order (the same rows at any world size) in the evaluations during training, every row in
the others and with the cap null; or, when predictions are written, every row (the file holds the
whole split).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from mmvl.metrics import Metric
from mmvl.trainers.evaluation.rows import batch_size_of, first_rows, owned

log = logging.getLogger("mmvl")


class Decoding:
    """One dataset's decoding: ``cap`` is the generation metrics' row limit (None: the whole split)."""

    def __init__(self, engine: Any, model: torch.nn.Module, total: int, metrics: list[Metric], cap: int | None):
        self.engine, self.model = engine, model
        self.generate = getattr(engine.unwrap_model(model), "generate", None)
        self.scoring = any(m.generates for m in metrics)
        self.total, self.limit = total, total if cap is None else min(int(cap), total)
        #: sharded parameters (FSDP): every forward is a collective, so the ranks decode in lockstep
        self.lockstep = bool(engine.strategy.shards_parameters) and engine.env.world_size > 1

    def rows(self, seen: int, size: int, valid: int, env: Any) -> int:
        """How many of a batch's first rows the generation metrics score: this rank's samples
        ``seen .. seen + size`` that sit in the split's first ``limit`` (a prefix of the batch)."""
        if not self.scoring:
            return 0
        return max(0, min(valid, owned(seen + size, self.limit, env) - owned(seen, self.limit, env)))

    def busiest(self, seen: int, size: int, written: bool) -> int:
        """The most rows any rank decodes in this round of batches (``written``: every real row). Each
        rank knows every rank's share from the positions alone (rank r holds positions r, r + W, ...;
        every rank's batch of a round has the same size), so no collective is needed."""
        env, most = self.engine.env, 0
        for rank in range(env.world_size):
            other = SimpleNamespace(rank=rank, world_size=env.world_size)
            valid = max(0, min(size, owned(seen + size, self.total, other) - owned(seen, self.total, other)))
            most = max(most, valid if written else self.rows(seen, size, valid, other))
        return most

    def run(self, batch: Mapping[str, Any], n: int, busiest: int = 0) -> torch.Tensor | None:
        """New token ids (``n x max_new_tokens``) of the batch's first ``n`` rows; None for none.

        In lockstep (sharded parameters) every rank decodes the batch when any rank does (``busiest``:
        :meth:`busiest`; a rank with no row of its own decodes one and drops it) and keeps stepping until
        every rank's rows have ended (``synced_gpus``), so each forward's gathers meet on every rank."""
        if self.generate is None:
            return None
        if self.lockstep:
            if not busiest:
                return None
            size = batch_size_of(batch)
            with self.engine.autocast(), self.engine.strategy.decoding(self.model):
                new = self.generate(first_rows(batch, min(max(n, 1), size), size), synced_gpus=True)
            return new[:n] if n else None
        if not n:
            return None
        with self.engine.autocast():
            return self.generate(first_rows(batch, n, batch_size_of(batch)))

    def log_cap(self, what: str, active: list[Metric], main: bool) -> None:
        if main and self.limit < self.total and any(m.generates for m in active):
            log.info("%s: the generation metrics scored the first %d of %d samples (evaluation.generate_max_samples, "
                     "during training)", what, self.limit, self.total)
