"""The typed config sections (:func:`mmvl.config.schema.section`) as the distributed package reads
them: the launcher, ``init_distributed`` and the strategies read ``distributed``/``training``
fields from these dataclasses instead of looking dotted keys up in the whole config."""
from __future__ import annotations

import dataclasses
from typing import Any

from mmvl.config import schema


def typed_section(config: Any, name: str) -> Any:
    """The typed section ``name`` of ``config`` (None: the schema's defaults). A field set to null
    takes its declared default, as a dotted look-up with that default did; a default that is an
    interpolation (``${device_count:}``, resolved only when a config is loaded) reads as unset."""
    typed = schema.section(config if config is not None else {}, name)
    changes = {}
    for f in dataclasses.fields(typed):
        value = getattr(typed, f.name)
        if value is None and f.default is not dataclasses.MISSING:
            value = changes[f.name] = f.default
        if isinstance(value, str) and value.startswith("${") and value == f.default:
            changes[f.name] = None
    return dataclasses.replace(typed, **changes) if changes else typed
