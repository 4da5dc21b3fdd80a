"""Checking config layers against the base config, with a fix in every error.

Each user layer (a YAML file or the command line) is checked on its own so an
error can name where the bad key came from. The base (defaults + model and
dataset YAMLs) defines which keys exist and their types; nodes named
``params`` and empty mappings below the top level are open (any new key).
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Callable

from mmvl.config import schema
from mmvl.config.access import config_value
from mmvl import registry
from mmvl.errors import UserError, did_you_mean

#: where each leaf key was last set (dotted key -> file path or "command line")
Provenance = dict[str, str]

def _tables() -> tuple[dict[str, tuple[Any, ...]], dict[str, tuple[str, tuple[Any, ...]]], dict[str, bool]]:
    """The typed schema's closed choices, registry-backed keys and positive integers."""
    choices, registered, positive = {}, {}, {}
    for key, f in schema.fields().items():
        meta = f.metadata
        if meta.get("minimum") is not None:
            MINIMUM[key] = int(meta["minimum"])
        if meta.get("required"):
            REQUIRED.append(key)
        if meta.get("choices") is not None:
            choices[key] = tuple(meta["choices"])
        if meta.get("registry"):
            registered[key] = (meta["registry"], tuple(meta.get("extra") or ()))
        if meta.get("positive"):
            positive[key] = str(f.type).startswith("Optional")  # null allowed
    return choices, registered, positive


#: keys that must be integers of at least a minimum; keys that must be non-empty strings
MINIMUM: dict[str, int] = {}
REQUIRED: list[str] = []
#: keys with a fixed set of values (declared in :mod:`mmvl.config.schema`)
#: keys naming a registered component: (registry kind, values allowed besides the registered names);
#: the registry decides, with the built-ins and ``env.user_dir`` registered.
#: keys that must be positive integers (True: null allowed)
CHOICES, REGISTERED, POSITIVE_INT = _tables()
#: top-level sections that must not accept arbitrary new names
_CLOSED_ROOTS = ("model_config", "dataset_config")


def is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def dotted_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every node and leaf of ``tree`` as a dotted key (for suggestions)."""
    keys: list[str] = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys.append(path)
        if isinstance(value, dict):
            keys.extend(dotted_keys(value, path + "."))
    return keys


def check_layer(
    layer: dict[str, Any],
    base: dict[str, Any],
    source: str,
    provenance: Provenance,
    free_roots: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Validate ``layer`` against ``base``; return it with numbers coerced.

    ``free_roots`` are top-level keys whose subtrees are taken as they are
    (a model YAML's ``model_config``). Records each leaf's ``source``.
    """
    all_keys: list[str] = []  # filled lazily: only needed for an error

    def suggest(path: str) -> str:
        if not all_keys:
            all_keys.extend(dotted_keys(base))
        hits = suggest_keys(path, all_keys)
        return f" Did you mean {' or '.join(repr(h) for h in hits)}?" if hits else ""

    def walk(node: dict[str, Any], ref: dict[str, Any] | None, prefix: str, open_: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            path = f"{prefix}{key}"
            if ref is None or key not in ref:
                if not open_:
                    hint = _unknown_hint(str(key), path, suggest)
                    raise UserError(f"Unknown config key {path!r} in {source}.{hint}")
                out[key] = value
                _record(path, value, source, provenance)
                continue
            if not prefix and key in free_roots:
                out[key] = value
                _record(path, value, source, provenance)
                continue
            expected = ref[key]
            if isinstance(expected, dict):
                if not isinstance(value, dict):
                    raise UserError(
                        f"Config key {path!r} in {source} must be a mapping of keys "
                        f"(e.g. {path}.<key>=...), got {value!r}."
                    )
                child_open = open_ or key == "params" or (
                    not expected and (prefix != "" or key not in _CLOSED_ROOTS)
                )
                out[key] = walk(value, expected, path + ".", child_open)
            else:
                out[key] = check_value(path, value, expected, source)
                _record(path, out[key], source, provenance)
        return out

    return walk(layer, base, "", False)


def suggest_keys(path: str, keys: list[str], n: int = 2) -> list[str]:
    """The closest full dotted keys to ``path``: a near-spelling, else the same name elsewhere."""
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    leaf = path.rsplit(".", 1)[-1]
    depth = path.count(".")
    scored = sorted(
        ((ratio(path, k), k) for k in keys
         if k.count(".") == depth and ratio(leaf, k.rsplit(".", 1)[-1]) >= 0.6),
        reverse=True,
    )
    close = [k for r, k in scored[:n] if r >= 0.75 and r >= scored[0][0] - 0.03]
    moved = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != path]
    if close and (scored[0][0] >= 0.9 or not moved):
        return close
    return moved[:n] or close


def _unknown_hint(key: str, path: str, suggest: Callable[[str], str]) -> str:
    if "." in key:
        return " Write nested keys in YAML files instead of a dotted key."
    found = suggest(path)
    if found:
        return found
    if path.startswith(("model_config.", "dataset_config.")):
        return (" Keys under model_config/dataset_config exist only for the chosen model= and "
                "datasets= (see their YAMLs); check the name and nesting.")
    return " Check the spelling against configs/defaults.yaml."


def _record(path: str, value: Any, source: str, provenance: Provenance) -> None:
    if isinstance(value, dict):
        for key, sub in value.items():
            _record(f"{path}.{key}", sub, source, provenance)
    else:
        provenance[path] = source


def check_value(path: str, value: Any, expected: Any, source: str) -> Any:
    """Check one leaf against the base value ``expected``; return it coerced."""
    if is_interpolation(value):
        return value
    special = _SPECIAL.get(path)
    if special is not None:
        special(path, value, source)
        return float(value) if path == "training.max_epochs" and isinstance(value, str) else value
    if value is None or expected is None or is_interpolation(expected) or expected == "???":
        return value
    if isinstance(expected, list):
        if isinstance(value, list):
            return value
        raise _type_error(path, value, "a list (e.g. [a,b])", source)
    if isinstance(expected, bool):
        if isinstance(value, bool):
            return value
        raise _type_error(path, value, "true or false", source)
    if isinstance(expected, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, value, "an integer", source)
    if isinstance(expected, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # "1e-3": a float under YAML 1.2, a string under 1.1
            except ValueError:
                pass
        raise _type_error(path, value, "a number", source)
    if isinstance(expected, str):
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _type_error(path, value, "a string", source)
    return value


def _type_error(path: str, value: Any, wanted: str, source: str) -> UserError:
    shown = "a mapping" if isinstance(value, dict) else repr(value)
    fix = "fix the command-line value" if source == "command line" else f"fix it in {source}"
    return UserError(
        f"Config key {path!r} in {source} must be {wanted}, got {shown} ({type(value).__name__}); {fix}."
    )


def _check_choice(path: str, value: Any, source: str) -> None:
    allowed = CHOICES[path]
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise UserError(f"Config key {path!r} in {source} must be one of {_names(allowed)}; got {value!r}."
                        f"{did_you_mean(str(value), [str(a) for a in allowed])}")


def _check_registered(path: str, value: Any, source: str) -> None:
    """``value`` is a registered name of the key's kind (or one of its extra values)."""
    kind, extra = REGISTERED[path]
    if isinstance(value, list) and not extra:  # a list of names (training.trackers): each registered
        for item in value:
            _check_registered(path, item, source)
        return
    if any(value == a and type(value) is type(a) for a in extra):
        return
    reg = registry.ALL[kind]
    if isinstance(value, str) and (value in reg or _found(reg, value)):
        return
    allowed = (*extra, *reg.names())
    fallback = " (or any torch.optim class by name)" if kind == "optimizer" else ""
    raise UserError(f"Config key {path!r} in {source} must be one of {_names(allowed)}{fallback}; got {kind} "
                    f"{value!r}.{did_you_mean(str(value), reg.names())} Register your own with "
                    f"@registry.register_{kind}(name) in a module under env.user_dir.")


def _found(reg: Any, name: str) -> bool:
    try:
        reg.get(name)  # a registry with a fallback (torch.optim classes for optimizers)
    except UserError:
        return False
    return True


def _names(values: tuple[Any, ...]) -> str:
    return ", ".join("null" if a is None else str(a).lower() if isinstance(a, bool) else str(a) for a in values)


def _check_positive_int(path: str, value: Any, source: str) -> None:
    if value is None and POSITIVE_INT[path]:
        return
    number = value
    if path == "training.max_epochs" and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and number > 0:
            return
    if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
        null = " or null" if POSITIVE_INT[path] else ""
        raise UserError(
            f"Config key {path!r} in {source} must be a positive integer{null}; got {value!r}."
        )


def _check_minimum(path: str, value: Any, source: str) -> None:
    low = MINIMUM[path]
    if is_interpolation(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = {0: "0 or more", 1: "1 or more"}.get(low, f"at least {low}")
        off = " (0 turns it off)" if low == 0 and path.endswith("_interval") else ""
        raise UserError(f"Config key {path!r} in {source} must be an integer, {what}{off}; got {value!r}.")


def _check_required(path: str, value: Any, source: str) -> None:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise UserError(f"Config key {path!r} in {source} is empty; give it a folder, e.g. {path}=./save/my_run.")


def _check_run_type(path: str, value: Any, source: str) -> None:
    schema.parse_run_type(value, source)


_SPECIAL: dict[str, Callable[[str, Any, str], None]] = {
    "run_type": _check_run_type,
    **{k: _check_choice for k in CHOICES},
    **{k: _check_registered for k in REGISTERED},
    **{k: _check_positive_int for k in POSITIVE_INT},
    **{k: _check_minimum for k in MINIMUM},
    **{k: _check_required for k in REQUIRED},
}


def check_final(cfg: dict[str, Any], provenance: Provenance) -> None:
    """Checks on the merged, resolved config (values from YAMLs or interpolations)."""
    for path, check in _SPECIAL.items():
        check(path, config_value(cfg, path), provenance.get(path, "the merged config"))
    for section in ("optimizer", "scheduler"):
        for key, value in ((cfg.get(section) or {}).get("params") or {}).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{section}.params.{key}={value} ({provenance.get(f'{section}.params.{key}', 'the merged config')}) "
                                f"is not a finite number; give a finite value.")
    training = cfg.get("training", {})
    if training.get("max_updates") is None and training.get("max_epochs") is None:
        raise UserError(
            "Both training.max_updates and training.max_epochs are null; set one, "
            "e.g. training.max_updates=10000."
        )
    model = cfg.get("model")
    if model is not None and not isinstance(model, str):
        raise UserError(f"Config key 'model' must be a model name, got {model!r}.")
    datasets = cfg.get("datasets")
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise UserError(f"Config key 'datasets' must be a list of dataset names, got {datasets!r}.")


def apply_aliases(cfg: dict[str, Any], provenance: Provenance) -> None:
    """MMF flags that alias other keys (update_frequency, fp16, data_parallel) and MMF's spellings of
    run_type, resolved here once: code reads only the canonical keys."""
    cfg["run_type"] = schema.parse_run_type(cfg.get("run_type"), provenance.get("run_type", "the merged config"))
    training, dist = cfg["training"], cfg["distributed"]
    freq = training.get("update_frequency")
    if freq is not None:
        if training["gradient_accumulation"] not in (1, freq):
            raise UserError(
                f"training.update_frequency={freq} ({provenance.get('training.update_frequency')}) "
                f"conflicts with training.gradient_accumulation={training['gradient_accumulation']}; "
                f"set only training.gradient_accumulation."
            )
        training["gradient_accumulation"] = freq
    if training.get("fp16"):
        if training["precision"] == "bf16":
            raise UserError(
                "training.fp16=true conflicts with training.precision=bf16; "
                "drop training.fp16 and set training.precision."
            )
        training["precision"] = "fp16"
    training["fp16"] = training["precision"] == "fp16"
    if dist.get("data_parallel"):
        if dist["strategy"] not in ("auto", "dp"):
            raise UserError(
                f"distributed.data_parallel=true conflicts with distributed.strategy="
                f"{dist['strategy']}; drop data_parallel and set distributed.strategy."
            )
        dist["strategy"] = "dp"
