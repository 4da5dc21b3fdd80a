from mmvl.trainers import callbacks  # noqa: F401  (registers the built-in callbacks)
from mmvl.trainers.parts import RunParts, build_parts
from mmvl.trainers.trainer import NonFiniteLossError, Trainer, run

__all__ = ["NonFiniteLossError", "RunParts", "Trainer", "build_parts", "run", "callbacks"]
