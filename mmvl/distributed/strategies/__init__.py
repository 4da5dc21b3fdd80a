"""Strategies, registered by name in ``mmvl.registry.STRATEGIES``, and ``build_strategy``."""
from __future__ import annotations

from typing import Any

import torch

from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv
# importing each module registers its strategy
from mmvl.distributed.strategies import ddp, dp, fsdp, single, zero_fairscale, zero_torch  # noqa: F401
from mmvl.config.schema import typed_section
from mmvl.distributed.strategies.base import Strategy
from mmvl.errors import UserError
from mmvl.registry import STRATEGIES

__all__ = ["Strategy", "build_strategy", "resolve_strategy_name"]


def resolve_strategy_name(config: Any, env: DistEnv) -> str:
    """``distributed.strategy`` with ``auto`` resolved: ddp for several processes,
    dp for one process seeing several GPUs with ``distributed.data_parallel``, else single.

    MMF's ``optimizer.enable_state_sharding`` means what it meant there: the optimizer
    state is split over the ranks (fairscale OSS with ShardedDDP). Under auto it picks
    zero_fairscale for several processes; a named strategy that does not shard the
    optimizer state contradicts it (a UserError, not a silent choice of one of the two).
    """
    distributed = typed_section(config, "distributed")
    name = str(distributed.strategy)
    sharding = bool(typed_section(config, "optimizer").enable_state_sharding)
    if name != "auto":
        if sharding and not getattr(STRATEGIES.get(name), "shards_optimizer_state", False):
            shards = [n for n in STRATEGIES.names() if getattr(STRATEGIES.get(n), "shards_optimizer_state", False)]
            raise UserError(f"optimizer.enable_state_sharding=true but distributed.strategy={name} keeps the "
                            f"whole optimizer state on every rank; use distributed.strategy=auto or one of "
                            f"{', '.join(shards)}, or drop optimizer.enable_state_sharding.")
        return name
    if env.world_size > 1:
        return "zero_fairscale" if sharding else "ddp"
    if (env.device.type == "cuda" and torch.cuda.device_count() > 1
            and distributed.data_parallel):
        return "dp"
    return "single"


def build_strategy(config: Any, env: DistEnv, compute_dtype: torch.dtype | None = None) -> Strategy:
    """The strategy the run uses, computing in ``compute_dtype`` (the Engine's; None: fp32). One that needs a process group, named in a run of one process
    without one, is a UserError: training unwrapped instead is not what the user asked for."""
    name = resolve_strategy_name(config, env)
    cls = STRATEGIES.get(name)
    if getattr(cls, "needs_process_group", False) and env.world_size <= 1 and not comm.is_initialized():
        raise UserError(
            f"distributed.strategy={name} needs several processes but this run is one process; set "
            "distributed.world_size=<N> (mmvl_run then starts N processes) or start it with torchrun/srun, "
            "or use distributed.strategy=single (checkpoints are interchangeable).")
    return cls(config, env, compute_dtype)
