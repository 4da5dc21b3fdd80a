"""The config sections an :class:`mmvl.engine.Engine` reads, resolved once.

``Engine(config)`` stays for scripts and splits the config into these at its door; a run's parts
(:func:`mmvl.trainers.parts.build_parts`) hand it :class:`EngineSections` directly. The same
object is what the launcher reader and the strategies read their sections from
(:func:`mmvl.config.schema.typed_section` takes it as it takes a config).
"""
from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch

from mmvl.config import schema
from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class EngineSections:
    """``training`` (device, precision, accumulation, compile, prefetch), ``distributed`` (the
    strategy and its settings) and ``optimizer`` (whether its state is sharded: the strategy's choice)."""

    training: schema.Training = dataclasses.field(default_factory=schema.Training)
    distributed: schema.Distributed = dataclasses.field(default_factory=schema.Distributed)
    optimizer: schema.Optimizer = dataclasses.field(default_factory=schema.Optimizer)

    @classmethod
    def of(cls, config: Any) -> "EngineSections":
        """The sections of ``config`` (a loaded config, or plain dicts; None: the schema's defaults)."""
        config = {} if config is None else config
        return cls(schema.section(config, "training"), schema.section(config, "distributed"),
                   schema.section(config, "optimizer"))

    def with_device(self, device: Any) -> "EngineSections":
        """These sections with ``training.device`` set (``Engine(device=...)``)."""
        return dataclasses.replace(self, training=dataclasses.replace(self.training, device=str(device)))

    def with_strategy(self, name: str) -> "EngineSections":
        """These sections with ``distributed.strategy`` set (``Engine(strategy=<name>)``)."""
        return dataclasses.replace(self, distributed=dataclasses.replace(self.distributed, strategy=str(name)))


def init_process(sections: EngineSections) -> DistEnv:
    """Read the launcher and join its process group when none exists yet (as Accelerate does);
    a group this creates is left again at exit."""
    from mmvl.distributed.init import destroy, init_distributed

    existed = comm.is_initialized()
    env = init_distributed(sections)
    if not existed and comm.is_initialized():
        atexit.register(destroy)
    return env


def build_engine_strategy(sections: EngineSections, env: DistEnv, name: str | None,
                          dtype: torch.dtype | None) -> Strategy:
    """The strategy ``sections`` name (``name``: ``Engine(strategy=<name>)`` instead), computing in ``dtype``."""
    try:
        from mmvl.distributed.strategies import build_strategy
    except ImportError:  # the strategies package is optional at import time
        return Strategy(sections, env, dtype)
    return build_strategy(sections if name is None else sections.with_strategy(name), env, dtype)
