"""Built-in callbacks, in the order the loop calls them."""
from __future__ import annotations

from typing import Any

from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.callbacks.checkpoint import CheckpointCallback
from mmvl.trainers.callbacks.early_stop import EarlyStopCallback
from mmvl.trainers.callbacks.evaluation import EvaluationCallback
from mmvl.trainers.callbacks.logging import LoggingCallback
from mmvl.trainers.callbacks.preemption import PreemptionCallback
from mmvl.trainers.callbacks.profiler import ProfilerCallback

__all__ = ["Callback", "CheckpointCallback", "EarlyStopCallback", "EvaluationCallback",
           "LoggingCallback", "PreemptionCallback", "ProfilerCallback", "default_callbacks"]


def default_callbacks(trainer: Any) -> list[Callback]:
    """Profiler first (its window starts before anything else of an update), then logging,
    evaluation, early stop (sets ``is_best``), checkpoint (reads it), and preemption last
    (it stops after this update's checkpoint)."""
    return [ProfilerCallback(trainer), LoggingCallback(trainer), EvaluationCallback(trainer),
            EarlyStopCallback(trainer), CheckpointCallback(trainer), PreemptionCallback(trainer)]
