"""Optimizer and LR scheduler builders.

``optimizer: {type, params, lr_scaling}`` builds a registered optimizer (or any
``torch.optim`` class by name, case-insensitive). Weight decay goes only to
weight matrices: biases and the parameters of normalisation layers (LayerNorm,
GroupNorm, BatchNorm, RMSNorm, anything whose class name contains "Norm") land
in a ``no_decay`` group with ``weight_decay=0``, as in BERT-style training and
MMF's transformer models. Embedding tables do decay (also the BERT convention).
A model's ``lr_multipliers()`` (parameter-name prefix -> factor) puts those
parameters in groups whose lr is the base lr times the factor (e.g. a pretrained
text encoder at 0.1x); a model that needs its own grouping altogether defines
``get_optimizer_parameters(config) -> list[param group dict]``. The config adds names that never
decay (``optimizer.no_weight_decay``: ``logit_scale``, ``logit_bias``), per-part learning rates
(``optimizer.param_groups``) and layer-wise lr decay (``optimizer.layer_decay``): see
:mod:`mmvl.optim.groups`. Frozen parameters
(``requires_grad=False``, e.g. ``model_config.<model>.freeze``) join no group, so they hold no
optimizer state. Adam, AdamW and SGD get torch's fused implementation by default wherever torch
has it (:func:`implementation_default`): under fp16 the grad scaler then skips a non-finite
update inside the kernel instead of reading a flag back every update.

Schedulers are ``LambdaLR``s stepped once per update, so their state dict is
plain numbers and survives ``weights_only`` checkpoint loading.

Both builders take their typed section (:class:`mmvl.config.schema.Optimizer`,
:class:`mmvl.config.schema.Scheduler`), never the whole config: :func:`optimizer_section` and
:func:`scheduler_section` read them from a config.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from mmvl.config import schema
from mmvl.config.components import bind_params, component_spec
from mmvl.config.schema import LR_SCALINGS
from mmvl.errors import UserError, did_you_mean
from mmvl.optim.groups import NO_DECAY_NAMES, param_groups
from mmvl.registry import OPTIMIZERS, SCHEDULERS, register_optimizer, register_scheduler

log = logging.getLogger("mmvl")

register_optimizer("adam_w", torch.optim.AdamW)
register_optimizer("adam", torch.optim.Adam)
register_optimizer("sgd", torch.optim.SGD)

#: global batch size at which the configured lr is used unchanged
LR_SCALING_BASE_BATCH_SIZE = 256


def trainable_only(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A model's own param groups without its frozen parameters (``requires_grad=False``): they
    must hold no optimizer state; groups left empty are dropped."""
    out = []
    for group in groups:
        given = group["params"]
        params = [p for p in ([given] if isinstance(given, torch.Tensor) else given) if p.requires_grad]
        if params:
            out.append({**group, "params": params})
    return out


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The current lr of the model's main parameters (groups with an ``lr_multiplier`` scaled back)."""
    for group in optimizer.param_groups:
        if "lr_multiplier" not in group:
            return float(group["lr"])
    group = optimizer.param_groups[0]
    return float(group["lr"]) / float(group["lr_multiplier"])


def _lr_multipliers(model: torch.nn.Module) -> dict[str, float]:
    """The single-device model's ``lr_multipliers()``, looked up through parallel wrappers."""
    inner = model
    while not callable(getattr(inner, "lr_multipliers", None)) and isinstance(getattr(inner, "module", None),
                                                                            torch.nn.Module):
        inner = inner.module
    get = getattr(inner, "lr_multipliers", None)
    return dict(get()) if callable(get) else {}


def scaled_lr(base_lr: float, scaling: str | None, global_batch_size: int | None) -> float:
    """``linear``: lr * B / 256; ``sqrt``: lr * sqrt(B / 256); None: unchanged."""
    if scaling in (None, "none", "null"):
        return base_lr
    if scaling not in LR_SCALINGS:
        raise UserError(f"optimizer.lr_scaling={scaling!r} is unknown.{did_you_mean(str(scaling), LR_SCALINGS)} "
                        f"Use one of {list(LR_SCALINGS)} or null.")
    if not global_batch_size or int(global_batch_size) <= 0:
        raise UserError(f"optimizer.lr_scaling={scaling!r} needs training.batch_size (global) > 0, "
                        f"got {global_batch_size!r}.")
    ratio = int(global_batch_size) / LR_SCALING_BASE_BATCH_SIZE
    return base_lr * (ratio if scaling == "linear" else math.sqrt(ratio))


#: torch optimizers with a fused kernel (one kernel for every parameter, and an fp16 step that
#: skips non-finite updates on the device: torch's GradScaler hands it the scale and the flag)
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
#: the keys that pick an optimizer's implementation, not its numbers: the config's choice, never a checkpoint's
IMPLEMENTATION_KEYS = ("fused", "foreach")
_fallback_logged: set[str] = set()


def fused_supported(device: torch.device | str) -> bool:
    """Whether this torch has fused optimizer kernels for ``device`` (CUDA always; the CPU since 2.4)."""
    kind = torch.device(device).type
    supported = getattr(importlib.import_module("torch.optim.optimizer"), "_get_fused_kernels_supported_devices", None)
    return kind in (supported() if callable(supported) else ("cuda",))


def implementation_default(factory: Any, device: torch.device | str | None,
                           params: Mapping[str, Any]) -> dict[str, bool] | None:
    """``{"fused": True}`` for Adam/AdamW/SGD on a device torch has their fused kernel for, unless
    ``optimizer.params`` picks an implementation (``fused``, ``foreach``) or needs the plain one
    (``differentiable``); ``{"foreach": True}`` (logged once) where the device lacks it."""
    if device is None or not (isinstance(factory, type) and issubclass(factory, FUSED_OPTIMIZERS)):
        return None
    if any(params.get(k) is not None for k in IMPLEMENTATION_KEYS) or params.get("differentiable"):
        return None
    if fused_supported(device):
        return {"fused": True}
    kind = torch.device(device).type
    if kind not in _fallback_logged:
        _fallback_logged.add(kind)
        log.info("torch %s has no fused %s kernel on %s: the foreach implementation is used (under fp16 "
                 "it reads the scaler's finite-gradient flag every update, a host-device sync)",
                 torch.__version__, factory.__name__, kind)
    return {"foreach": True}


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


def _raw_section(config: Any, name: str) -> Any:
    """``config[name]`` as written (a DictConfig, plain dicts or None), before any schema default."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def optimizer_section(config: Any) -> schema.Optimizer:
    """The typed ``optimizer`` section of ``config``. Its ``type`` must be written there: the
    schema's default (adam_w) never stands in for a missing one. Absent ``params`` are none (the
    schema's default params are adam_w's); other absent fields take the schema's defaults."""
    raw = _raw_section(config, "optimizer")
    if not isinstance(raw, Mapping) or not raw.get("type"):
        raise UserError("config has no optimizer.type; set e.g. `optimizer: {type: adam_w, params: {lr: 1e-4}}`.")
    typed = schema.section(config, "optimizer")
    return typed if "params" in raw else dataclasses.replace(typed, params={})


def scheduler_section(config: Any) -> schema.Scheduler:
    """The typed ``scheduler`` section of ``config``; ``type`` None when the config has no scheduler
    (absent, null, ``{}`` or a null type: never the schema's default schedule)."""
    raw = _raw_section(config, "scheduler")
    if raw is None or (isinstance(raw, Mapping) and raw.get("type") is None):
        return schema.Scheduler(type=None, params={})
    name, params = component_spec(raw, "scheduler")  # a bare name too; unknown keys refused
    if not isinstance(raw, Mapping):
        return schema.Scheduler(type=name, params=params)
    typed = schema.section(config, "scheduler")
    return typed if "params" in raw else dataclasses.replace(typed, params={})


def build_optimizer(model: torch.nn.Module, section: schema.Optimizer, device: torch.device | str | None = None,
                    *, batch_size: int | None = None, config: Any = None) -> torch.optim.Optimizer:
    """Build the optimizer ``section`` describes for ``model`` (already wrapped or not), which will
    train on ``device``. ``batch_size``: the global one ``lr_scaling`` scales by; ``config``: the
    whole config, only handed to a model's own ``get_optimizer_parameters(config)`` (MMF's hook)."""
    if not isinstance(section, schema.Optimizer):
        raise TypeError(f"build_optimizer takes the typed optimizer section (mmvl.optim.optimizer_section(config)), "
                        f"got {type(section).__name__}")
    if not section.type:
        raise UserError("config has no optimizer.type; set e.g. `optimizer: {type: adam_w, params: {lr: 1e-4}}`.")
    name, params = component_spec({"type": section.type, "params": section.params}, "optimizer")
    factory = OPTIMIZERS.get(name)
    params = bind_params(factory, {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()},
                         (None,), kind="optimizer", name=name, where="optimizer",
                         defaults=implementation_default(factory, device, params))
    if "lr" in params:
        params["lr"] = scaled_lr(float(params["lr"]), section.lr_scaling, batch_size)
    elif section.lr_scaling not in (None, "none", "null"):
        raise UserError("optimizer.lr_scaling is set but optimizer.params.lr is missing; give a base lr.")

    custom = getattr(model, "get_optimizer_parameters", None)
    layer_decay = 1.0 if section.layer_decay is None else float(section.layer_decay)
    if callable(custom):
        if section.param_groups or layer_decay != 1.0:
            raise UserError(f"{type(model).__name__} makes its own parameter groups (get_optimizer_parameters), so "
                            "optimizer.param_groups and optimizer.layer_decay would be ignored; unset them.")
        groups = trainable_only(custom(config))
    else:
        no_decay = section.no_weight_decay
        groups = param_groups(model, params.get("weight_decay"), _lr_multipliers(model), section.param_groups,
                              NO_DECAY_NAMES if no_decay is None else list(no_decay),
                              layer_decay, params.get("lr"))
        if any("lr_multiplier" in g for g in groups) and "lr" not in params:
            raise UserError("per-part learning rates (the model's lr_multipliers, optimizer.param_groups or "
                            "optimizer.layer_decay) need optimizer.params.lr; give a base lr.")
    if not groups:
        raise UserError(f"optimizer {name!r}: the model has no trainable parameters; freeze fewer parts "
                        "(model_config.<model>.freeze) or check the image encoder's freeze flag.")
    try:
        return factory(groups, **params)
    except (TypeError, ValueError) as e:
        text = str(e).lower()
        hinted = [key for phrase, key in _ERROR_HINTS.items() if phrase in text and key in params]
        bad = hinted or [k for k in params if k.lower() in text]
        where = f"optimizer.params.{bad[0]}={params[bad[0]]!r}" if bad else f"optimizer.params={params}"
        raise UserError(f"optimizer {name!r} rejected {where}: {e}") from None


#: words in torch.optim's ValueErrors -> the params key they are about
_ERROR_HINTS = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "weight_decay": "weight_decay",
                "momentum": "momentum", "dampening": "dampening", "alpha": "alpha"}


# ---------------------------------------------------------------- schedulers


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
    from mmvl.distributed.comm import is_main_process

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
    if section is not None and not isinstance(section, schema.Scheduler):
        raise TypeError(f"build_scheduler takes the typed scheduler section (mmvl.optim.scheduler_section(config)), "
                        f"got {type(section).__name__}")
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
