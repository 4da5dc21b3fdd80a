"""The checkpoint's schema: its key names, its files' names, and how earlier layouts are read.

A checkpoint is a plain dict of state dicts holding only tensors and Python builtins, so it loads
with ``weights_only=True`` and a downloaded file can never run code (numpy RNG state is stored as
a tensor or list, the config as a plain container). Its top-level keys are the names of the
checkpointables that made it (:class:`mmvl.checkpoint.Checkpointables`); the built-in ones are
defined here and nowhere else:

======================  ===========================================================================
``model``               the model's state dict (full tensors; a sharded checkpoint keeps it in parts)
``optimizer``           the optimizer's state dict (torch's integer-indexed form)
``scaler``              the fp16 grad scaler's state (fp16 runs only)
``scheduler``           the LR scheduler's state
``trainer``             the loop's counters: ``update``, ``world_size``, ``best_value``, ``best_update``
``data``                the training stream's position (epoch, batch; multi-dataset state)
``rng``                 one RNG state per rank (python, numpy, torch, CUDA)
``callbacks``           each callback's state, by name
``ema``                 the model EMA (``training.ema.decay`` > 0): ``decay``, ``updates`` and ``weights``
                        (the averaged tensors by the unwrapped model's state-dict names)
``local_sgd``           an open ``LocalSGD`` block's step count and every rank's parameters and
                        optimizer state (they differ between averages; :mod:`mmvl.engine.local_sgd`)
``config``              the resolved config the run was started with (a plain container)
``format``              :data:`FORMAT_VERSION` (absent in checkpoints of mmvl before it: version 1)
======================  ===========================================================================

Files under ``<save_dir>/checkpoints/``: ``model_<update>.ckpt`` (periodic), ``last.ckpt``,
``best.ckpt``, and ``sharded_<update>/`` folders (each rank's part, :data:`SHARDED_STATE`, the
completion marker of :mod:`mmvl.io`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MODEL = "model"
OPTIMIZER = "optimizer"
SCALER = "scaler"
SCHEDULER = "scheduler"
TRAINER = "trainer"
DATA = "data"
RNG = "rng"
CALLBACKS = "callbacks"
#: only in runs with the model EMA on (loaded after :data:`KEYS`, which every trainer's checkpoint has)
EMA = "ema"
#: only while a ``LocalSGD`` block is open (loaded after the model and optimizer it overrides per rank)
LOCAL_SGD = "local_sgd"
#: entries whose owner may be made after a load (a ``LocalSGD`` block opened after ``load_state``): a
#: load keeps them until that owner claims them (:meth:`mmvl.checkpoint.Checkpointables.claim`)
LATE_KEYS = (LOCAL_SGD,)
CONFIG = "config"
FORMAT = "format"
#: the built-in keys in the order they are loaded (the model before the optimizer that refers to it)
KEYS = (MODEL, OPTIMIZER, SCALER, SCHEDULER, TRAINER, DATA, RNG, CALLBACKS, CONFIG)
#: what a sharded checkpoint keeps in its parts instead of its :data:`SHARDED_STATE`
SHARDED_KEYS = (MODEL, OPTIMIZER)
#: counters under :data:`TRAINER`
UPDATE = "update"
WORLD_SIZE = "world_size"
#: the best validation value and its update under :data:`TRAINER` (absent before mmvl kept them
#: there: such checkpoints hold them in the ``early_stop`` callback's state)
BEST_VALUE = "best_value"
BEST_UPDATE = "best_update"

#: 2: this layout with its ``format`` key; 1: the same keys without it (mmvl before issue 18)
FORMAT_VERSION = 2

#: ``Engine.prepare``'s loaders (``dataloader_<i>``, their positions) and ``register_for_checkpointing``'s
#: objects (``custom_<i>``), in the order they were prepared / registered
LOADER = "dataloader"
CUSTOM = "custom"
#: the file inside a ``save_state`` folder
ENGINE_STATE = "engine_state.ckpt"

CHECKPOINTS_DIR = "checkpoints"
LAST = "last.ckpt"
BEST = "best.ckpt"
#: the rest of a trainer's checkpoint inside a sharded folder (all but model and optimizer)
SHARDED_STATE = "state.ckpt"
PERIODIC = re.compile(r"^model_(\d+)\.ckpt$")
SHARDED = re.compile(r"^sharded_(\d+)$")


def periodic_name(update: int) -> str:
    return f"model_{int(update)}.ckpt"


def loader_name(index: int) -> str:
    return f"{LOADER}_{int(index)}"


def custom_name(index: int) -> str:
    return f"{CUSTOM}_{int(index)}"


def sharded_name(update: int) -> str:
    return f"sharded_{int(update)}"


def update_of(state: Mapping[str, Any], default: int = -1) -> int:
    """The update a checkpoint was written at (``default`` when it has no counters)."""
    return int((state.get(TRAINER) or {}).get(UPDATE, default))


def world_size_of(state: Mapping[str, Any], default: int) -> int:
    """The number of processes of the run that wrote the checkpoint."""
    return int((state.get(TRAINER) or {}).get(WORLD_SIZE, default))


def stamp(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with this layout's :data:`FORMAT` key (what every writer saves)."""
    state[FORMAT] = FORMAT_VERSION
    return state


def upgrade(state: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded checkpoint in today's layout, whatever mmvl version wrote it.

    Version 1 (no ``format`` key) has today's keys already; a newer version than this mmvl
    knows is read as far as its keys are known (the loaders ignore the rest).
    """
    state = dict(state)
    state.setdefault(FORMAT, 1)
    return state
