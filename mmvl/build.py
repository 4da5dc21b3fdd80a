"""Registry look-ups that turn a resolved config into objects. One place, no magic."""
from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mmvl import registry
from mmvl.config.access import config_value, plain_dict
from mmvl.config.components import build_component, component_spec
from mmvl.data.base import DatasetBuilder
from mmvl.distributed.comm import is_main_process
from mmvl.errors import UserError
from mmvl.models.base import trainable_summary
from mmvl.adapters import apply_lora

log = logging.getLogger("mmvl")


def dataset_names(config: DictConfig) -> list[str]:
    names = config.datasets
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names or [])
    if not names:
        raise UserError("No dataset chosen; set datasets=<name> (see `mmvl_run --list dataset`).")
    return names


def model_name(config: DictConfig) -> str:
    """The chosen model; a run without ``model=`` is a UserError (not a failed registry look-up)."""
    name = config.get("model")
    if not name:
        known = ", ".join(registry.MODELS.names()) or "none registered"
        raise UserError(f"No model chosen; set model=<name> ({known}; see `mmvl_run --list model`).")
    return str(name)


def build_datasets(config: DictConfig) -> dict[str, DatasetBuilder]:
    """One builder per chosen dataset (not yet prepared); checks first that a model was chosen,
    so a run without one stops before any data is prepared."""
    model_name(config)
    builders = {}
    for name in dataset_names(config):
        cls = registry.DATASETS.get(name)
        ds_config = config.dataset_config.get(name) or OmegaConf.create({})
        builders[name] = cls(ds_config, str(config.env.data_dir))
        builders[name].cache_dir = config_value(config, "env.cache_dir")
    return builders


def model_config(config: DictConfig, builders: dict[str, DatasetBuilder]) -> DictConfig:
    """``model_config.<model>`` with null ``vocab_size``/``num_labels`` filled from the data."""
    name = model_name(config)
    mcfg = OmegaConf.create(plain_dict(config_value(config, f"model_config.{name}")))
    for builder in builders.values():
        info: dict[str, Any] = getattr(builder, "model_info", lambda: {})()
        for key, value in info.items():
            if key in mcfg and mcfg[key] is None:
                mcfg[key] = value
    return mcfg


def build_model(config: DictConfig, builders: dict[str, DatasetBuilder],
                checkpointing: bool = True):
    """The registered model; ``checkpointing=False`` leaves activation checkpointing to the
    strategy (FSDP applies it per shard unit)."""
    name = model_name(config)
    cls = registry.MODELS.get(name)
    model_cfg = model_config(config, builders)
    model = cls(model_cfg)
    adapted = apply_lora(model, model_cfg.get("lora"), name)  # adapters in, their parts' own weights frozen
    freeze_model(model, name, model_cfg.get("freeze"), adapted)
    if config.training.get("gradient_checkpointing"):
        if not model.checkpointable():
            raise UserError(f"training.gradient_checkpointing=true, but model {name} has nothing to recompute (no "
                            "shard_units() and no enable_gradient_checkpointing() of its own); set "
                            "training.gradient_checkpointing=false.")
        if checkpointing:
            model.enable_gradient_checkpointing()
    return model


def freeze_model(model: Any, name: str, parts: Any, adapted: list[str] = ()) -> list[str]:
    """``model_config.<name>.freeze``, before the optimizer and any wrapper see the parameters;
    rank 0 logs how many parameters train."""
    if isinstance(parts, str):
        parts = [parts]
    if parts is not None and not isinstance(parts, (list, tuple, ListConfig)):
        raise UserError(f"model_config.{name}.freeze={parts!r}; give a list of parts, e.g. [text_encoder] "
                        "([] freezes nothing).")
    parts = [str(p) for p in parts or []]
    if parts and not callable(getattr(model, "freeze", None)):
        raise UserError(f"model_config.{name}.freeze={parts}: model {name!r} offers no parts to freeze "
                        "(it does not derive from mmvl.models.BaseModel); set freeze: [].")
    frozen = model.freeze(parts) if parts else []
    if is_main_process() and isinstance(model, torch.nn.Module):
        log.info(trainable_summary(model, frozen, adapted))
    return frozen


def build_callbacks(config: DictConfig, trainer: Any) -> list[tuple[str, Any]]:
    """``(state key, callback)`` for the built-ins of ``training.builtin_callbacks``, then the user's
    ``training.callbacks``, in that order, each from the callback registry.

    A user entry naming a built-in configures it in its place instead of adding a second one; a
    name used twice keys its later instances' state ``name[1]``, ``name[2]``, ...
    """
    builtin = [str(n) for n in config_value(config, "training.builtin_callbacks") or []]
    entries: list[tuple[str, Any, str]] = [(name, name, f"training.builtin_callbacks[{i}]")
                                           for i, name in enumerate(builtin)]
    for i, entry in enumerate(config_value(config, "training.callbacks") or []):
        where = f"training.callbacks[{i}]"
        name, _ = component_spec(entry, where)
        slot = builtin.index(name) if name in builtin and entries[builtin.index(name)][1] == name else None
        if slot is None:
            entries.append((name, entry, where))
        else:
            entries[slot] = (name, entry, where)
    built: list[tuple[str, Any]] = []
    seen: dict[str, int] = {}
    for name, entry, where in entries:
        cls = registry.CALLBACKS.get(name)
        if isinstance(cls, type) and hasattr(cls, "wanted") and not cls.wanted(config):
            continue
        count = seen.get(name, 0)
        seen[name] = count + 1
        key = name if count == 0 else f"{name}[{count}]"
        built.append((key, build_component(registry.CALLBACKS, entry, trainer, where=where)))
    if float(config_value(config, "training.ema.decay") or 0) > 0 and "ema" not in seen:
        raise UserError("training.ema.decay > 0 but the 'ema' callback is in neither training.builtin_callbacks "
                        "nor training.callbacks; add 'ema' (before 'evaluation') or set training.ema.decay=0.")
    return built
