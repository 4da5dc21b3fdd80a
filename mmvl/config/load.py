"""Building one run's config: defaults -> model -> datasets -> user file -> CLI.

The model, datasets and ``env.user_dir`` are chosen first (CLI > user file >
defaults) because they decide which YAMLs form the base. Every user layer is
validated against that base before merging, so errors name their source.
The result is fully resolved: workers need no custom resolvers.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmvl.config import mmf
from mmvl.config.access import ABSENT, lookup
from mmvl.config.components import component_yaml, import_user_dir
from mmvl.config.files import load_with_includes, read_yaml
from mmvl.config.opts import normalize_datasets, parse_opts
from mmvl.config.resolvers import interpolation_problem, register_resolvers
from mmvl.config.switch import adopt_switched_types
from mmvl.config.validate import Provenance, apply_aliases, check_final, check_layer, is_interpolation
from mmvl import registry
from mmvl.errors import UserError

CLI = "command line"

log = logging.getLogger("mmvl")


def config_root(root: str | os.PathLike[str] | None = None) -> Path:
    """``root`` if given, else ``$MMVL_CONFIG_ROOT``, else the repo's ``configs/``."""
    if root is None:
        root = os.environ.get("MMVL_CONFIG_ROOT") or Path(__file__).resolve().parents[2] / "configs"
    return Path(root).expanduser()


def load_config(
    opts: Iterable[str] = (), config_root: str | os.PathLike[str] | None = None
) -> DictConfig:
    """Parse ``opts`` (``config=``, ``model=``, ``datasets=``, ``key=value``) into a resolved config."""
    register_resolvers()
    root = _config_root(config_root)
    defaults_path, defaults, user, cli = _read_layers(opts, root)
    provenance: Provenance = {}
    check_layer(defaults, defaults, str(defaults_path), provenance)  # records sources only
    chosen = [(str(defaults_path), defaults), *user, *cli]

    model = _choose("model", chosen)
    datasets = _choose("datasets", chosen)
    if isinstance(datasets, str):
        datasets = normalize_datasets(datasets, "the datasets interpolation")
    user_dir = _choose("env.user_dir", chosen)
    if model is not None and not isinstance(model, str):
        raise UserError(f"'model' must be a registered model name, got {model!r}.")

    # the built-ins are registered already (``import mmvl`` runs before this module), so a user
    # registration that reuses a built-in name fails on the user's side
    if user_dir:
        import_user_dir(user_dir, _source_of("env.user_dir", chosen))

    base = copy.deepcopy(defaults)
    if model:
        _add_component(base, "model", model, root, provenance)
    for name in datasets or []:
        _add_component(base, "dataset", name, root, provenance)

    merged = copy.deepcopy(base)
    ignored: list[tuple[str, str]] = []  # MMF keys mmvl does not use, with their sources
    user = [(source, _set_aside_unchosen(layer, model, datasets or [], source)) for source, layer in user]
    for source, layer in [*user, *cli]:
        layer = mmf.translate(layer, base, source, ignored)
        _deep_merge(merged, check_layer(layer, base, source, provenance))
    mmf.warn_unused(ignored)
    return _finish(merged, provenance, base)


def _set_aside_unchosen(layer: dict[str, Any], model: Any, datasets: list[str], source: str) -> dict[str, Any]:
    """A config file's ``model_config.<m>`` / ``dataset_config.<d>`` for a registered model or dataset
    this run does not choose (a project config run with ``datasets=llava`` on the command line) is
    set aside, with a log line: it configures what the run does not build. A name nothing
    registers stays in, so a misspelt section is still refused; the command line is never set aside."""
    out = dict(layer)
    for section, chosen, known in (("model_config", [model], registry.MODELS), ("dataset_config", datasets,
                                                                             registry.DATASETS)):
        entries = layer.get(section)
        if not isinstance(entries, dict):
            continue
        aside = [k for k in entries if k not in chosen and k in known]
        if aside:
            out[section] = {k: v for k, v in entries.items() if k not in aside}
            if os.environ.get("RANK", "0") == "0":
                log.info("%s configures %s %s, which this run does not use; those keys are set aside",
                         source, section.split("_")[0], ", ".join(aside))
    return out


def import_registrations(opts: Iterable[str] = (), config_root: str | os.PathLike[str] | None = None) -> None:
    """Import the ``env.user_dir`` that ``opts`` choose (``mmvl_run --list ... env.user_dir=...``);
    the registries then hold what a run could use (the built-ins are registered by ``import mmvl``)."""
    register_resolvers()
    defaults_path, defaults, user, cli = _read_layers(opts, _config_root(config_root))
    chosen = [(str(defaults_path), defaults), *user, *cli]
    user_dir = _choose("env.user_dir", chosen)
    if user_dir:
        import_user_dir(user_dir, _source_of("env.user_dir", chosen))


Layers = list[tuple[str, dict[str, Any]]]


def _read_layers(opts: Iterable[str], root: Path) -> tuple[Path, dict[str, Any], Layers, Layers]:
    """``(defaults file, defaults, user file layers, command-line layers)``, as written."""
    parsed = parse_opts(opts)
    defaults_path = root / "defaults.yaml"
    defaults = read_yaml(defaults_path, "Defaults file")
    user: Layers = []
    for file in parsed.config_files:
        for path, content in load_with_includes(file, root):
            if "datasets" in content:
                content["datasets"] = normalize_datasets(content["datasets"], str(path))
            user.append((str(path), content))
    cli = [(CLI, _nest(key, value)) for key, value in parsed.overrides]
    return defaults_path, defaults, user, cli


def _config_root(root: str | os.PathLike[str] | None) -> Path:
    path = config_root(root)
    if not path.is_dir():
        raise UserError(
            f"Config root {str(path)!r} is not a folder; set MMVL_CONFIG_ROOT or pass config_root "
            f"pointing to the folder with defaults.yaml."
        )
    return path


def _nest(key: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    tree: dict[str, Any] = {}
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return tree


def _source_of(path: str, layers: list[tuple[str, dict[str, Any]]]) -> str:
    for source, layer in reversed(layers):
        if lookup(layer, path) is not ABSENT:
            return source
    return "defaults"


def _choose(path: str, layers: list[tuple[str, dict[str, Any]]]) -> Any:
    """The value of ``path`` from the last layer that sets it, interpolations resolved."""
    for source, layer in reversed(layers):
        value = lookup(layer, path)
        if value is ABSENT:
            continue
        if not is_interpolation(value):
            return value
        try:
            return OmegaConf.create({"v": value}).v
        except OmegaConfBaseException as err:
            raise UserError(f"Cannot resolve {path}={value!r} from {source}: "
                            f"{interpolation_problem(err) or _first_line(err)}.") from None
    return None


def _add_component(base: dict[str, Any], kind: str, name: str, root: Path, provenance: Provenance) -> None:
    """Merge the YAML of model/dataset ``name`` into ``base`` (checked outside its own section)."""
    section = f"{kind}_config"
    path = component_yaml(kind, name, root)
    if path is not None:
        for file, content in load_with_includes(path, root):
            _deep_merge(base, check_layer(content, base, str(file), provenance, free_roots=(section,)))
    base.setdefault(section, {})
    if not isinstance(base[section].get(name), dict):
        base[section][name] = {}


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``src`` into ``dst``: mappings recursively, everything else (lists too) replaced."""
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)
    return dst


def _finish(merged: dict[str, Any], provenance: Provenance, base: dict[str, Any]) -> DictConfig:
    """Resolve, check cross-key rules and aliases, return a plain (resolved) DictConfig."""
    try:
        cfg = OmegaConf.create(merged)
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise UserError(
                f"Config key {missing[0]!r} is required but not set (???); "
                f"set it in your config file or with {missing[0]}=<value>."
            )
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        problem = interpolation_problem(err)
        raise UserError(
            f"Cannot resolve config key {key!r} (from {provenance.get(key, 'the merged config')}): "
            f"{problem or _first_line(err)}{'' if problem else '. Fix the ${...} interpolation'}."
        ) from None
    if not isinstance(resolved, dict):  # a top-level config is always a mapping
        raise TypeError(f"resolved config is a {type(resolved).__name__}, expected a mapping")
    if isinstance(resolved.get("datasets"), str):
        resolved["datasets"] = normalize_datasets(resolved["datasets"], "the resolved config")
    check_final(resolved, provenance)
    adopt_switched_types(resolved, base, provenance, keep_from=CLI)
    apply_aliases(resolved, provenance)
    return OmegaConf.create(resolved)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


#: the first line of every config.yaml mmvl writes: a file without it is the user's, never overwritten
CONFIG_MARK = "# the resolved config of this run, written by mmvl (rewritten at every start)"


def save_config(cfg: DictConfig | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` as plain, resolved YAML atomically (through the one atomic writer), marked as
    mmvl's; a file at ``path`` that mmvl did not write is a UserError (see :func:`check_config_file`)."""
    from mmvl.io import atomic_write  # the one atomic writer (imports torch only to save tensors)

    path = Path(path)
    check_config_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg)), resolve=True)
    return atomic_write(path, "w", lambda f: f.write(f"{CONFIG_MARK}\n{text}"))


def check_config_file(path: str | os.PathLike[str]) -> None:
    """A UserError when ``path`` exists and mmvl did not write it (the user's own config kept in the
    save dir). A config.yaml of mmvl before the mark counts as mmvl's: it is a whole resolved config."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        first = ""
    if first == CONFIG_MARK:
        return
    try:
        content = read_yaml(path, "Config file")
    except UserError:
        content = {}
    resolved = isinstance(content, dict) and {"run_type", "training", "checkpoint", "distributed", "env"} <= set(content)
    if not resolved:
        raise UserError(f"{str(path)!r} is not a config mmvl wrote (your own file?) and a run would overwrite it; "
                        f"choose another env.save_dir, or move the file.")
