"""Saves checkpoints every ``checkpoint_interval``, on a new best and at the end.

Full form (every strategy): ``model_<update>.ckpt`` + ``last.ckpt`` (+ ``best.ckpt``),
gathered on rank 0. Sharded form (``distributed.sharded_checkpoint=true`` under fsdp):
each periodic or preemption save is ``sharded_<update>/``, where every rank writes its own
part of model and optimizer (no gather) and rank 0 adds the rest (``state.ckpt``) before the
completion marker; ``best.ckpt`` and the end-of-training ``last.ckpt`` stay full files.
This callback only decides when: writing is ``Trainer.save_checkpoint`` -> ``Engine.save_checkpoint``
(who writes what), the layout is :mod:`mmvl.checkpoint`'s, resuming is :mod:`mmvl.trainers.resume`'s.
"""
from __future__ import annotations

from typing import Any

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol


@register_callback("checkpoint")
class CheckpointCallback(Callback):
    """Saves every ``training.checkpoint_interval`` updates, when ``state.is_best``, and at the end."""

    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.interval = int(trainer.sections.training.checkpoint_interval or 0)

    def on_update_end(self, info: dict[str, Any]) -> None:
        state = self.trainer.state
        if state.is_best or (self.interval > 0 and state.update % self.interval == 0):
            self.trainer.save_checkpoint(is_best=state.is_best)

    def on_train_end(self) -> None:
        t, state = self.trainer, self.trainer.state
        if t.engine.sharded_checkpoint and not state.preempted:
            t.save_checkpoint(full=True)  # the final export: last.ckpt, one full file (resumable too)
        elif state.last_saved != state.update:
            t.save_checkpoint()
