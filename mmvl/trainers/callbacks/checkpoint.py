"""Saves checkpoints every ``checkpoint_interval``, on a new best and at the end.

Full form (every strategy): ``model_<update>.ckpt`` + ``last.ckpt`` (+ ``best.ckpt``),
gathered on rank 0. Sharded form (``distributed.sharded_checkpoint=true`` under fsdp):
each periodic or preemption save is ``sharded_<update>/``, where every rank writes its own
part of model and optimizer (no gather) and rank 0 adds the rest (``state.ckpt``) before the
completion marker; ``best.ckpt`` and the end-of-training ``last.ckpt`` stay full files.
The layout is :mod:`mmvl.checkpoint`'s; resuming is :mod:`mmvl.trainers.resume`'s.
"""
from __future__ import annotations

from typing import Any

from mmvl.distributed.comm import on_main_agreed
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback


def save_checkpoint(trainer: Any, is_best: bool = False, full: bool = False) -> None:
    """Write the checkpoint of ``trainer.update`` (every rank calls this; use ``Trainer.save_checkpoint``).

    ``full``: a full ``last.ckpt`` even in a sharded run (the end-of-training export).
    """
    t = trainer
    if t.engine.sharded_checkpoint and not full:
        _save_sharded(t, is_best)
        return
    state = t.state_dict()  # collective: every rank takes part
    periodic = not t.engine.sharded_checkpoint  # a sharded run's export: last.ckpt only

    def write() -> None:
        t.checkpoints.save(state, t.update, is_best=is_best, periodic=periodic)

    on_main_agreed(write, f"save the checkpoint of update {t.update}")


def _save_sharded(t: Any, is_best: bool) -> None:
    directory = t.checkpoints.sharded_path(t.update)
    t.engine.save_sharded(str(directory), t.model, t.optimizer, extra=t.state_dict(sharded=True))
    if t.engine.is_main_process:
        t.checkpoints.prune_sharded()
    if is_best:  # best.ckpt stays one full file, usable anywhere
        state = t.state_dict()

        def write_best() -> None:
            t.checkpoints.save_best(state)

        on_main_agreed(write_best, "save best.ckpt")


@register_callback("checkpoint")
class CheckpointCallback(Callback):
    """Saves every ``training.checkpoint_interval`` updates, when ``trainer.is_best``, and at the end."""

    def __init__(self, trainer: Any, **params: Any):
        super().__init__(trainer)
        self.interval = int(trainer.config.training.checkpoint_interval or 0)

    def on_update_end(self, info: dict[str, Any]) -> None:
        t = self.trainer
        is_best = t.is_best and t.last_eval is not None and t.last_eval[0] == t.update
        if is_best or (self.interval > 0 and t.update % self.interval == 0):
            t.save_checkpoint(is_best=is_best)
        t.is_best = False

    def on_train_end(self) -> None:
        t = self.trainer
        if t.engine.sharded_checkpoint and not t.preempted:
            t.save_checkpoint(full=True)  # the final export: last.ckpt, one full file (resumable too)
        elif t.last_saved != t.update:
            t.save_checkpoint()
