"""Tracks the best validation value and stops after ``patience`` updates without improvement.

The criterion is ``<dataset>/<metric>`` (or just ``<metric>`` with one dataset).
Every rank holds the same gathered metrics, so every rank decides the same.
"""
from __future__ import annotations

from typing import Any

from mmvl.errors import UserError, did_you_mean
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback


@register_callback("early_stop")
class EarlyStopCallback(Callback):
    def __init__(self, trainer: Any, **params: Any):
        super().__init__(trainer)
        cfg = trainer.config.training.early_stop
        self.enabled = bool(cfg.enabled)
        self.criteria = cfg.get("criteria")
        self.patience = int(cfg.get("patience") or 0)
        self.minimize = cfg.get("minimize")
        self.best_value: float | None = None
        self.best_update: int | None = None
        trainer.is_best = False

    def _value(self, results: dict[str, dict[str, float]]) -> tuple[str, float]:
        name = self.criteria
        if not name:
            dataset = next(iter(results))
            metric = next((k for k in results[dataset] if k not in ("total_loss",)
                           and "/" not in k and not k.endswith("loss")), "total_loss")
            name = f"{dataset}/{metric}"
        dataset, _, metric = str(name).rpartition("/")
        if dataset not in results:  # bare metric name, or metric names with slashes
            dataset = next((d for d in results if str(name).startswith(d + "/")), None)
            metric = str(name)[len(dataset) + 1:] if dataset else str(name)
            dataset = dataset or next(iter(results))
        values = results[dataset]
        if metric not in values:
            raise UserError(
                f"training.early_stop.criteria={name!r} is not among the evaluation results "
                f"of {dataset!r}.{did_you_mean(metric, values)} Available: {', '.join(values)}.")
        return f"{dataset}/{metric}", float(values[metric])

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        if split != "val":
            return
        name, value = self._value(results)
        minimize = self.minimize if self.minimize is not None else name.endswith("loss")
        better = self.best_value is None or (value < self.best_value if minimize
                                             else value > self.best_value)
        self.trainer.is_best = better
        if better:
            self.best_value, self.best_update = value, self.trainer.update
        elif self.enabled and self.trainer.update - (self.best_update or 0) >= self.patience:
            self.trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_update": self.best_update}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.best_update = state.get("best_value"), state.get("best_update")
