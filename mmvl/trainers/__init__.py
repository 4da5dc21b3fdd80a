from mmvl.trainers.trainer import NonFiniteLossError, Trainer, run

__all__ = ["NonFiniteLossError", "Trainer", "run"]
