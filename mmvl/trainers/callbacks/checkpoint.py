"""Saves checkpoints every ``checkpoint_interval``, on a new best and at the end; resumes a run.

Full form (every strategy): ``model_<update>.ckpt`` + ``last.ckpt`` (+ ``best.ckpt``),
gathered on rank 0. Sharded form (``distributed.sharded_checkpoint=true`` under fsdp):
each periodic or preemption save is ``sharded_<update>/``, where every rank writes its own
part of model and optimizer (no gather) and rank 0 adds the rest (``state.ckpt``) before the
completion marker; ``best.ckpt`` and the end-of-training ``last.ckpt`` stay full files.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mmvl.checkpoint import SHARDED_STATE, check_sharded_complete, safe_load
from mmvl.distributed.comm import all_ranks_agreed, on_main_agreed
from mmvl.errors import UserError
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback

log = logging.getLogger("mmvl")


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
        _prune(t.checkpoints)
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


def _prune(manager: Any) -> None:
    """Best effort, rank 0 only: a directory that cannot be removed is only reported."""
    try:
        for path in manager.prune_sharded():
            log.info("removed sharded checkpoint %s (checkpoint.max_to_keep=%d)", path, manager.max_to_keep)
    except OSError as e:
        log.warning("could not prune sharded checkpoints in %s: %s", manager.directory, e)


def resume(trainer: Any) -> str | None:
    """Load ``checkpoint.resume_file``, or the newest checkpoint when ``checkpoint.resume`` asks.

    Rank 0 chooses (full file or complete sharded directory, whichever is newest) and
    broadcasts the choice; every rank then checks that it can read it and all agree
    before any collective load. Returns the path resumed from, or None.
    """
    ck, engine = trainer.config.checkpoint, trainer.engine
    mode = str(ck.get("resume", False)).lower()
    if not ck.get("resume_file") and mode not in ("true", "auto"):
        return None

    def choose() -> str | None:
        if ck.get("resume_file"):
            return str(ck.resume_file)
        found = trainer.checkpoints.find_latest(best=bool(ck.get("resume_best")),
                                                sharded=engine.can_load_sharded(trainer.optimizer))
        if found is None and mode == "true":
            raise UserError(
                f"checkpoint.resume=true but there is no checkpoint in {trainer.checkpoints.directory}; "
                "run without checkpoint.resume, or point checkpoint.resume_file at a checkpoint.")
        return None if found is None else str(found)

    path = on_main_agreed(choose, "choose the checkpoint to resume from")
    if path is None:
        return None
    sharded = Path(path).is_dir()
    state, problem = None, None
    try:
        if sharded:
            check_sharded_complete(path)
            state = safe_load(Path(path, SHARDED_STATE), expect_keys=("trainer",))
        else:
            state = safe_load(path)
    except UserError as e:
        problem = str(e)
    all_ranks_agreed(problem, f"resume from {path}")
    if sharded:
        engine.load_sharded(path, trainer.model, trainer.optimizer)  # collective
    trainer.load_state_dict(state)
    saved_world = int(state["trainer"].get("world_size", trainer.env.world_size))
    if sharded and saved_world != trainer.env.world_size:
        log.info("Re-sharded %s from %d to %d processes", path, saved_world, trainer.env.world_size)
    log.info("Resumed from %s at update %d", path, trainer.update)
    return path
