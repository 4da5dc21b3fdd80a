"""Graph breaks: where ``torch.compile`` has to leave a graph and run Python, found by Dynamo alone.

Each break splits a compiled model into more graphs (less fusion, a return to Python per update);
knowing them per model is what lets ``fullgraph=True`` be the aim. Dynamo runs with the ``eager``
backend (no kernels generated), so this costs one trace of the call: seconds at tiny sizes.
Used by the model tests (a pinned list per registered model) and ``benchmarks/step_speed.py``.
:func:`compile_model` is how the Engine compiles a model for ``training.compile``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def _reason(message: str) -> str:
    """Dynamo's message -> its headline, with the debug context that names what broke
    (e.g. ``Attempted to wrap RNN, GRU, or LSTM: LSTM(8, 16, batch_first=True)``)."""
    lines = [line.strip() for line in message.splitlines()]
    context = next((line.split(":", 1)[1].strip() for line in lines
                    if line.startswith("Developer debug context:")), "")
    return f"{lines[0]}: {context}" if context else lines[0]


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """The distinct reasons Dynamo breaks the graph of ``fn(*args, **kwargs)`` (empty: one graph).

    ``fn`` is first compiled with ``fullgraph=True`` (the eager backend): when that works there is
    no break, and ``fn`` ran once. Otherwise it runs again compiled as usual and the reasons are read
    from Dynamo's counters: ``graph_break`` and ``unimplemented`` (a break in the outermost frame is
    counted only in the second, one in a nested call in both and once per enclosing frame), so each
    reason is listed once, with what broke (a module, an op), and not counted. Dynamo's caches are
    reset before and after: an earlier compile cannot hide a break and this leaves nothing behind.
    """
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    try:
        try:
            torch.compile(fn, backend="eager", fullgraph=True)(*args, **kwargs)
            return []
        except torch._dynamo.exc.Unsupported:
            pass
        torch._dynamo.reset()
        before = {kind: dict(counters[kind]) for kind in ("graph_break", "unimplemented")}
        graphs = counters["stats"]["unique_graphs"]
        torch.compile(fn, backend="eager")(*args, **kwargs)
        graphs = counters["stats"]["unique_graphs"] - graphs
    finally:
        torch._dynamo.reset()
    new = {_reason(message) for kind, seen in before.items() for message, n in counters[kind].items()
           if n > seen.get(message, 0)}
    return sorted(new) or [f"a break Dynamo gave no reason for ({graphs} graphs)"]


def compile_model(model: torch.nn.Module, backend: str = "inductor", per_unit: bool = False) -> None:
    """``torch.compile`` ``model`` in place, before any parallel wrapper.

    ``Module.compile`` keeps parameter names (and so checkpoints) those of the eager
    model: no ``_orig_mod.`` prefixes. ``per_unit`` compiles each of ``model.shard_units()``
    (its transformer layers) on its own, which keeps DDP's bucketed all-reduce and FSDP's
    per-layer gathers overlapping backward; without units, or one process, the whole model
    is compiled (the most fusion).
    """
    units = list(model.shard_units()) if per_unit and hasattr(model, "shard_units") else []
    for module in units or [model]:
        module.compile(backend=backend)
