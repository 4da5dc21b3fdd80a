"""Experiment trackers (TensorBoard, W&B, MLflow) behind one interface, for the Trainer and the Engine.

Importing this package registers the built-in trackers; none imports its library until a run makes
it (see :mod:`mmvl.tracking.base`).
"""
from mmvl.tracking import mlflow, tensorboard, wandb  # noqa: F401  (registers the built-ins)
from mmvl.tracking.base import ALL, Tracker, installed, resolve, start

__all__ = ["ALL", "Tracker", "installed", "resolve", "start"]
