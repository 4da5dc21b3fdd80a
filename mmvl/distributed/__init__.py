"""Distributed training: process-group set-up, collectives, and parallel strategies.

Strategies (``mmvl.distributed.strategies``) are imported on demand to keep
``import mmvl`` light.
"""
from __future__ import annotations

from mmvl.distributed.comm import (all_gather, all_gather_object, all_reduce_mean, broadcast,
                                   broadcast_object, gather_for_metrics, get_rank, get_world_size,
                                   is_main_process, reduce_dict, synchronize)
from mmvl.distributed.env import DistEnv
from mmvl.distributed.init import destroy, exit_process, init_distributed, seed_everything, seed_for_init


def build_strategy(config, env: DistEnv):
    """See :func:`mmvl.distributed.strategies.build_strategy` (imported lazily)."""
    from mmvl.distributed.strategies import build_strategy as _build

    return _build(config, env)


__all__ = ["DistEnv", "init_distributed", "destroy", "exit_process", "seed_everything", "seed_for_init", "build_strategy",
           "all_gather", "all_gather_object", "all_reduce_mean", "broadcast", "broadcast_object",
           "gather_for_metrics", "get_rank", "get_world_size", "is_main_process", "reduce_dict",
           "synchronize"]
