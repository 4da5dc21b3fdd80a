"""The Engine: device, precision, accumulation, strategy and checkpoints behind a few calls.

- :mod:`mmvl.engine.core`: :class:`Engine` itself;
- :mod:`mmvl.engine.prepared`: what ``prepare`` hands back (optimizer, scheduler, loader);
- :mod:`mmvl.engine.state`: the checkpointables it owns and the collective order of a save.
"""
from mmvl.engine.core import Engine, compile_model
from mmvl.engine.prepared import DeviceLoader, PreparedOptimizer, PreparedScheduler
from mmvl.engine.state import load_sharded, save_sharded

__all__ = ["DeviceLoader", "Engine", "PreparedOptimizer", "PreparedScheduler", "compile_model", "load_sharded",
           "save_sharded"]
