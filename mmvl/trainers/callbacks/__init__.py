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
from mmvl.trainers.callbacks.lr import LRSchedulerCallback
from mmvl.trainers.callbacks.preemption import PreemptionCallback
from mmvl.trainers.callbacks.tensorboard import TensorBoardCallback, tensorboard_enabled

__all__ = ["Callback", "CheckpointCallback", "CurvesCallback", "EarlyStopCallback", "EvaluationCallback",
           "LoggingCallback", "LRSchedulerCallback", "PreemptionCallback", "TensorBoardCallback",
           "default_callbacks"]


def default_callbacks(trainer: Any) -> list[Callback]:
    """LR first (it records the LR used), then logging (TensorBoard and curves read what it
    wrote), evaluation, early stop, checkpoint, and preemption last (it saves through the
    checkpoint callback). TensorBoard and curves.png as ``training.tensorboard``/``curves`` say."""
    callbacks = [LRSchedulerCallback(trainer), LoggingCallback(trainer)]
    if tensorboard_enabled(trainer.config):
        callbacks.append(TensorBoardCallback(trainer))
    if config_value(trainer.config, "training.curves", True):
        callbacks.append(CurvesCallback(trainer))
    return callbacks + [EvaluationCallback(trainer), EarlyStopCallback(trainer), CheckpointCallback(trainer),
                        PreemptionCallback(trainer)]
