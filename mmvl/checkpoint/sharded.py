"""Sharded checkpoints: a folder of every rank's part, complete only once marked.

Each rank writes its part of model and optimizer (the strategy's ``save_sharded_state``, through
``torch.distributed.checkpoint``); rank 0 then writes the rest of the checkpoint
(:data:`~mmvl.checkpoint.schema.SHARDED_STATE`) and the completion marker of :mod:`mmvl.io`,
which lists each file with its size. A run killed anywhere in between leaves a folder without
the marker: :func:`check_complete` refuses it and the manager skips it. The collective order
(begin on rank 0, parts on every rank, a barrier, finish on rank 0) is the Engine's; this module
only owns the folder's layout.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmvl import io
from mmvl.checkpoint.schema import SHARDED_STATE, stamp
from mmvl.errors import UserError


def begin(directory: str | os.PathLike[str]) -> Path:
    """Rank 0, before any part is written: the folder exists and counts as incomplete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / io.MARKER).unlink(missing_ok=True)
    return directory


def finish(directory: str | os.PathLike[str], extra: Mapping[str, Any] | None, world_size: int) -> Path:
    """Rank 0, after every rank's part is on disk: the rest of the checkpoint, then the marker."""
    directory = Path(directory)
    if extra is not None:
        io.atomic_save(stamp(dict(extra)), directory / SHARDED_STATE)
    return io.mark_complete(directory, world_size=int(world_size))


def problem(directory: str | os.PathLike[str]) -> str | None:
    """Why ``directory`` is not a complete sharded checkpoint, or None when it is."""
    return io.completeness_problem(directory)


def check_complete(directory: str | os.PathLike[str]) -> None:
    """Raise a UserError naming ``directory`` unless it is a complete sharded checkpoint."""
    found = problem(directory)
    if found is not None:
        raise UserError(f"sharded checkpoint {str(directory)!r} is incomplete: {found}; "
                        "resume from an earlier checkpoint.")
