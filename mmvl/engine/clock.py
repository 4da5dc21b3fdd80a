"""What the prepared objects (optimizer, scheduler, loader, checkpointables) read from the Engine,
as structural types. A leaf: it imports no Engine module, so ``prepared``, ``loaders`` and
``state`` type their Engine argument with these instead of importing :mod:`mmvl.engine.core`
back (the Engine imports them; tests/engine/test_engine_imports.py keeps the imports a DAG).
The Engine satisfies each protocol as it is; nothing here holds state of its own.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch


class StepClock(Protocol):
    """The step clock and the process facts a prepared optimizer, scheduler or loader reads:
    whether this micro-step ends an update, whether the gradients are already unscaled, this
    process's rank and device, and the shared gradient/loader settings."""

    rank: int
    world_size: int
    device: torch.device
    prefetch: bool
    is_main_process: bool
    scaler: Any
    grads_unscaled: bool
    gradient_state: Any
    dataloader_config: Any
    prepared_optimizer: Any

    @property
    def sync_gradients(self) -> bool: ...


class CheckpointOwner(Protocol):
    """What the Engine's checkpointables and ``save_checkpoint`` read: the prepared model and
    optimizer, the strategy that owns their state, and the Engine's own save calls."""

    strategy: Any
    prepared_model: Any
    prepared_optimizer: Any
    sharded_checkpoint: bool
    is_main_process: bool

    def state_dict(self, sharded: bool = False) -> dict[str, Any]: ...

    def save_sharded(self, path: Any, extra: Any = None) -> Any: ...
