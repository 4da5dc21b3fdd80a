"""Custom OmegaConf resolvers used by mmvl configs.

``${device_count:}`` and ``${env:VAR,default}`` are resolved once in the main
process by :func:`mmvl.config.load_config`; the returned config holds plain
values only, so worker processes never need these resolvers registered.
"""
from __future__ import annotations

import os
import re
from typing import Any

from omegaconf import OmegaConf

_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|inf|nan)", re.I)
_MISSING = object()


def device_count() -> int:
    """Number of visible accelerators, at least 1 (the CPU counts as one process)."""
    import torch  # lazily: keeps `import mmvl.config` light

    return max(1, torch.cuda.device_count())


def decode_env_value(text: str) -> Any:
    """Turn an environment string into an int/float/bool/None where it plainly is one.

    Anything else stays a string (use ``${oc.env:VAR}`` for the raw string).
    """
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    if _INT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    return text


def env(name: str, default: Any = _MISSING) -> Any:
    """``${env:VAR,default}``: the variable (decoded), else the default.

    Without a default an unset variable is an error, so typos in variable
    names do not silently become ``None``.
    """
    value = os.environ.get(str(name))
    if value is not None:
        return decode_env_value(value)
    if default is _MISSING:
        raise KeyError(
            f"environment variable {name!r} is not set; set it or write ${{env:{name},<default>}}"
        )
    return default


def _register(name: str, fn: Any) -> None:
    register = getattr(OmegaConf, "register_resolver", None)  # OmegaConf >= 2.4
    if register is not None:
        register(name, fn, replace=True)
    else:  # pragma: no cover - OmegaConf 2.3
        OmegaConf.register_new_resolver(name, fn, replace=True)


def register_resolvers() -> None:
    """Register mmvl's resolvers (idempotent; ``oc.env`` keeps working)."""
    if not OmegaConf.has_resolver("device_count"):
        _register("device_count", device_count)
    if not OmegaConf.has_resolver("env"):
        _register("env", env)


#: the resolvers a message suggests: mmvl's own and OmegaConf's usual ones
KNOWN = ("env", "device_count", "oc.env", "oc.select", "oc.decode")


def interpolation_problem(err: BaseException) -> str | None:
    """What a bad ``${...}`` was expected to be, in words (None: ``err`` is about something else).

    OmegaConf's own words ("token recognition error at: '('", "Unsupported interpolation type
    eval") name its grammar, not the fix; the usual cause is an expression such as ``${eval:...}``.
    """
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    unknown = re.match(r"Unsupported interpolation type (\S+)", text)
    if unknown:
        return (f"'${{{unknown.group(1)}:...}}' is not a resolver (known: {', '.join(KNOWN)}, ...); a config "
                "holds values and references, never code to run: write the value itself")
    if type(err).__name__ == "GrammarParseError" or re.search(r"token recognition error|mismatched input|"
                                                             r"missing BRACE_CLOSE|extraneous input", text):
        return (f"not a valid ${{...}} interpolation ({text.split(' full_key:')[0]}); expected ${{a.key}} or "
                "${resolver:plain,args}, no expressions (a config is never evaluated); \\${ for a literal")
    return None
