"""The LR schedule builder and the registered schedules.

Schedulers are ``LambdaLR``s stepped once per update, so their state dict is plain numbers and
survives ``weights_only`` checkpoint loading. The builder takes its typed section
(:class:`mmvl.config.schema.Scheduler`), never the whole config.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from mmvl.config import schema
from mmvl.config.components import bind_params, component_spec
from mmvl.distributed.comm import is_main_process
from mmvl.errors import UserError
from mmvl.optim.sections import require_section
from mmvl.registry import SCHEDULERS, register_scheduler

log = logging.getLogger("mmvl")


def _warmup_factor(step: int, num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float,
                   shape: str) -> float:
    """LR multiplier after ``step`` updates: linear warmup 0 -> 1, then decay to ``min_lr_ratio``."""
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    if shape == "constant":
        return 1.0
    progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
    decay = 1.0 - progress if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def _as_int(value: Any) -> Any:
    """1e3 from YAML is a float; accept integral floats as step counts."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _check_schedule(name: str, num_warmup_steps: Any, num_training_steps: Any,
                    min_lr_ratio: Any) -> tuple[int, int | None, float]:
    """Validate and normalise schedule parameters."""
    num_warmup_steps, num_training_steps = _as_int(num_warmup_steps), _as_int(num_training_steps)
    if not isinstance(num_warmup_steps, int) or num_warmup_steps < 0:
        raise UserError(f"scheduler {name!r}: scheduler.params.num_warmup_steps must be an int >= 0, "
                        f"got {num_warmup_steps!r}.")
    if num_training_steps is not None and (not isinstance(num_training_steps, int) or num_training_steps <= 0):
        raise UserError(f"scheduler {name!r}: scheduler.params.num_training_steps must be an int > 0 (or set "
                        f"training.max_updates), got {num_training_steps!r}.")
    if num_training_steps is not None and num_warmup_steps > num_training_steps:
        raise UserError(f"scheduler {name!r}: num_warmup_steps={num_warmup_steps} exceeds "
                        f"num_training_steps={num_training_steps}; lower the warmup.")
    if not isinstance(min_lr_ratio, (int, float)) or not 0.0 <= float(min_lr_ratio) <= 1.0:
        raise UserError(f"scheduler {name!r}: scheduler.params.min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}.")
    return num_warmup_steps, num_training_steps, float(min_lr_ratio)


def _lambda_lr(optimizer: torch.optim.Optimizer, shape: str, num_warmup_steps: int, num_training_steps: int,
               min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    fn = functools.partial(_warmup_factor, num_warmup_steps=num_warmup_steps,
                           num_training_steps=num_training_steps, min_lr_ratio=float(min_lr_ratio), shape=shape)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


@register_scheduler("warmup_linear")
def warmup_linear(optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int,
                  min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup for ``num_warmup_steps``, then linear decay to ``min_lr_ratio * lr``."""
    return _lambda_lr(optimizer, "linear", *_check_schedule("warmup_linear", num_warmup_steps,
                                                           num_training_steps, min_lr_ratio))


@register_scheduler("warmup_cosine")
def warmup_cosine(optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int,
                  min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then half-cosine decay to ``min_lr_ratio * lr`` at ``num_training_steps``."""
    return _lambda_lr(optimizer, "cosine", *_check_schedule("warmup_cosine", num_warmup_steps,
                                                           num_training_steps, min_lr_ratio))


@register_scheduler("constant")
def constant(optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Constant lr, optionally after a linear warmup."""
    warmup, _, _ = _check_schedule("constant", num_warmup_steps, None, 0.0)
    return _lambda_lr(optimizer, "constant", warmup, 1, 0.0)


def _clamp_warmup(params: dict[str, Any]) -> None:
    """A warm-up longer than the run (e.g. a smoke test with ``training.max_updates=50``) is clamped
    to the run's length, with a warning from rank 0: the run goes ahead instead of stopping."""
    warmup, steps = _as_int(params.get("num_warmup_steps", 0)), params["num_training_steps"]
    if isinstance(warmup, int) and isinstance(steps, int) and warmup > steps > 0:
        if is_main_process():
            log.warning("scheduler.params.num_warmup_steps=%d is longer than this run (%d updates): warm-up "
                        "clamped to %d, so the lr rises for the whole run. Set num_warmup_steps to at most %d "
                        "to silence this.", warmup, steps, steps, steps)
        params["num_warmup_steps"] = steps


def build_scheduler(optimizer: torch.optim.Optimizer, section: schema.Scheduler | None,
                    max_updates: int | None = None) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Build the schedule ``section`` describes; None when it has no ``type`` (or is None).

    ``num_training_steps`` defaults to ``max_updates`` (the run's length, e.g. the trainer's
    count derived from ``training.max_epochs``) when the scheduler takes it and the section
    leaves it null; a longer warm-up is then clamped to it (with a warning).
    """
    if section is not None:
        require_section(section, schema.Scheduler, "build_scheduler")
    if section is None or section.type is None:
        return None
    name, params = component_spec({"type": section.type, "params": section.params}, "scheduler")
    derived: list[bool] = []

    def run_length() -> int:
        if max_updates is None:
            raise UserError(f"scheduler {name!r} needs scheduler.params.num_training_steps or training.max_updates.")
        derived.append(True)  # num_training_steps is the run's length: a longer warm-up is clamped
        return _as_int(max_updates)

    factory = SCHEDULERS.get(name)
    params = bind_params(factory, params, (optimizer,), kind="scheduler", name=name, where="scheduler",
                         defaults={"num_training_steps": run_length})
    if derived:
        _clamp_warmup(params)
    return factory(optimizer, **params)
