"""What a resume does to an optimizer and its schedule beyond ``load_state_dict``: keep the
implementation the config built (fused or foreach), and take the config's hyper-parameters after
``checkpoint.reset.*``."""
from __future__ import annotations

from typing import Any

import torch

from mmvl.optim.optimizers import IMPLEMENTATION_KEYS


def _optimizer_layers(optimizer: Any) -> list[Any]:
    """``optimizer`` and, for a wrapper (ZeRO), the torch optimizer it holds as ``optim``."""
    held = getattr(optimizer, "optim", None)
    return [optimizer] + ([held] if isinstance(held, torch.optim.Optimizer) else [])


def implementation_of(optimizer: Any) -> list[list[dict[str, Any]]]:
    """The implementation keys of every param group, of ``optimizer`` and of the optimizer a
    wrapper holds (ZeRO's ``optim``), to restore with :func:`restore_implementation`."""
    return [[{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in o.param_groups]
            for o in _optimizer_layers(optimizer)]


def restore_implementation(optimizer: Any, saved: list[list[dict[str, Any]]]) -> None:
    """After ``load_state_dict``: the groups keep the implementation they were built with. torch
    takes every group key from the checkpoint, so a state saved unfused (an older run, another
    device) would turn off a fused optimizer that GradScaler still hands the scale to, and fail."""
    for layer, groups in zip(_optimizer_layers(optimizer), saved):
        for group, keys in zip(layer.param_groups, groups):
            group.update(keys)


def adopt_config_hyperparameters(optimizer: Any, scheduler: Any, fresh_groups: list[dict[str, Any]],
                                 kept_optimizer: bool, kept_scheduler: bool) -> None:
    """After a resume with ``checkpoint.reset.*``: the run goes on under the config's settings.

    ``fresh_groups`` are the param-group hyper-parameters the config built (captured before the
    checkpoint was loaded); a kept optimizer state takes them over its saved ones (its moments
    stay). A kept schedule takes the config's base lrs at its saved position; a reset one starts
    at its beginning. Either way each group's lr is the schedule's value now, so the first update
    after the resume already uses it.
    """
    if kept_optimizer:
        for group, fresh in zip(optimizer.param_groups, fresh_groups):
            group.update(fresh)
    if scheduler is None:
        return
    scheduler = getattr(scheduler, "scheduler", scheduler)  # the Engine's wrapper: set the schedule itself
    if kept_scheduler and "initial_lr" in optimizer.param_groups[0]:
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler._last_lr = [base * fn(scheduler.last_epoch)
                                  for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
