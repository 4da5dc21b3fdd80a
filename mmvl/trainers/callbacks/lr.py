"""Steps the LR schedule once per optimizer update."""
from __future__ import annotations

from typing import Any

from mmvl.optim import base_lr
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback


@register_callback("lr_scheduler")
class LRSchedulerCallback(Callback):
    def on_update_end(self, info: dict[str, Any]) -> None:
        info["lr"] = base_lr(self.trainer.optimizer)
        if self.trainer.scheduler is not None and not self.trainer.optimizer.step_was_skipped:
            self.trainer.scheduler.step()
