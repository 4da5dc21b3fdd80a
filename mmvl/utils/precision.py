"""The one precision table: ``training.precision`` names and the compute dtype each means, and
``training.matmul_precision`` (TF32 for fp32 matrix products).

Validation lists the names from here, the Engine's autocast and FSDP's mixed
precision take the dtype from here. torch is imported only when a dtype is
asked for, so config validation stays light.
"""
from __future__ import annotations

import logging
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


#: ``training.matmul_precision``: ``auto`` is ``high`` (TF32 matrix products) on CUDA and leaves
#: the CPU alone; the others are torch's ``set_float32_matmul_precision`` values, on any device
MATMUL_PRECISIONS = ("auto", "highest", "high", "medium")


def matmul_precision(setting: Any, device_type: str) -> str | None:
    """The float32 matmul precision ``setting`` means on ``device_type`` (None: leave torch's)."""
    if setting not in MATMUL_PRECISIONS:
        raise UserError(f"training.matmul_precision={setting!r} is not one of {', '.join(MATMUL_PRECISIONS)}.")
    if setting == "auto":
        return "high" if device_type == "cuda" else None
    return str(setting)


def apply_matmul_precision(setting: Any, device_type: str, announce: bool = False) -> str | None:
    """Set torch's float32 matmul precision as ``setting`` resolves on ``device_type`` (logged when
    ``announce``: rank 0); returns it."""
    resolved = matmul_precision(setting, device_type)
    if resolved is not None:
        import torch

        torch.set_float32_matmul_precision(resolved)
        if announce:
            logging.getLogger("mmvl").info("fp32 matrix products on %s: float32 matmul precision %s "
                                           "(training.matmul_precision=%s)", device_type, resolved, setting)
    return resolved
