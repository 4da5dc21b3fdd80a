"""The one precision table: ``training.precision`` names and the compute dtype each means.

Validation lists the names from here, the Engine's autocast and FSDP's mixed
precision take the dtype from here. torch is imported only when a dtype is
asked for, so config validation stays light.
"""
from __future__ import annotations

from typing import Any

from mmvl.errors import UserError

#: ``training.precision`` -> the low-precision compute dtype's name in ``torch`` (None: full fp32)
PRECISIONS: dict[str, str | None] = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}


def compute_dtype(name: Any) -> Any:
    """The ``torch.dtype`` of precision ``name`` (``None`` for fp32); a UserError for other names."""
    if name not in PRECISIONS:
        raise UserError(f"training.precision={name!r} is not one of {', '.join(PRECISIONS)}.")
    dtype = PRECISIONS[name]
    if dtype is None:
        return None
    import torch

    return getattr(torch, dtype)
