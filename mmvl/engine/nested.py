"""Collectives over nested data (tuples, lists, dicts of tensors) under Accelerate's names, the
split of inputs between processes, and RNG synchronisation. A leaf: it imports no Engine module.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from mmvl.distributed import comm
from mmvl.errors import UserError


def apply(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """``fn`` on every tensor in ``data``, keeping its tuples (named too), lists and dicts."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return {k: apply(fn, v) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(apply(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply(fn, v) for v in data)
    raise TypeError(f"expected a tensor or a tuple, list or dict of tensors; got {type(data).__name__}")


def _gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat(comm.all_gather(tensor.reshape(1) if tensor.dim() == 0 else tensor))


def gather(data: Any) -> Any:
    """Every rank's tensors concatenated along dim 0 in rank order, leaf by leaf."""
    return apply(_gather_tensor, data)


def gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``; a list is concatenated over the ranks (Accelerate's rule)."""
    parts = comm.all_gather_object(obj)
    if isinstance(obj, (list, tuple)):
        return [item for part in parts for item in part]
    return parts


def gather_for_metrics(data: Any, real: int | None) -> Any:
    """Every rank's data joined in rank order (the order of the loader's global batch), keeping
    the first ``real`` samples (None: all): the samples repeated to even out the ranks are dropped."""
    def one(t: torch.Tensor) -> torch.Tensor:
        out = _gather_tensor(t)
        return out if real is None else out[:real]

    if isinstance(data, (list, tuple)) and data and not any(isinstance(d, (torch.Tensor, dict, list, tuple))
                                                            for d in data):
        joined = [item for part in comm.all_gather_object(list(data)) for item in part]
        return joined if real is None else joined[:real]
    return apply(one, data)


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Each tensor padded along ``dim`` to its longest size over ranks (so ``gather`` can join them)."""
    def one(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        longest = int(comm.all_reduce(size, op="max").item())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)
    return apply(one, data)


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Each tensor summed or averaged over ranks (``none``: this rank's), times ``scale``."""
    if reduction not in ("sum", "mean", "none"):
        raise UserError(f"reduce(reduction={reduction!r}) is not one of sum, mean, none.")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if reduction == "none":
            return tensor * scale
        out = comm.all_reduce(tensor.clone()) * scale
        return out / comm.get_world_size() if reduction == "mean" else out
    return apply(one, data)


def split(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    """This rank's contiguous part of ``inputs`` (a list, tuple, tensor, a Hugging Face ``Dataset``, or
    a dict of them); the first ``len % world`` ranks take one more; ``pad``: every rank as many (the
    last item repeated)."""
    if isinstance(inputs, dict):
        return {k: split(v, rank, world, pad) for k, v in inputs.items()}
    n = len(inputs)
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    if callable(getattr(inputs, "select", None)) and not isinstance(inputs, torch.Tensor):
        # a Hugging Face ``datasets.Dataset`` (its slice is a dict of columns): rows by index
        rows = list(range(start, start + per + (rank < extra)))
        if pad and extra and n:
            rows += [n - 1] * (per + 1 - len(rows))
        return inputs.select(rows)
    part = inputs[start:start + per + (rank < extra)]
    if pad and extra and rank >= extra and n:
        last = inputs[-1:]
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part


def synchronize_rng_states(rng_types: Iterable[str], generator: torch.Generator | None = None) -> None:
    """Give every rank rank 0's state of each RNG named: ``torch`` (CPU), ``cuda`` (this process's
    device) or ``generator`` (``generator``); the draws that follow agree on every rank."""
    for kind in rng_types:
        if kind == "torch":
            torch.set_rng_state(comm.broadcast_object(torch.get_rng_state()))
        elif kind == "cuda":
            if torch.cuda.is_available():
                torch.cuda.set_rng_state(comm.broadcast_object(torch.cuda.get_rng_state().cpu()))
        elif kind == "generator":
            if generator is None:
                raise UserError("synchronize_rng_states(['generator']) needs generator=...; pass the generator.")
            generator.set_state(comm.broadcast_object(generator.get_state()))
        else:
            raise UserError(f"synchronize_rng_states: unknown RNG {kind!r}; use torch, cuda or generator.")


__all__ = ["apply", "gather", "gather_for_metrics", "gather_object", "pad_across_processes", "reduce", "split",
           "synchronize_rng_states"]
