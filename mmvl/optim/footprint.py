"""What training keeps per rank: parameters, their gradients and the optimizer's state, in bytes.

Counted on each rank's own part (a sharded DTensor parameter by its local shard), so under fsdp the
line shows what sharding saved. The optimizer's state is counted as it will be after its first
step (torch's optimizers create it lazily): from the state itself once it exists (a resumed run),
before that from the buffers each known optimizer keeps per trainable parameter.
"""
from __future__ import annotations

from typing import Any

import torch


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _buffers_per_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int | None:
    """Parameter-sized state tensors ``optimizer`` keeps for each parameter of ``group`` (None: unknown)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2  # exp_avg, exp_avg_sq (max_exp_avg_sq)
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum") else 0  # momentum_buffer
    if isinstance(optimizer, (torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)):
        return 2
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    return None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int | None:
    """This rank's optimizer state after a step (None for an optimizer not known here, before its first step)."""
    if optimizer.state:
        return sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)  # not the 0-d step counters
    total = 0
    for group in optimizer.param_groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        if not trainable:
            continue
        buffers = _buffers_per_parameter(optimizer, group)
        if buffers is None:
            return None
        total += buffers * sum(_local_bytes(p) for p in trainable)
    return total


def footprint_line(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """``parameters + optimizer state per rank: X MB (parameters A MB, gradients B MB, optimizer state
    C MB)``: what the run log says at start, X the sum of the three."""
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p) for p in model.parameters() if p.requires_grad)
    state = optimizer_state_bytes(optimizer) if optimizer is not None else 0
    if state is None:
        return (f"parameters + gradients per rank: {_mb(params + grads)} MB (parameters {_mb(params)} MB, "
                f"gradients {_mb(grads)} MB; the state of {type(optimizer).__name__} is not counted)")
    return (f"parameters + optimizer state per rank: {_mb(params + grads + state)} MB (parameters {_mb(params)} MB, "
            f"gradients {_mb(grads)} MB, optimizer state {_mb(state)} MB after its first step)")


def _mb(size: int) -> str:
    """Bytes in MB: one decimal from 100 MB, four significant digits below (a small model's share)."""
    value = size / 2 ** 20
    return f"{value:.1f}" if value >= 100 else f"{value:.4g}"
