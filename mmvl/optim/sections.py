"""The typed ``optimizer`` and ``scheduler`` sections the builders take, read from a config once.

A builder takes its section, never the whole config; the two checks every builder makes of what
it was given (the section's class, an optimizer's type) live here once.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmvl.config import schema
from mmvl.config.components import component_spec
from mmvl.errors import UserError


def require_section(section: Any, kind: type, builder: str) -> None:
    """A builder was handed its typed section (``kind``), not a config or a dict: a programming
    mistake, so a TypeError that names the reader to call."""
    if not isinstance(section, kind):
        reader = f"mmvl.optim.{kind.__name__.lower()}_section(config)"
        raise TypeError(f"{builder} takes the typed {kind.__name__.lower()} section ({reader}), "
                        f"got {type(section).__name__}")


def require_optimizer_type(name: Any) -> None:
    """An optimizer is named in the config: the schema's default never stands in for a missing one."""
    if not name:
        raise UserError("config has no optimizer.type; set e.g. `optimizer: {type: adam_w, params: {lr: 1e-4}}`.")


def _raw_section(config: Any, name: str) -> Any:
    """``config[name]`` as written (a DictConfig, plain dicts or None), before any schema default."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def optimizer_section(config: Any) -> schema.Optimizer:
    """The typed ``optimizer`` section of ``config``. Its ``type`` must be written there: the
    schema's default (adam_w) never stands in for a missing one. Absent ``params`` are none (the
    schema's default params are adam_w's); other absent fields take the schema's defaults."""
    raw = _raw_section(config, "optimizer")
    require_optimizer_type(raw.get("type") if isinstance(raw, Mapping) else None)
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
