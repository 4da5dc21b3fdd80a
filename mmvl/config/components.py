"""Components: the YAMLs of the chosen model and datasets, user registrations, and the one
builder of ``{type, params}`` entries.

Models and datasets are looked up in :mod:`mmvl.registry` (the built-ins are registered by
``import mmvl``, which every import of ``mmvl.config`` runs first; user code by ``env.user_dir``)
so an unknown name fails early with the registry's suggestions. Nothing here imports a layer
above the config: the layers register into the registry, which sits below it.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mmvl.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from mmvl.registry import Registry

def import_user_dir(user_dir: str, source: str) -> ModuleType:
    """Import ``user_dir`` as a package so its ``@register_*`` calls run.

    Its parent goes on ``sys.path`` and the folder name is the package name;
    importing the same folder again is a no-op.
    """
    path = Path(os.path.expandvars(str(user_dir))).expanduser().resolve()
    if not path.is_dir():
        raise UserError(
            f"env.user_dir {str(user_dir)!r} (from {source}) is not an existing folder; "
            f"point it to the folder holding your registered models/datasets."
        )
    name = path.name
    if not name.isidentifier():
        raise UserError(
            f"env.user_dir folder name {name!r} is not a valid Python package name; "
            f"rename the folder (letters, digits, underscores)."
        )
    existing = sys.modules.get(name)
    if existing is not None:
        locations = [Path(p).resolve() for p in getattr(existing, "__path__", [])]
        if path in locations:
            return existing
        origin = getattr(existing, "__file__", None) or locations or "built-in"
        raise UserError(
            f"env.user_dir folder name {name!r} clashes with the already imported module "
            f"{name!r} from {origin}; rename the folder {path}."
        )
    parent = str(path.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    importlib.invalidate_caches()
    return importlib.import_module(name)


def component_yaml(kind: str, name: str, root: Path) -> Path | None:
    """The YAML for registered ``name``: the class's ``config_path`` or ``<root>/<kind>s/<name>.yaml``.

    ``None`` when the class names no file and the conventional one does not exist.
    """
    from mmvl.registry import DATASETS, MODELS

    registry = MODELS if kind == "model" else DATASETS
    cls = registry.get(name)  # unknown names raise UserError with suggestions
    declared = getattr(cls, "config_path", None)
    if declared:
        path = Path(os.path.expandvars(str(declared))).expanduser()
        path = path if path.is_absolute() else root / path
        if not path.is_file():
            raise UserError(
                f"The {kind} {name!r} declares config_path={str(declared)!r}, but {path} does not "
                f"exist; fix config_path (relative to {root}, or absolute)."
            )
        return path
    path = root / f"{kind}s" / f"{name}.yaml"
    return path if path.is_file() else None


# -- building {type, params} entries -------------------------------------------------------------
def component_spec(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    """A registry entry as ``(type, params)``: a bare name, or ``{type: <name>, params: {...}}``."""
    from mmvl.config.access import plain

    entry = plain(entry)
    if isinstance(entry, str) and entry:
        return entry, {}
    if isinstance(entry, Mapping) and entry.get("type"):
        unknown = sorted(set(entry) - {"type", "params"})
        if unknown:
            raise UserError(f"{where} has unknown keys {unknown}; write {{type: <name>, params: {{...}}}}.")
        params = entry.get("params") or {}
        if not isinstance(params, Mapping):
            raise UserError(f"{where}.params must be a mapping of keyword arguments, got {params!r}.")
        return str(entry["type"]), dict(params)
    raise UserError(f"{where} is {entry!r}; write a registered name or {{type: <name>, params: {{...}}}}.")


def bind_params(obj: Any, params: Mapping[str, Any], args: Sequence[Any] = (), *, kind: str, name: str,
                where: str, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``params`` checked against ``obj``'s signature (after ``args``), as ``obj(*args, **result)`` takes them.

    ``defaults`` fill params the entry leaves unset or null, where ``obj`` accepts them (a
    callable default is called only then). A null param ``obj`` does not accept means "not
    set" and is left out, so a YAML default such as ``vocab_file: null`` survives a switch of
    ``type``. Any other unknown or missing param is a UserError naming ``<where>.params.<key>``.
    """
    params = dict(params)
    signature, accepted, open_ = _signature(obj, len(args))
    if signature is None:  # some builtins: nothing to check against
        return params
    for key, value in (defaults or {}).items():
        if params.get(key) is None and (open_ or key in accepted):
            params[key] = value() if callable(value) else value
    if not open_:
        params = {k: v for k, v in params.items() if k in accepted or v is not None}
        unknown = [k for k in params if k not in accepted]
        if unknown:
            raise UserError(f"{where}.params.{unknown[0]} is not accepted by {kind} {name!r}."
                            f"{did_you_mean(unknown[0], accepted)} Accepted: {accepted}.")
    try:
        signature.bind(*args, **params)
    except TypeError:
        missing = [p.name for p in signature.parameters.values()
                   if p.default is p.empty and p.name in accepted and p.name not in params]
        raise UserError(f"{kind} {name!r} needs {where}.params."
                        f"{missing[0] if missing else '<argument>'}; see its signature {signature}.") from None
    return params


def accepted_keywords(obj: Any, n_args: int = 0) -> tuple[list[str], bool]:
    """``(keyword params obj takes after n_args positionals, takes **kwargs)``; (``[]``, True)
    where the signature cannot be read."""
    _, accepted, open_ = _signature(obj, n_args)
    return accepted, open_


def accepts(obj: Any, name: str) -> bool:
    """Whether ``obj`` (a class or callable; an instance: its class) takes keyword ``name``."""
    target = obj if isinstance(obj, type) or inspect.isroutine(obj) else type(obj)
    signature, accepted, open_ = _signature(target, 0)
    return signature is None or open_ or name in accepted


def _signature(obj: Any, n_args: int) -> tuple[inspect.Signature | None, list[str], bool]:
    """``(signature, keyword params left after n_args positionals, takes **kwargs)``."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None, [], True
    fields = list(signature.parameters.values())
    positional = [p for p in fields if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = {p.name for p in positional[:n_args]}
    accepted = [p.name for p in fields if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.name not in taken]
    return signature, accepted, any(p.kind is p.VAR_KEYWORD for p in fields)


def build_component(registry: Registry, entry: Any, *args: Any, where: str,
                    defaults: Mapping[str, Any] | None = None) -> Any:
    """The one builder of ``{type, params}`` entries: ``registry.get(type)(*args, **params)``.

    Every registry kind goes through here (losses, metrics, processors, optimizers,
    schedulers, callbacks), so every entry is written, checked and reported the same way.
    """
    name, params = component_spec(entry, where)
    obj = registry.get(name)
    return obj(*args, **bind_params(obj, params, args, kind=registry.kind, name=name, where=where,
                                   defaults=defaults))
