"""Registry look-ups that turn a resolved config into objects. One place, no magic."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from mmvl import registry
from mmvl.config.access import config_value, plain_dict
from mmvl.config.components import build_component
from mmvl.data.base import DatasetBuilder
from mmvl.errors import UserError


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
    cls = registry.MODELS.get(model_name(config))
    model = cls(model_config(config, builders))
    if checkpointing and config.training.get("gradient_checkpointing"):
        model.enable_gradient_checkpointing()
    return model


def build_callbacks(config: DictConfig, trainer: Any) -> list[Any]:
    """The built-in callbacks, then the user's ``training.callbacks`` in order."""
    from mmvl.trainers.callbacks import default_callbacks

    callbacks = default_callbacks(trainer)
    for i, entry in enumerate(config_value(config, "training.callbacks") or []):
        callbacks.append(build_component(registry.CALLBACKS, entry, trainer, where=f"training.callbacks[{i}]"))
    return callbacks
