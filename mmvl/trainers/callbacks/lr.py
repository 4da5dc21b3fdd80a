"""Steps the LR schedule once per optimizer update."""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback


@register_callback("lr_scheduler")
class LRSchedulerCallback(Callback):
    def on_update_end(self, info: dict[str, Any]) -> None:
        info["lr"] = self.trainer.optimizer.param_groups[0]["lr"]
        if self.trainer.scheduler is not None and not self.trainer.optimizer.step_was_skipped:
            self.trainer.scheduler.step()
