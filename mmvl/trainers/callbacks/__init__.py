"""Built-in callbacks, in the order the loop calls them."""
from __future__ import annotations

from typing import Any

from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.callbacks.checkpoint import CheckpointCallback
from mmvl.trainers.callbacks.early_stop import EarlyStopCallback
from mmvl.trainers.callbacks.evaluation import EvaluationCallback
from mmvl.trainers.callbacks.logging import LoggingCallback
from mmvl.trainers.callbacks.lr import LRSchedulerCallback
from mmvl.trainers.callbacks.preemption import PreemptionCallback

__all__ = ["Callback", "CheckpointCallback", "EarlyStopCallback", "EvaluationCallback",
           "LoggingCallback", "LRSchedulerCallback", "PreemptionCallback", "default_callbacks"]


def default_callbacks(trainer: Any) -> list[Callback]:
    """LR first (it records the LR used), then logging, evaluation, early stop, checkpoint,
    and preemption last (it saves through the checkpoint callback)."""
    return [LRSchedulerCallback(trainer), LoggingCallback(trainer), EvaluationCallback(trainer),
            EarlyStopCallback(trainer), CheckpointCallback(trainer), PreemptionCallback(trainer)]
