"""Stops after ``patience`` updates without a new best validation value.

It only stops: the best value (of ``training.early_stop.criteria``) is kept by the evaluation
(``state.best``, :class:`mmvl.trainers.evaluation.BestTracker`) whether early stopping is on or
not, and the checkpoint callback writes ``best.ckpt`` from it. Every rank holds the same
gathered metrics, so every rank decides the same.
"""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol


@register_callback("early_stop")
class EarlyStopCallback(Callback):
    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        cfg = trainer.sections.training.early_stop
        self.enabled = bool(cfg.enabled)
        self.patience = int(cfg.patience or 0)

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        state = self.trainer.state
        if not self.enabled or split != "val" or state.is_best:
            return
        if state.update - (state.best.update or 0) >= self.patience:
            state.should_stop = True
