"""The names Accelerate users reach for, on the Engine itself (``Accelerator`` *is* the Engine).

A script written for ``accelerate.Accelerator`` runs on mmvl once its ``from accelerate ...``
lines import the same names from :mod:`mmvl.engine`. Each member here is the Engine's own
behaviour under Accelerate's name and meaning; where mmvl deliberately differs, the member
raises a :class:`UserError` that says how to write it for mmvl. ``docs/engine.md`` lists every
``Accelerator`` member: supported, or not and why.
"""
from __future__ import annotations

import enum
import functools
import gc
import inspect
import os
import re
from typing import Any, Callable

import torch

from mmvl.distributed import comm
from mmvl.distributed.launch_script import ACCUMULATION_ENV, MIXED_PRECISION_ENV
from mmvl.errors import UserError
from mmvl.utils.rng import seed_everything

#: Accelerate's ``mixed_precision`` names -> mmvl's ``training.precision`` names
MIXED_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


class DistributedType(str, enum.Enum):
    """How the run is distributed, under Accelerate's names (compared with ``==``, as in its scripts)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    XLA = "XLA"
    MULTI_NPU = "MULTI_NPU"
    MULTI_XPU = "MULTI_XPU"


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch; ``device_specific`` adds the rank (each rank its own draws)."""
    seed_everything(seed, comm.get_rank() if device_specific else 0)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and bool(
        re.search(r"out of memory|can't allocate memory|CUDNN_STATUS_NOT_SUPPORTED", str(error)))


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorator: call ``function(batch_size, *args, **kwargs)``; after each out-of-memory error the
    batch size becomes ``int(0.9 * batch_size)`` (Accelerate's rule) or ``reduce_batch_size_fn()``,
    until a call succeeds (a RuntimeError when it reaches zero)."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    params = list(inspect.signature(function).parameters)
    if not params:
        raise UserError(f"find_executable_batch_size: {function.__name__}() must take the batch size as its "
                        "first argument, e.g. def inner_training_loop(batch_size): ...")

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        if len(args) >= len(params) or params[0] in kwargs:
            raise UserError(f"{function.__name__}() is given its batch size by find_executable_batch_size; call "
                            f"it without it: {function.__name__}({', '.join(params[1:])}).")
        while True:
            if batch_size < 1:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - only out-of-memory errors are retried
                if not _out_of_memory(e):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = int(reduce_batch_size_fn()) if reduce_batch_size_fn else int(batch_size * 0.9)

    return run


def accelerate_keywords(*, precision: str | None, gradient_accumulation: int | None, mixed_precision: str | None,
                        gradient_accumulation_steps: int | None, cpu: bool,
                        device: Any) -> tuple[str | None, int | None, Any]:
    """Accelerate's constructor keywords as mmvl's settings: ``(precision, gradient_accumulation, device)``.

    Each is the same setting under a second name; two values of one setting are refused.
    """
    if mixed_precision is not None:
        if mixed_precision not in MIXED_PRECISION:
            raise UserError(f"Engine(mixed_precision={mixed_precision!r}) is not one of "
                            f"{', '.join(MIXED_PRECISION)} (fp8 is not supported).")
        named = MIXED_PRECISION[mixed_precision]
        if precision is not None and precision != named:
            raise UserError(f"Engine(precision={precision!r}, mixed_precision={mixed_precision!r}) name one "
                            "setting twice with different values; pass one of them.")
        precision = named
    if gradient_accumulation_steps is not None:
        if gradient_accumulation is not None and int(gradient_accumulation) != int(gradient_accumulation_steps):
            raise UserError(f"Engine(gradient_accumulation={gradient_accumulation}, gradient_accumulation_steps="
                            f"{gradient_accumulation_steps}) name one setting twice; pass one of them.")
        gradient_accumulation = gradient_accumulation_steps
    if cpu:
        if device is not None and torch.device(device).type != "cpu":
            raise UserError(f"Engine(cpu=True, device={device!r}) contradict each other; pass one of them.")
        device = "cpu"
    return precision, gradient_accumulation, device


def launched_precision() -> str | None:
    """The precision ``mmvl_launch --mixed_precision`` (or its config file) chose for this process,
    as mmvl names it; None when it was not launched so."""
    value = os.environ.get(MIXED_PRECISION_ENV)
    if not value:
        return None
    if value not in MIXED_PRECISION:
        raise UserError(f"{MIXED_PRECISION_ENV}={value!r} is not one of {', '.join(MIXED_PRECISION)}; "
                        "fix mmvl_launch --mixed_precision or its config file.")
    return MIXED_PRECISION[value]


def launched_accumulation() -> int | None:
    """The accumulation ``mmvl_launch --gradient_accumulation_steps`` (or its config file) chose for
    this process; None when it was not launched so."""
    value = os.environ.get(ACCUMULATION_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{ACCUMULATION_ENV}={value!r} is not a whole number >= 1; fix mmvl_launch "
                        "--gradient_accumulation_steps or its config file.")
    return int(value)


def to_fp32(value: Any) -> Any:
    """``value`` with every half-precision tensor inside it cast to fp32 (dicts changed in place,
    so model output classes keep their type)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = to_fp32(value[key])
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_fp32(v) for v in value)
    return value


def autocast_forward(engine: Any, model: torch.nn.Module) -> None:
    """Run ``model``'s forward under the Engine's autocast, floating outputs back in fp32 (as
    Accelerate's ``prepare`` does, so scripts without ``autocast()`` train in mixed precision)."""
    forward = model.forward
    if getattr(forward, "_mmvl_autocast", False):
        return

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with engine.autocast():
            out = forward(*args, **kwargs)
        return to_fp32(out)

    run._mmvl_autocast = True  # type: ignore[attr-defined]
    model.forward = run  # type: ignore[method-assign]
