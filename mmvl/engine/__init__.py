"""The Engine: device, precision, accumulation, strategy and checkpoints behind a few calls.

- :mod:`mmvl.engine.core`: :class:`Engine` itself;
- :mod:`mmvl.engine.prepared`: what ``prepare`` hands back (optimizer, scheduler, loader);
- :mod:`mmvl.engine.state`: the checkpointables it owns and the collective order of a save;
- :mod:`mmvl.engine.loaders`: prepared DataLoaders (sharded per rank, resumable mid-epoch);
- :mod:`mmvl.engine.accelerator`, :mod:`mmvl.engine.accelerate`: Accelerate's names (``Accelerator``
  is the Engine).
"""
from mmvl.engine.accelerate import DistributedType, find_executable_batch_size, set_seed
from mmvl.engine.core import Engine, compile_model
from mmvl.engine.prepared import DeviceLoader, PreparedOptimizer, PreparedScheduler
from mmvl.engine.state import load_sharded, save_sharded

#: Accelerate's name for the Engine: ``from mmvl.engine import Accelerator`` ports a script unchanged
Accelerator = Engine

__all__ = ["Accelerator", "DeviceLoader", "DistributedType", "Engine", "PreparedOptimizer", "PreparedScheduler",
           "compile_model", "find_executable_batch_size", "load_sharded", "save_sharded", "set_seed"]
