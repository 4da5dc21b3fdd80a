"""Tracks the best validation value and stops after ``patience`` updates without improvement.

The criterion is ``<dataset>/<metric>`` (or just ``<metric>`` with one dataset).
Every rank holds the same gathered metrics, so every rank decides the same.
"""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.runs import resolve_metric
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
        self.loss_names = {name for name, _ in trainer.losses}  # never the default criterion
        trainer.is_best = False

    def on_update_end(self, info: dict[str, Any]) -> None:
        self.loss_names.update(info["losses"])  # with the losses a model returns itself

    def _value(self, results: dict[str, dict[str, float]]) -> tuple[str, float]:
        dataset, metric = resolve_metric(self.criteria, results, "training.early_stop.criteria",
                                         self.loss_names)
        return f"{dataset}/{metric}", float(results[dataset][metric])

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
