"""Activation checkpointing of whole sub-modules: each one's activations are dropped after its
forward and recomputed in backward (torch's composable ``checkpoint``, which works on a plain
module in one process and on an FSDP2 unit alike, so the two place it on the same modules)."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def checkpoint_each(modules: Iterable[torch.nn.Module]) -> int:
    """Checkpoint every module of ``modules`` on its own; returns how many (a module already
    checkpointed is left as it is)."""
    from torch.distributed._composable import checkpoint

    count = 0
    for module in modules:
        if not is_checkpointed(module):
            checkpoint(module)
        count += 1
    return count


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether ``module`` is under composable activation checkpointing."""
    from torch.distributed._composable.contract import _get_registry

    return "checkpoint" in (_get_registry(module) or {})
