"""ZeRO-1 with PyTorch alone: ``ZeroRedundancyOptimizer`` (sharded optimizer state) + DDP.

Gradients are all-reduced as in DDP; each rank updates only the parameters it
owns and broadcasts them. Checkpoints use the plain torch optimizer format,
so they load under any strategy and world size.
"""
from __future__ import annotations

from typing import Any

import torch

from mmvl.distributed.strategies.ddp import DDPStrategy
from mmvl.registry import register_strategy


# shared with zero_fairscale: both load a full torch-format state into a sharded optimizer
def shallow_state_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A copy whose containers can be mutated (sharded loaders blank other ranks' entries)."""
    return {**state, "state": dict(state["state"]),
            "param_groups": [dict(g) for g in state["param_groups"]]}


def fix_step_state(optim: torch.optim.Optimizer) -> None:
    """Give loaded ``step`` entries the form torch optimizers expect (fairscale#1083).

    Sharded loaders copy every state tensor to the parameter's device and
    keep old integer steps as they are; Adam wants a float32 0-dim tensor on
    the CPU unless it is fused or capturable.
    """
    on_device = any(g.get("fused") or g.get("capturable") for g in optim.param_groups)
    for param, entry in optim.state.items():
        step = entry.get("step")
        if step is None:
            continue
        step = torch.as_tensor(step, dtype=torch.float32).detach()
        entry["step"] = step.to(param.device if on_device else "cpu").reshape(())


@register_strategy("zero_torch")
class ZeroTorchStrategy(DDPStrategy):
    """DDP for gradients, optimizer state split across ranks."""

    name = "zero_torch"
    shards_optimizer_state = True
    # DDP leaves whole gradients on every rank here too; clipping stays the strategy's whole-model clip,
    # as it was before strategies declared this (a subset clip under ZeRO was never offered)
    full_gradients = False

    def wrap(self, model, optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer  # slow import (DTensor, sympy)

        model, _ = super().wrap(model, None)
        if optimizer is not None:
            optimizer = ZeroRedundancyOptimizer(self.param_groups(optimizer), optimizer_class=type(optimizer),
                                                **self.optimizer_defaults(optimizer))
        return model, optimizer

    def optimizer_state_dict(self, model, optimizer) -> dict[str, Any]:
        """Consolidated on rank 0 (collective: call on every rank); ``{}`` on the others."""
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.env.rank == 0 else {}

    def load_optimizer_state_dict(self, model, optimizer, state) -> None:
        """Load a full (unsharded) state on every rank; each keeps its own shard."""
        optimizer.load_state_dict(shallow_state_copy(state))
        fix_step_state(optimizer.optim)
        optimizer.state.clear()  # the wrapper's copy of the shard is never read
