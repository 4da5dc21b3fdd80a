"""Runs validation every ``training.evaluation_interval`` updates and after the last one."""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback


@register_callback("evaluation")
class EvaluationCallback(Callback):
    def on_update_end(self, info: dict[str, Any]) -> None:
        t = self.trainer
        interval = int(t.config.training.evaluation_interval or 0)
        if "val" not in str(t.config.run_type) and not t.config.training.early_stop.enabled:
            return
        if (interval > 0 and t.update % interval == 0) or t.update >= t.max_updates:
            t.evaluate("val")
