"""Reading YAML config files and expanding their ``includes``.

Files are read into plain Python containers (not DictConfigs) so validation
and merging stay cheap; parse errors become one-line :class:`UserError` s.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmvl.config.mmf import INCLUDE_PREFIX, include_path
from mmvl.config.resolvers import interpolation_problem
from mmvl.errors import UserError

#: (file, its own keys without ``includes``) in merge order
Layer = tuple[Path, dict[str, Any]]


def read_yaml(path: str | os.PathLike[str], what: str = "Config file") -> dict[str, Any]:
    """Load one YAML mapping as plain containers; interpolations stay unresolved."""
    path = Path(path)
    if not path.is_file():
        hint = "it is a folder, point to a .yaml file" if path.is_dir() else "check the path"
        raise UserError(f"{what} {str(path)!r} does not exist ({hint}).")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(f"YAML syntax error in {path}{where}: {problem}. Fix the file's syntax.") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {str(path)!r} is not a text file (byte {err.object[err.start]:#04x} at offset "
                        f"{err.start} is not UTF-8); expected a UTF-8 YAML file of keys (e.g. 'training: "
                        "{batch_size: 32}').") from None
    except (OmegaConfBaseException, OSError) as err:
        problem = interpolation_problem(err)
        if problem:
            raise UserError(f"{what} {str(path)!r}, key {getattr(err, 'full_key', '?')!r}: {problem}.") from None
        raise UserError(f"Cannot read {what.lower()} {path}: {err}.") from None
    if not OmegaConf.is_dict(cfg):
        raise UserError(
            f"{what} {path} must contain a mapping of keys (e.g. 'training: ...'), not a list."
        )
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def load_with_includes(path: str | os.PathLike[str], config_root: Path | None = None) -> list[Layer]:
    """Expand ``includes: [...]`` recursively into layers in merge order.

    Includes are relative to the including file and merged in the order
    listed; the including file's own keys come after (override) them. An
    include that is not there, written as MMF writes them (``configs/...``,
    MMF's package folder), is looked up in mmvl's ``config_root`` instead. A
    file reached twice (diamond) is merged once, at its first position; a
    file that includes itself through a chain raises :class:`UserError`.
    """
    layers: list[Layer] = []
    seen: set[Path] = set()
    _expand(Path(path).expanduser().absolute(), [], seen, layers, config_root)
    return layers


def _expand(path: Path, stack: list[Path], seen: set[Path], out: list[Layer], root: Path | None) -> None:
    real = Path(os.path.realpath(path))
    if real in stack:
        chain = " -> ".join(str(p) for p in [*stack[stack.index(real):], real])
        raise UserError(f"Config include cycle: {chain}. Remove one of these includes.")
    if real in seen:
        return
    content = read_yaml(path)
    includes = content.pop("includes", None)
    for inc in _include_list(includes, path):
        target = Path(os.path.expandvars(inc)).expanduser()
        if not target.is_absolute():
            target = path.parent / target
        if not target.is_file() and root is not None:
            target = include_path(inc, root) or target
        if not target.is_file():
            mmf = (f", nor in mmvl's {root} (MMF's {inc} has no mmvl equivalent there)"
                   if root is not None and inc.startswith(INCLUDE_PREFIX) else "")
            raise UserError(
                f"Config file {str(target)!r} included from {path} does not exist{mmf}; "
                f"includes are relative to the including file."
            )
        _expand(target, [*stack, real], seen, out, root)
    seen.add(real)
    out.append((path, content))


def _include_list(includes: Any, path: Path) -> list[str]:
    if includes is None:
        return []
    if isinstance(includes, str):
        return [includes]
    if isinstance(includes, list) and all(isinstance(i, str) for i in includes):
        return includes
    raise UserError(
        f"'includes' in {path} must be a list of YAML paths, got {includes!r}."
    )
