"""What a tracker is, and turning ``log_with`` / ``training.trackers`` into started trackers.

One mechanism serves the Trainer (``training.trackers``, through the trackers callback) and the
Engine (``Engine(log_with=...)``, ``init_trackers``, ``log``, ``end_training``): both name registered
trackers, both make them on the main process only, both hand them the same calls. A backend
imports its package when it is made, so a plain install registers every tracker and only the one
a run asks for needs its package (``pip install 'mmvl[trackers]'`` installs all three).
"""
from __future__ import annotations

import importlib.util
import json
from typing import Any, ClassVar, Iterable, Mapping

from mmvl import registry
from mmvl.errors import UserError, did_you_mean

#: ``log_with="all"``: every registered tracker whose package is installed (as in Accelerate)
ALL = "all"
#: a number, a text, or a mapping of numbers (one chart with several lines)
Value = Any


class Tracker:
    """One experiment tracker of one run. Subclasses name their ``package`` and implement
    :meth:`log` and :meth:`finish`; every call happens on the main process only."""

    name: ClassVar[str] = ""
    #: the module that must be importable (``importlib.util.find_spec``) for this tracker
    package: ClassVar[str] = ""

    def __init__(self, project_name: str, logging_dir: str, **init_kwargs: Any):
        self.project_name = project_name
        self.logging_dir = logging_dir
        self.init_kwargs = init_kwargs

    @property
    def tracker(self) -> Any:
        """The backend's own object (a SummaryWriter, a wandb Run, an MlflowClient), for what mmvl
        does not wrap (Accelerate's ``get_tracker(name, unwrap=True)``)."""
        raise NotImplementedError

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's configuration (nested mappings allowed) once, at the start."""
        raise NotImplementedError

    def log(self, values: Mapping[str, Value], step: int | None = None) -> None:
        raise NotImplementedError

    def finish(self, final: Mapping[str, float] | None = None) -> None:
        """Flush and close; ``final``: the run's headline metrics (TensorBoard's hparams table)."""
        raise NotImplementedError


def installed(name: str) -> bool:
    """Whether the package of the registered tracker ``name`` can be imported here."""
    return importlib.util.find_spec(registry.TRACKERS.get(name).package) is not None


def resolve(log_with: Any, source: str = "log_with") -> list[Any]:
    """Tracker names (and ready :class:`Tracker` objects) from ``log_with``: ``"all"`` (every
    installed tracker), a name, or a list of names and trackers. Unknown names and trackers whose
    package is missing are UserErrors naming the fix."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    found: list[Any] = []
    for item in items:
        if isinstance(item, Tracker):
            found.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()  # an enum member (Accelerate's LoggerType) too
        if name == ALL:
            found += [n for n in registry.TRACKERS.names() if installed(n) and n not in found]
            continue
        if name not in registry.TRACKERS:
            names = registry.TRACKERS.names()
            raise UserError(f"{source}: unknown tracker {name!r}.{did_you_mean(name, names)} Trackers: "
                            f"{', '.join(names)} (or 'all': those installed).")
        if not installed(name):
            package = registry.TRACKERS.get(name).package
            raise UserError(f"{source} names {name} but the {package} package is not installed; "
                            f"pip install 'mmvl[trackers]' (or {package}), or leave {name} out.")
        if name not in found:
            found.append(name)
    return found


def start(wanted: Iterable[Any], project_name: str, logging_dir: str,
          init_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> list[Tracker]:
    """Make each wanted tracker (names from :func:`resolve`); ``init_kwargs[name]`` goes to its
    constructor (Accelerate's ``init_trackers(..., init_kwargs={"wandb": {...}})``)."""
    init_kwargs = dict(init_kwargs or {})
    unknown = sorted(set(init_kwargs) - set(registry.TRACKERS.names()))
    if unknown:
        raise UserError(f"init_kwargs names {', '.join(unknown)}, which are not trackers; "
                        f"use the tracker names: {', '.join(registry.TRACKERS.names())}.")
    made: list[Tracker] = []
    for item in wanted:
        if isinstance(item, Tracker):
            made.append(item)
        else:
            made.append(registry.TRACKERS.get(item)(project_name, logging_dir, **dict(init_kwargs.get(item, {}))))
    return made


def flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and other non-scalars as JSON text (hparams, params)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat(value, name + "."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of ``values`` (bools excluded), as floats."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
