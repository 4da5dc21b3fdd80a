"""Checkpoints: the schema (key names, file names, earlier layouts), the manager of a run's
``checkpoints/`` folder, sharded checkpoints, named checkpointables and pretrained key maps.

Atomic writing and safe loading are :mod:`mmvl.io`'s; who saves when is the checkpoint
callback's; the collective order of a save (which rank writes what, when all agree) is the
Engine's. This package imports nothing from ``mmvl.data``, ``mmvl.config`` or
``mmvl.distributed``: strategies hand it state dicts and it hands them back.
"""
from mmvl.checkpoint import schema, sharded
from mmvl.checkpoint.checkpointables import Checkpointables, State
from mmvl.checkpoint.manager import CheckpointManager, load_checkpoint
from mmvl.checkpoint.pretrained import apply_state_mapping, canonical_key, load_model_state, match_model_state

__all__ = ["Checkpointables", "CheckpointManager", "State", "apply_state_mapping", "canonical_key",
           "load_checkpoint", "load_model_state", "match_model_state", "schema", "sharded"]
