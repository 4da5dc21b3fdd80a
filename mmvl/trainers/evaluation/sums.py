"""What an evaluation adds up besides the metrics: the losses' sums, and the prediction rows of ranks
other than 0 (sent to rank 0, written nowhere)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mmvl.engine import Engine
from mmvl.losses import compute_losses


class LossSums:
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


class NoWriter:
    """Ranks other than 0 send their rows (all_gather_object) but write nothing."""

    def write(self, rows: Any) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...
