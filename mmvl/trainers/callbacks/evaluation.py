"""Runs validation every ``training.evaluation_interval`` updates and after the last one."""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol


@register_callback("evaluation")
class EvaluationCallback(Callback):
    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        training = trainer.sections.training
        self.interval = int(training.evaluation_interval or 0)
        self.enabled = "val" in trainer.sections.stages or bool(training.early_stop.enabled)

    def on_update_end(self, info: dict[str, Any]) -> None:
        state = self.trainer.state
        if self.enabled and ((self.interval > 0 and state.update % self.interval == 0)
                             or state.update >= state.max_updates):
            self.trainer.evaluate("val", during_training=True)
