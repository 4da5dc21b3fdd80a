"""The Engine's side of checkpoints: the checkpointables it owns, and the collective order of a save.

Which rank writes what, and where all ranks must agree, is decided here, between the strategies
(which produce and consume state dicts only) and the checkpoint package (which owns the layout
and imports nothing from ``mmvl.distributed``). A failure on rank 0 while writing is raised on
every rank (``comm.on_main_agreed``), so no rank waits for it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmvl.checkpoint import CheckpointManager, match_model_state, sharded
from mmvl.distributed import comm
from mmvl.distributed.strategies.base import Strategy
from mmvl.engine.prepared import inner
from mmvl.optim import implementation_of, restore_implementation
from mmvl.utils.rng import get_rng_state, set_rng_state

if TYPE_CHECKING:
    from mmvl.engine.clock import CheckpointOwner


class ModelState:
    """The prepared model's full state, through its strategy (gathered on rank 0 when sharded)."""

    def __init__(self, strategy: Strategy, model: torch.nn.Module):
        self.strategy, self.model = strategy, model

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A full state on every rank; keys matched to the model (wrapper prefixes), checked first."""
        own = self.strategy.unwrap(self.model).state_dict()
        mapped, _, _ = match_model_state(own, state)
        self.strategy.load_model_state_dict(self.model, mapped)


class OptimizerState:
    """The prepared optimizer's full state, through the strategy (consolidated on rank 0 for ZeRO)."""

    def __init__(self, engine: "CheckpointOwner"):
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        return e.strategy.optimizer_state_dict(e.prepared_model, inner(e.prepared_optimizer))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved numbers; the implementation (fused, foreach) stays the one this run built."""
        e = self.engine
        optimizer = inner(e.prepared_optimizer)
        built = implementation_of(optimizer)
        e.strategy.load_optimizer_state_dict(e.prepared_model, optimizer, state)
        restore_implementation(optimizer, built)


class RngState:
    """Every rank's RNG state (saved as one list, rank by rank; restored at the same world size).
    A plain object (no closures), so an Engine holding it can be pickled."""

    def __init__(self, env: Any):
        self.env = env

    def state_dict(self) -> list[Any]:
        return comm.all_gather_object(get_rng_state())

    def load_state_dict(self, states: list[Any]) -> None:
        if len(states) == self.env.world_size:
            set_rng_state(states[self.env.rank])


def rng_state(env: Any) -> RngState:
    return RngState(env)


def save_sharded(directory: str | os.PathLike[str], strategy: Strategy, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None = None) -> Path:
    """Write one sharded checkpoint; every rank calls this (it is a collective).

    Rank 0 first marks the folder incomplete; every rank writes its part of model and optimizer;
    once all parts are on disk rank 0 writes ``extra`` (the rest of the checkpoint) and the marker.
    """
    directory = Path(directory)
    comm.on_main_agreed(lambda: sharded.begin(directory), f"prepare {directory}")
    strategy.save_sharded_state(model, optimizer, str(directory))
    comm.synchronize()  # every rank's part is on disk
    comm.on_main_agreed(lambda: sharded.finish(directory, extra, comm.get_world_size()), f"complete {directory}")
    return directory


def load_sharded(directory: str | os.PathLike[str], strategy: Strategy, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Load model (and optimizer, unless None) from a complete sharded checkpoint; every rank calls
    this. The strategy reads the parts it needs (re-sharded to this world size)."""
    sharded.check_complete(directory)
    built = implementation_of(optimizer) if optimizer is not None else None
    strategy.load_sharded_state(model, optimizer, str(directory))
    if built is not None:
        restore_implementation(optimizer, built)


def save_checkpoint(engine: "CheckpointOwner", manager: CheckpointManager, update: int, is_best: bool = False,
                    full: bool = False) -> None:
    """Checkpoint ``update`` (every rank calls this).

    Full form (every strategy): ``model_<update>.ckpt`` + ``last.ckpt`` (+ ``best.ckpt``), gathered
    on rank 0. Sharded form (``distributed.sharded_checkpoint`` under fsdp): ``sharded_<update>/``,
    each rank writing its own part (no gather); ``best.ckpt`` and, with ``full`` (the end of
    training), ``last.ckpt`` stay full files.
    """
    if engine.sharded_checkpoint and not full:
        engine.save_sharded(manager.sharded_path(update), extra=engine.state_dict(sharded=True))
        if engine.is_main_process:
            manager.prune_sharded()
        if is_best:  # best.ckpt stays one full file, usable anywhere
            best = engine.state_dict()
            comm.on_main_agreed(lambda: manager.save_best(best), "save best.ckpt")
        return
    state = engine.state_dict()  # collective: every rank takes part
    periodic = not engine.sharded_checkpoint  # a sharded run's export: last.ckpt only
    comm.on_main_agreed(lambda: manager.save(state, update, is_best=is_best, periodic=periodic),
                        f"save the checkpoint of update {update}")
