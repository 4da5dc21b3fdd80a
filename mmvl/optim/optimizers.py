"""The optimizer builder: registered optimizers, lr scaling, param groups and the fused default.

``optimizer: {type, params, lr_scaling}`` builds a registered optimizer (or any
``torch.optim`` class by name, case-insensitive). Weight decay goes only to
weight matrices: biases and the parameters of normalisation layers (LayerNorm,
GroupNorm, BatchNorm, RMSNorm, anything whose class name contains "Norm") land
in a ``no_decay`` group with ``weight_decay=0``, as in BERT-style training and
MMF's transformer models. Embedding tables do decay (also the BERT convention).
A model's ``lr_multipliers()`` (parameter-name prefix -> factor) puts those
parameters in groups whose lr is the base lr times the factor (e.g. a pretrained
text encoder at 0.1x); a model that needs its own grouping altogether defines
``get_optimizer_parameters(section) -> list[param group dict]`` (handed the typed optimizer
section). The config adds names that never decay (``optimizer.no_weight_decay``:
``logit_scale``, ``logit_bias``), per-part learning rates (``optimizer.param_groups``) and
layer-wise lr decay (``optimizer.layer_decay``): see :mod:`mmvl.optim.groups`. Frozen parameters
(``requires_grad=False``, e.g. ``model_config.<model>.freeze``) join no group, so they hold no
optimizer state. Adam, AdamW and SGD get torch's fused implementation by default wherever torch
has it (:func:`implementation_default`): under fp16 the grad scaler then skips a non-finite
update inside the kernel instead of reading a flag back every update.

It takes its typed section (:class:`mmvl.config.schema.Optimizer`), never the whole config.
"""
from __future__ import annotations

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
from mmvl.optim.sections import require_optimizer_type, require_section
from mmvl.registry import OPTIMIZERS, register_optimizer

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


def build_optimizer(model: torch.nn.Module, section: schema.Optimizer, device: torch.device | str | None = None,
                    *, batch_size: int | None = None) -> torch.optim.Optimizer:
    """Build the optimizer ``section`` describes for ``model`` (already wrapped or not), which will
    train on ``device``. ``batch_size``: the global one ``lr_scaling`` scales by. A model's own
    ``get_optimizer_parameters(section)`` (MMF's hook) is handed this section, not the whole config."""
    require_section(section, schema.Optimizer, "build_optimizer")
    require_optimizer_type(section.type)
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
        groups = trainable_only(custom(section))
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
