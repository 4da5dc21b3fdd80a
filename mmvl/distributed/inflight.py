"""Tensors handed to a collective stay owned by Python until the backend has let go of them.

Why: a backend (gloo's worker threads, NCCL's watchdog) keeps its own reference to every tensor of
a collective and drops it on its own thread, a moment after the caller saw the collective finish.
When Python already dropped the tensor, that last release frees the Python object too, and so takes
the GIL. If the interpreter is shutting down by then, CPython ends the thread that takes the GIL
(``pthread_exit``) inside a noexcept C++ destructor: ``std::terminate``, "terminate called without
an active exception", SIGABRT, and a run that finished its work exits with an error. A script whose
last collective is close to its end (a gather, then ``save_state``) met this about one run in ten
under ``torchrun`` on 2 CPU processes.

So every collective in :mod:`mmvl.distributed.comm` hands its tensors here, with how many native
references each had before the collective; :func:`settle` (at interpreter exit, before the
interpreter shuts down, and before the process group is destroyed) waits, with the GIL released,
until the backend's references are gone, so the last release of each tensor happens on the main
thread. Tensors already released are dropped at every new hand-over, so nothing accumulates.
"""
from __future__ import annotations

import atexit
import time

import torch

#: (tensor, its native reference count before the collective)
_handed: list[tuple[torch.Tensor, int]] = []


def _native_refs(tensor: torch.Tensor) -> int | None:
    count = getattr(tensor, "_use_count", None)  # the TensorImpl's reference count (torch >= 2.x)
    return int(count()) if callable(count) else None


def _released(entry: tuple[torch.Tensor, int]) -> bool:
    refs = _native_refs(entry[0])
    return refs is not None and refs <= entry[1]


def before(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Note ``tensors``' reference counts; call right before giving them to a collective."""
    return [(t, _native_refs(t) or 1) for t in tensors]


def hand(entries: list[tuple[torch.Tensor, int]]) -> None:
    """Keep ``entries`` (from :func:`before`) until the backend has released them."""
    _handed[:] = [e for e in _handed if not _released(e)]
    _handed.extend(entries)


def settle(timeout_s: float = 5.0) -> bool:
    """Wait until the backend released every handed tensor (at most ``timeout_s``); True when it did.

    Without ``Tensor._use_count`` (an older torch) it gives the backend's threads a short grace.
    """
    deadline = time.monotonic() + timeout_s
    while _handed:
        pending = [e for e in _handed if not _released(e)]
        if pending and any(_native_refs(t) is None for t, _ in pending):
            time.sleep(0.1)
            pending = []
        _handed[:] = pending
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # releases the GIL: the backend's thread finishes its release here
    return True


atexit.register(settle)
