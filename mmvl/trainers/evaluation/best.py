"""The best validation value of a run (``state.best``), kept by the evaluation before any callback hears of it."""
from __future__ import annotations

from typing import Any

from mmvl.runs import resolve_metric
from mmvl.trainers.state import Best, TrainerState


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
