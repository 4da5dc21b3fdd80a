"""Reading config values: the one dotted-key getter and the one OmegaConf -> plain conversion.

Every module that reads ``a.b.c`` from a config (a DictConfig or plain dicts,
as workers and tests pass) goes through :func:`config_value`; every module
that needs plain containers (to bind ``params`` to a signature, to mutate a
copy) goes through :func:`plain`. A key below a typed section that the schema
does not declare (``training.sed``) raises ``KeyError`` here, so a misspelt read fails
in the first test that takes its path instead of returning the default.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmvl.config.schema import declared


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


#: what :func:`lookup` returns for a key that is not there (``None`` is a value)
ABSENT: Any = _Absent()


def lookup(tree: Any, key: str) -> Any:
    """``tree.a.b.c`` for ``key="a.b.c"``; :data:`ABSENT` when any part is missing."""
    node = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:  # DictConfigs are Mappings
            return ABSENT
        node = node[part]
    return node


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config.<key>`` (dotted), or ``default`` when the key is absent or null.

    A key the schema does not declare (:func:`mmvl.config.schema.declared`) is a programming
    error, raised whatever the config holds."""
    if not declared(key):
        raise KeyError(f"config key {key!r} is not declared in mmvl/config/schema.py; declare it there "
                       "(and in configs/defaults.yaml) or fix its spelling")
    value = ABSENT if config is None else lookup(config, key)
    return default if value is ABSENT or value is None else value


def plain(value: Any) -> Any:
    """OmegaConf containers -> plain (resolved) dicts and lists; anything else unchanged."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def plain_dict(value: Any) -> dict[str, Any]:
    """:func:`plain` for a mapping that may be null: always a new ``dict``."""
    out = plain(value)
    return dict(out) if out else {}
