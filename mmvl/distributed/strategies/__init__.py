"""Strategies, registered by name in ``mmvl.registry.STRATEGIES``, and ``build_strategy``."""
from __future__ import annotations

from typing import Any

import torch

from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv
from mmvl.distributed.init import config_value
# importing each module registers its strategy
from mmvl.distributed.strategies import ddp, dp, fsdp, single, zero_fairscale, zero_torch  # noqa: F401
from mmvl.distributed.strategies.base import Strategy
from mmvl.errors import UserError
from mmvl.registry import STRATEGIES

__all__ = ["Strategy", "build_strategy", "resolve_strategy_name"]


def resolve_strategy_name(config: Any, env: DistEnv) -> str:
    """``distributed.strategy`` with ``auto`` resolved: ddp for several processes,
    dp for one process seeing several GPUs with ``distributed.data_parallel``, else single.
    MMF's ``optimizer.enable_state_sharding`` picks zero_fairscale under auto."""
    name = str(config_value(config, "distributed.strategy", "auto"))
    if name != "auto":
        return name
    if env.world_size > 1:
        return "zero_fairscale" if config_value(config, "optimizer.enable_state_sharding", False) else "ddp"
    if (env.device.type == "cuda" and torch.cuda.device_count() > 1
            and config_value(config, "distributed.data_parallel", False)):
        return "dp"
    return "single"


def build_strategy(config: Any, env: DistEnv) -> Strategy:
    """The strategy the run uses. One that needs a process group, named in a run of one process
    without one, is a UserError: training unwrapped instead is not what the user asked for."""
    name = resolve_strategy_name(config, env)
    cls = STRATEGIES.get(name)
    if getattr(cls, "needs_process_group", False) and not comm.is_initialized():
        raise UserError(
            f"distributed.strategy={name} needs several processes but this run is one process; set "
            "distributed.world_size=<N> (mmvl_run then starts N processes) or start it with torchrun/srun, "
            "or use distributed.strategy=single (checkpoints are interchangeable).")
    return cls(config, env)
