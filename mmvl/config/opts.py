"""Parsing command-line ``key=value`` strings.

Values are parsed as YAML scalars/lists by OmegaConf (never ``eval``), so
``lr=1e-3`` is a float, ``fp16=true`` a bool and ``metrics=[a,b]`` a list.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmvl.config.resolvers import interpolation_problem
from mmvl.errors import UserError

#: option names that choose files rather than set config keys
DATASET_KEYS = ("datasets", "dataset")


@dataclass
class ParsedOpts:
    """Command-line options split into user config files and key overrides."""

    #: ``config=`` paths, merged in the order given
    config_files: list[str] = field(default_factory=list)
    #: ``(dotted key, parsed value)`` in the order given; ``model``/``datasets`` included
    overrides: list[tuple[str, Any]] = field(default_factory=list)

    def last(self, key: str, default: Any = None) -> Any:
        """The last value given for ``key`` on the command line."""
        for k, v in reversed(self.overrides):
            if k == key:
                return v
        return default

    def has(self, key: str) -> bool:
        return any(k == key for k, _ in self.overrides)


def parse_opts(opts: Iterable[str]) -> ParsedOpts:
    """Split ``opts`` into ``config=`` files and typed overrides.

    ``dataset=`` is an alias of ``datasets=``; ``datasets=a,b`` becomes a list.
    """
    if isinstance(opts, str):
        opts = opts.split()
    parsed = ParsedOpts()
    for opt in opts:
        if not isinstance(opt, str) or "=" not in opt or opt.startswith("="):
            raise UserError(
                f"Command-line argument {opt!r} is not key=value; write e.g. "
                f"config=path/to/run.yaml, model=visual_bert or training.batch_size=32."
            )
        key, raw = opt.split("=", 1)
        key = key.strip().lstrip("-")
        if key == "config":
            if not raw.strip():
                raise UserError("Command-line argument 'config=' has no path; write config=path/to/run.yaml.")
            parsed.config_files.append(raw.strip())
            continue
        value = _parse_value(key, raw, opt)
        if key in DATASET_KEYS:
            key, value = "datasets", normalize_datasets(value, "command line")
        parsed.overrides.append((key, value))
    return parsed


def _parse_value(key: str, raw: str, opt: str) -> Any:
    try:
        cfg = OmegaConf.from_dotlist([f"value={raw}"])
    except (OmegaConfBaseException, ValueError) as err:
        problem = interpolation_problem(err)
        raise UserError(f"Cannot parse the value of command-line argument {opt!r}: {problem or err}.") from None
    except Exception as err:  # yaml errors for e.g. "x=[1,"
        raise UserError(
            f"Cannot parse the value of command-line argument {opt!r} "
            f"({type(err).__name__}); quote it or fix the YAML list/scalar syntax."
        ) from None
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"Command-line argument {opt!r} has an empty key part; write e.g. training.batch_size=32.")
    return OmegaConf.to_container(cfg, resolve=False)["value"]  # type: ignore[index]


def normalize_datasets(value: Any, source: str) -> list[str]:
    """``"a,b"``, ``["a", "b"]`` or null -> a list of dataset names."""
    if value is None:
        return []
    if isinstance(value, str):
        if value.startswith("${"):
            return value  # type: ignore[return-value]  # interpolation: checked after resolving
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return [v.strip() for v in value]
    raise UserError(
        f"'datasets' in {source} must be a list of dataset names or 'a,b', got {value!r}."
    )
