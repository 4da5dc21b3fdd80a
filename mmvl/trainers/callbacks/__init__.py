"""Built-in callbacks, in the order the loop calls them."""
from __future__ import annotations

from typing import Any

from mmvl.config.access import config_value
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.callbacks.checkpoint import CheckpointCallback
from mmvl.trainers.callbacks.curves import CurvesCallback
from mmvl.trainers.callbacks.early_stop import EarlyStopCallback
from mmvl.trainers.callbacks.evaluation import EvaluationCallback
from mmvl.trainers.callbacks.logging import LoggingCallback
from mmvl.trainers.callbacks.preemption import PreemptionCallback
from mmvl.trainers.callbacks.profiler import ProfilerCallback
from mmvl.trainers.callbacks.tensorboard import TensorBoardCallback, tensorboard_enabled

__all__ = ["Callback", "CheckpointCallback", "CurvesCallback", "EarlyStopCallback", "EvaluationCallback",
           "LoggingCallback", "PreemptionCallback", "ProfilerCallback", "TensorBoardCallback",
           "default_callbacks"]


def default_callbacks(trainer: Any) -> list[Callback]:
    """Profiler first (its window starts before anything else of an update), then logging
    (TensorBoard and curves read what it writes, as ``training.tensorboard``/``curves`` say),
    evaluation, early stop (sets ``is_best``), checkpoint (reads it), and preemption last (it
    stops after this update's checkpoint)."""
    callbacks = [ProfilerCallback(trainer), LoggingCallback(trainer)]
    if tensorboard_enabled(trainer.config):
        callbacks.append(TensorBoardCallback(trainer))
    if config_value(trainer.config, "training.curves", True):
        callbacks.append(CurvesCallback(trainer))
    return callbacks + [EvaluationCallback(trainer), EarlyStopCallback(trainer), CheckpointCallback(trainer),
                        PreemptionCallback(trainer)]
