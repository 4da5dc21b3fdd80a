from mmvl.trainers import callbacks  # noqa: F401  (registers the built-in callbacks)
from mmvl.trainers.trainer import NonFiniteLossError, Trainer, run

__all__ = ["NonFiniteLossError", "Trainer", "run", "callbacks"]
