"""Finding the YAMLs of the chosen model and datasets, and user registrations.

Models and datasets are looked up in :mod:`mmvl.registry` (built-ins via
``mmvl.models`` / ``mmvl.data.datasets``, user code via ``env.user_dir``) so an
unknown name fails early with the registry's suggestions.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from mmvl.errors import UserError

_BUILTIN_PACKAGES = {"model": "mmvl.models", "dataset": "mmvl.data.datasets"}


def import_builtins(kind: str) -> None:
    """Import the package that registers the built-in models or datasets.

    Only a missing package itself is tolerated; errors inside it propagate.
    """
    package = _BUILTIN_PACKAGES[kind]
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name not in (package, package.rsplit(".", 1)[0]):
            raise


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
