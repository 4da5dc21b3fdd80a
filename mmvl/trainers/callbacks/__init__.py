"""Built-in callbacks; ``training.builtin_callbacks`` lists them, by registered name, in the order the
loop calls them."""
from __future__ import annotations

from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.callbacks.checkpoint import CheckpointCallback
from mmvl.trainers.callbacks.curves import CurvesCallback
from mmvl.trainers.callbacks.early_stop import EarlyStopCallback
from mmvl.trainers.callbacks.ema import EmaCallback
from mmvl.trainers.callbacks.evaluation import EvaluationCallback
from mmvl.trainers.callbacks.logging import LoggingCallback
from mmvl.trainers.callbacks.preemption import PreemptionCallback
from mmvl.trainers.callbacks.profiler import ProfilerCallback
from mmvl.trainers.callbacks.trackers import TrackersCallback

__all__ = ["Callback", "CheckpointCallback", "CurvesCallback", "EarlyStopCallback", "EmaCallback", "EvaluationCallback",
           "LoggingCallback", "PreemptionCallback", "ProfilerCallback", "TrackersCallback"]
