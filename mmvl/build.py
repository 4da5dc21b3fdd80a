"""Registry look-ups that turn a run's sections into objects. One place, no magic.

Each builder takes its own section: :func:`datasets_from` the chosen names, their
``dataset_config.<name>`` sections and the typed ``env``; :func:`model_from` the model's name and
its ``model_config.<model>`` section (:class:`ModelSection`); :func:`build_callbacks` the typed
sections callbacks read. ``build_datasets(config)``, ``model_config(config, ...)`` and
``build_model(config, ...)`` stay for scripts and tests, and split the config at their door.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mmvl import registry
from mmvl.adapters import apply_lora
from mmvl.config.access import plain_dict
from mmvl.config.schema import typed_section
from mmvl.config.components import build_component, component_spec
from mmvl.data.base import DatasetBuilder
from mmvl.distributed.comm import is_main_process
from mmvl.errors import UserError
from mmvl.models.base import trainable_summary

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


def dataset_sections(config: DictConfig) -> dict[str, Any]:
    """``dataset_config.<name>`` of each chosen dataset (an empty section where the config has none)."""
    given = config.get("dataset_config") or {}
    return {name: given.get(name) or OmegaConf.create({}) for name in dataset_names(config)}


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The chosen model's name and its ``model_config.<model>`` section, as written."""

    name: str
    config: Any

    @classmethod
    def of(cls, config: DictConfig) -> "ModelSection":
        """The model section of ``config``; a run without ``model=`` is a UserError."""
        name = model_name(config)
        return cls(name, (config.get("model_config") or {}).get(name))


def datasets_from(sections: Mapping[str, Any], env: Any) -> dict[str, DatasetBuilder]:
    """One builder per dataset of ``sections`` (name -> ``dataset_config.<name>``), not yet prepared;
    ``env``: the typed ``env`` section (where the data and the caches live)."""
    builders = {}
    for name, section in sections.items():
        builders[name] = registry.DATASETS.get(name)(section, str(env.data_dir))
        builders[name].cache_dir = env.cache_dir
    return builders


def build_datasets(config: DictConfig) -> dict[str, DatasetBuilder]:
    """One builder per chosen dataset (not yet prepared); checks first that a model was chosen,
    so a run without one stops before any data is prepared."""
    model_name(config)
    return datasets_from(dataset_sections(config), typed_section(config, "env"))


def filled_model_config(section: ModelSection, builders: Mapping[str, DatasetBuilder]) -> DictConfig:
    """``section``'s config with null ``vocab_size``/``num_labels`` filled from the data."""
    mcfg = OmegaConf.create(plain_dict(section.config))
    for builder in builders.values():
        info: dict[str, Any] = getattr(builder, "model_info", lambda: {})()
        for key, value in info.items():
            if key in mcfg and mcfg[key] is None:
                mcfg[key] = value
    return mcfg


def model_config(config: DictConfig, builders: Mapping[str, DatasetBuilder]) -> DictConfig:
    """``model_config.<model>`` with null ``vocab_size``/``num_labels`` filled from the data."""
    return filled_model_config(ModelSection.of(config), builders)


def build_model(config: DictConfig, builders: Mapping[str, DatasetBuilder], checkpointing: bool = True):
    """The registered model of ``config`` (see :func:`model_from`)."""
    return model_from(ModelSection.of(config), builders, bool(typed_section(config, "training").gradient_checkpointing),
                      checkpointing=checkpointing)


def model_from(section: ModelSection, builders: Mapping[str, DatasetBuilder], gradient_checkpointing: bool = False,
               checkpointing: bool = True) -> Any:
    """The registered model ``section`` names, its adapters in and its ``freeze`` parts frozen;
    ``gradient_checkpointing``: ``training.gradient_checkpointing``; ``checkpointing=False`` leaves
    activation checkpointing to the strategy (FSDP applies it per shard unit)."""
    name = section.name
    model_cfg = filled_model_config(section, builders)
    model = registry.MODELS.get(name)(model_cfg)
    adapted = apply_lora(model, model_cfg.get("lora"), name)  # adapters in, their parts' own weights frozen
    freeze_model(model, name, model_cfg.get("freeze"), adapted)
    if gradient_checkpointing:
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


def build_callbacks(sections: Any, trainer: Any) -> list[tuple[str, Any]]:
    """``(state key, callback)`` for the built-ins of ``training.builtin_callbacks``, then the user's
    ``training.callbacks``, in that order, each from the callback registry. ``sections``: the typed
    sections callbacks read (the Trainer's; a callback's ``wanted(sections)`` decides from them).

    A user entry naming a built-in configures it in its place instead of adding a second one; a
    name used twice keys its later instances' state ``name[1]``, ``name[2]``, ...
    """
    training = sections.training
    builtin = [str(n) for n in training.builtin_callbacks or []]
    entries: list[tuple[str, Any, str]] = [(name, name, f"training.builtin_callbacks[{i}]")
                                           for i, name in enumerate(builtin)]
    for i, entry in enumerate(training.callbacks or []):
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
        if isinstance(cls, type) and hasattr(cls, "wanted") and not cls.wanted(sections):
            continue
        count = seen.get(name, 0)
        seen[name] = count + 1
        key = name if count == 0 else f"{name}[{count}]"
        built.append((key, build_component(registry.CALLBACKS, entry, trainer, where=where)))
    if float(training.ema.decay or 0) > 0 and "ema" not in seen:
        raise UserError("training.ema.decay > 0 but the 'ema' callback is in neither training.builtin_callbacks "
                        "nor training.callbacks; add 'ema' (before 'evaluation') or set training.ema.decay=0.")
    return built
