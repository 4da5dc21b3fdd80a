"""Collectives every rank calls the same way; each is a no-op at world size 1.

None of these waits forever: a rank that never arrives makes the others fail
after the process-group timeout (``distributed.timeout_minutes``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import pickle

import torch
import torch.distributed as dist

from mmvl.distributed import inflight
from mmvl.errors import UserError


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def backend() -> str | None:
    """The default process group's backend (``None`` without a group)."""
    return dist.get_backend() if is_initialized() else None


def communication_device() -> torch.device:
    """The one device policy for collectives: where every tensor must live for the backend.

    NCCL takes only CUDA tensors on this rank's own GPU (``torch.cuda.current_device()``,
    set to the local rank's GPU by ``init_distributed``; torch's object collectives and
    barriers use the same device). gloo and the others are given CPU tensors.
    """
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place(tensor: torch.Tensor, device: torch.device, copy: bool = False) -> torch.Tensor:
    """``tensor.to(device)``: the one place a tensor crosses to or from the communication device.

    Every collective below goes through it, so the checking shim in the distributed tests
    can stand a labelled CPU tensor in for a GPU one (``tests/distributed/comm_shim.py``).
    """
    return tensor.to(device, copy=copy)


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over all ranks with ``op`` (sum, max, min, product),
    on ``tensor``'s device. No-op (the same tensor) at world size 1."""
    if get_world_size() == 1:
        return tensor
    out = place(tensor, communication_device(), copy=True)
    handed = inflight.before(out)
    dist.all_reduce(out, op=getattr(dist.ReduceOp, _OPS[op]))
    inflight.hand(handed)
    return place(out, tensor.device)


class AsyncMax:
    """The maximum of one small integer over all ranks, started now and read later.

    The all-reduce runs on the communication device (CUDA under NCCL) without the caller
    waiting; on CUDA the flag is made on the GPU (a fill, no copy) and its result copied
    to pinned host memory behind an event. ``result()`` waits only for that (usually long
    finished) work, so a loop that starts one every N updates and reads it N updates later
    never stalls the device in between, and every rank reads the same value at the same
    update.
    """

    def __init__(self, value: int):
        grouped = is_initialized()  # at world size 1 too: the same path, a trivial reduction
        device = communication_device() if grouped else torch.device("cpu")
        if device.type == "cuda" and torch.cuda.is_available():
            self._flag = torch.full((1,), int(value), dtype=torch.int32, device=device)
        else:
            self._flag = place(torch.full((1,), int(value), dtype=torch.int32), device)
        handed = inflight.before(self._flag)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True) if grouped else None
        inflight.hand(handed)
        self._event = None
        if self._flag.is_cuda:
            self._work.wait()  # on CUDA: the current stream waits for the collective, the host does not
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(self._flag, non_blocking=True)
            self._device_flag, self._flag, self._work = self._flag, host, None
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        elif self._work is not None:
            self._work.wait()
        return int(place(self._flag, torch.device("cpu")).numpy()[0])  # host memory: no device sync


def synchronize() -> None:
    if get_world_size() > 1:
        dist.barrier()


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s values (in place; returned)."""
    if get_world_size() > 1:
        buf = place(tensor, communication_device())
        handed = inflight.before(buf)
        dist.broadcast(buf, src=src)
        inflight.hand(handed)
        if buf is not tensor:
            tensor.copy_(buf)
    return tensor


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).clone()  # owns its memory


def _from_bytes(tensor: torch.Tensor) -> Any:
    return pickle.loads(place(tensor, torch.device("cpu")).numpy().tobytes())  # noqa: S301 - from our own ranks


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (torch's object collectives, through ours:
    their tensors are handed to :mod:`inflight` like every other collective's)."""
    if get_world_size() == 1:
        return obj
    data = _to_bytes(obj) if get_rank() == src else torch.empty(0, dtype=torch.uint8)
    size = broadcast(torch.tensor([data.numel()], dtype=torch.long), src)
    buf = place(data if get_rank() == src else torch.empty(int(size[0]), dtype=torch.uint8), communication_device())
    return _from_bytes(broadcast(buf, src))


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    if get_world_size() == 1:
        return [obj]
    return [_from_bytes(part) for part in all_gather(_to_bytes(obj))]


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if get_world_size() == 1:
        return t
    return all_reduce(t) / get_world_size()


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order; first-dimension sizes may differ across ranks.

    Sizes are exchanged first, each tensor is padded to the largest, gathered,
    and trimmed back. Trailing dimensions and dtype must agree. Results are
    on ``tensor``'s device.
    """
    world = get_world_size()
    if world == 1:
        return [tensor]
    scalar, home = tensor.dim() == 0, tensor.device
    tensor = place(tensor, communication_device()).contiguous()
    tensor = tensor.reshape(1) if scalar else tensor
    size = place(torch.tensor([tensor.shape[0]], dtype=torch.long), communication_device())
    sizes = [torch.zeros_like(size) for _ in range(world)]
    handed = inflight.before(size, *sizes)
    dist.all_gather(sizes, size)
    inflight.hand(handed)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    out = [torch.empty_like(tensor) for _ in range(world)]
    handed = inflight.before(tensor, *out)
    dist.all_gather(out, tensor)
    inflight.hand(handed)
    trimmed = [place(t[:n], home) for t, n in zip(out, lengths)]
    return [t.reshape(()) for t in trimmed] if scalar else trimmed


def reduce_dict(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mean of each scalar over all ranks, returned on every rank (one all_reduce for the dict).

    Values come back as float32 on the first value's device.
    """
    if not values:
        return {}
    keys = sorted(values)  # the same order on every rank
    scalars = [torch.as_tensor(values[k]).detach().float().reshape(()) for k in keys]
    home = scalars[0].device
    stacked = torch.stack([v.to(home) for v in scalars])
    if get_world_size() > 1:
        stacked = all_reduce(stacked) / get_world_size()
    return {k: stacked[i] for i, k in enumerate(keys)}


def _interleave(parts: list[Any], num_samples: int | None) -> Any:
    """Rank r holds sampler positions r, r+W, ...: restore the global order, drop the padding."""
    longest = max(len(p) for p in parts)
    order = [(r, i) for i in range(longest) for r in range(len(parts)) if i < len(parts[r])]
    if num_samples is not None:
        order = order[:num_samples]
    if isinstance(parts[0], torch.Tensor):
        if not order:
            return parts[0][:0]
        flat = torch.cat(parts)
        offsets = [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + len(p))
        index = torch.tensor([offsets[r] + i for r, i in order], device=flat.device)
        return flat.index_select(0, index)
    return [parts[r][i] for r, i in order]


def _gather_one(value: Any, num_samples: int | None) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1)
        parts = all_gather(value) if get_world_size() > 1 else [value]
    elif isinstance(value, (list, tuple)):
        parts = all_gather_object(list(value))
    else:
        raise TypeError(f"gather_for_metrics: cannot gather {type(value).__name__}; use tensors or lists")
    return _interleave(parts, num_samples)


def gather_for_metrics(data: Any, num_samples: int | None) -> Any:
    """Gather per-rank evaluation results along dim 0 in dataset order, without sampler padding.

    ``data`` is a tensor, a list, or a dict of those, holding this rank's
    results in its ``DistributedSampler`` order (rank r saw positions r, r+W,
    ...). The result equals a single-process run over the same
    ``num_samples`` items: interleaved back and truncated, which drops the
    duplicates the sampler appended to even out the ranks. Every rank gets the
    result. ``num_samples=None`` keeps everything.
    """
    if isinstance(data, Mapping):
        gathered = {k: _gather_one(data[k], num_samples) for k in sorted(data)}  # same order on every rank
        return {k: gathered[k] for k in data}
    return _gather_one(data, num_samples)


def on_main_agreed(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 only and broadcast its result; when it fails, every rank raises.

    The broadcast replaces a barrier, so the other ranks never wait on a rank 0 that
    already gave up (a UserError stays a UserError on every rank).
    """
    result, error, raised = None, None, None
    if get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
            raised = e
            user = isinstance(e, UserError)
            error = (user, str(e) if user else f"{type(e).__name__}: {e}")
    result, error = broadcast_object((result, error))
    if raised is not None:
        raise raised
    if error is not None:
        user, text = error
        raise UserError(text) if user else RuntimeError(f"rank 0 failed to {what}: {text}")
    return result


def all_ranks_agreed(error: str | None, what: str) -> None:
    """Every rank passes its own problem (or None); if any rank has one, every rank raises it."""
    errors = all_gather_object(error)
    if error is not None and all(e == error for e in errors):
        raise UserError(error)  # the same problem everywhere (or one process)
    problems = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if problems:
        raise UserError(f"could not {what}: {'; '.join(problems)}")


class _GatherWithGrad(torch.autograd.Function):
    """Forward: every rank's rows concatenated; backward: the sum over ranks of the gradient of
    this rank's rows (each rank's loss used them), as ``torch.distributed.nn.all_gather`` does."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        world, home = get_world_size(), tensor.device
        ctx.rank, ctx.rows = get_rank(), tensor.shape[0]
        local = place(tensor, communication_device()).contiguous()
        out = [torch.empty_like(local) for _ in range(world)]
        handed = inflight.before(local, *out)
        dist.all_gather(out, local)
        inflight.hand(handed)
        return place(torch.cat(out), home)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        summed = all_reduce(grad.contiguous())
        return summed[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, differentiable.

    Gradients flow back to the rank that owns each row, summed over every rank's loss.
    Every rank must pass the same shape (a contrastive batch is split evenly); at world
    size 1 the tensor itself.
    """
    if get_world_size() == 1:
        return tensor
    return _GatherWithGrad.apply(tensor)


def _exchange(tensor: torch.Tensor, send_to: int, recv_from: int) -> torch.Tensor:
    """Send ``tensor`` to rank ``send_to`` while receiving one of the same shape from ``recv_from``.

    One batched pair (``batch_isend_irecv``): under NCCL, a ring of separately launched sends would
    each wait on the device for a receive queued behind the next rank's send."""
    local = place(tensor, communication_device()).contiguous()
    received = torch.empty_like(local)
    ops = [dist.P2POp(dist.isend, local, send_to), dist.P2POp(dist.irecv, received, recv_from)]
    handed = inflight.before(local, received)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    inflight.hand(handed)
    return place(received, tensor.device)


class _NeighbourExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, send_to: int, recv_from: int) -> torch.Tensor:
        ctx.send_to, ctx.recv_from = send_to, recv_from
        return _exchange(tensor, send_to, recv_from)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # the gradient goes back the way the tensor came
        return _NeighbourExchange.apply(grad, ctx.recv_from, ctx.send_to), None, None


def neighbour_exchange(tensor: torch.Tensor, send_to: int, recv_from: int) -> torch.Tensor:
    """A ring step, differentiable: send ``tensor`` to ``send_to``, return what ``recv_from`` sent.

    Only point-to-point traffic (no all-gather): SigLIP's loss passes text blocks round the
    ring this way. Shapes must agree between the two neighbours.
    """
    if get_world_size() == 1:
        return tensor
    return _NeighbourExchange.apply(tensor, send_to, recv_from)
