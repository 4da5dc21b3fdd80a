"""Saves ``last.ckpt`` (and periodic/best ones) every ``checkpoint_interval`` and at the end."""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback


@register_callback("checkpoint")
class CheckpointCallback(Callback):
    def __init__(self, trainer: Any, **params: Any):
        super().__init__(trainer)
        self.saved_at = -1

    def save(self, is_best: bool = False) -> None:
        t = self.trainer
        state = t.state_dict()  # collective: every rank takes part
        if t.engine.is_main_process:
            t.checkpoints.save(state, t.update, is_best=is_best)
        t.engine.wait_for_everyone()
        self.saved_at = t.update

    def on_update_end(self, info: dict[str, Any]) -> None:
        t = self.trainer
        interval = int(t.config.training.checkpoint_interval or 0)
        is_best = bool(getattr(t, "is_best", False)) and t.last_eval is not None \
            and t.last_eval[0] == t.update
        if is_best or (interval > 0 and t.update % interval == 0):
            self.save(is_best=is_best)
        t.is_best = False

    def on_train_end(self) -> None:
        if self.saved_at != self.trainer.update:
            self.save()
