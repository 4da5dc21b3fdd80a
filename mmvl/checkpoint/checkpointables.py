"""Named checkpointables: what a checkpoint holds is whatever was registered, by name.

Anything with ``state_dict()``/``load_state_dict(state)`` can be registered; the Engine registers
the model, optimizer, scaler, scheduler and RNG it prepares, the Trainer its counters, data
stream, callbacks and config, and user code any object of its own. A checkpoint is then the
dict ``{name: obj.state_dict()}``, and loading gives each object its own entry back, in the
schema's order (the model before the optimizer). Collectives inside a ``state_dict`` (a sharded
model gathered on rank 0) are why every rank calls :meth:`Checkpointables.state_dict`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

from mmvl.checkpoint.schema import FORMAT, KEYS, LATE_KEYS, stamp
from mmvl.errors import UserError


class State:
    """A checkpointable made of two functions (for state that is not one object's)."""

    def __init__(self, save: Callable[[], Any], load: Callable[[Any], None]):
        self._save, self._load = save, load

    def state_dict(self) -> Any:
        return self._save()

    def load_state_dict(self, state: Any) -> None:
        self._load(state)


class Checkpointables:
    """The named objects whose states make up a checkpoint, in registration order."""

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}
        self._unclaimed: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        """Add ``obj`` under ``name`` (registering the same object again is a no-op)."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(f"cannot checkpoint {type(obj).__name__} as {name!r}: it needs state_dict() and "
                            "load_state_dict(state) methods.")
        if name == FORMAT or not name:
            raise UserError(f"{name!r} cannot name a checkpointable; choose another name.")
        if self._objects.get(name, obj) is not obj:
            raise UserError(f"a checkpointable named {name!r} is already registered "
                            f"({type(self._objects[name]).__name__}); choose another name.")
        self._objects[name] = obj

    def unregister(self, name: str) -> None:
        self._objects.pop(name, None)

    def claim(self, name: str) -> Any:
        """The entry ``name`` (one of the schema's ``LATE_KEYS``) of the last loaded state that no
        checkpointable had then (None if none): an object made after the load (a ``LocalSGD``
        block opened after ``load_state``) takes its state this way, once."""
        return self._unclaimed.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._objects

    def __getitem__(self, name: str) -> Any:
        return self._objects[name]

    def names(self) -> list[str]:
        """Registered names: the schema's in its order, then the others in registration order."""
        known = [k for k in KEYS if k in self._objects]
        return known + [k for k in self._objects if k not in KEYS]

    def state_dict(self, skip: Iterable[str] = ()) -> dict[str, Any]:
        """``{name: state}`` of every checkpointable but ``skip``, with the layout's format key.

        Every rank calls this: a state may be gathered by a collective."""
        skipped = set(skip)
        return stamp({name: self._objects[name].state_dict() for name in self.names() if name not in skipped})

    def load_state_dict(self, state: Mapping[str, Any], skip: Iterable[str] = ()) -> list[str]:
        """Give each checkpointable its entry of ``state``; absent, None and empty entries leave
        it as it is (a sharded checkpoint's model, an fp32 checkpoint's scaler, a reset data
        position). Returns the names that found no entry."""
        skipped, absent = set(skip), []
        self._unclaimed = {k: state[k] for k in LATE_KEYS if k in state and k not in self._objects}
        for name in self.names():
            if name in skipped:
                continue
            value = state.get(name)
            if value is None or (isinstance(value, (Mapping, list, tuple)) and not value):
                absent.append(name)
                continue
            self._objects[name].load_state_dict(value)
        return absent
