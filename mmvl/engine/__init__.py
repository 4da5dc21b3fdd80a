"""The Engine: device, precision, accumulation, strategy and checkpoints behind a few calls.

- :mod:`mmvl.engine.core`: :class:`Engine` itself;
- :mod:`mmvl.engine.prepared`: what ``prepare`` hands back (optimizer, scheduler, loader);
- :mod:`mmvl.engine.state`: the checkpointables it owns and the collective order of a save;
- :mod:`mmvl.engine.loaders`, :mod:`mmvl.engine.shards`: prepared DataLoaders (sharded per rank as
  Accelerate shards them, resumable mid-epoch);
- :mod:`mmvl.engine.plugins`: ``DataLoaderConfiguration``, ``GradientAccumulationPlugin``, ``GradientState``;
- :mod:`mmvl.engine.local_sgd`: ``LocalSGD`` (parameters averaged every K steps, Accelerate's meaning);
- :mod:`mmvl.engine.nested`: collectives over nested data, ``split_between_processes``, RNG sync;
- :mod:`mmvl.engine.accelerator`, :mod:`mmvl.engine.accelerate`: Accelerate's names (``Accelerator``
  is the Engine).
"""
from mmvl.engine.accelerate import DistributedType, find_executable_batch_size, set_seed
from mmvl.engine.core import Engine
from mmvl.utils.compile import compile_model
from mmvl.engine.loaders import prepare_data_loader
from mmvl.engine.local_sgd import LocalSGD
from mmvl.engine.nested import gather, gather_object, synchronize_rng_states
from mmvl.engine.plugins import DataLoaderConfiguration, GradientAccumulationPlugin, GradientState
from mmvl.engine.process import AcceleratorState
from mmvl.engine.shards import SeedableRandomSampler
from mmvl.engine.prepared import DeviceLoader, PreparedOptimizer, PreparedScheduler
from mmvl.engine.state import load_sharded, save_sharded

#: Accelerate's name for the Engine: ``from mmvl.engine import Accelerator`` ports a script unchanged
Accelerator = Engine

__all__ = ["Accelerator", "AcceleratorState", "DataLoaderConfiguration", "DeviceLoader", "DistributedType", "Engine",
           "GradientAccumulationPlugin", "GradientState", "LocalSGD", "PreparedOptimizer", "PreparedScheduler",
           "SeedableRandomSampler", "compile_model", "find_executable_batch_size", "gather", "gather_object",
           "load_sharded", "prepare_data_loader", "save_sharded", "set_seed", "synchronize_rng_states"]
