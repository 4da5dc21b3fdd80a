"""ZeRO-2 with fairscale: ``OSS`` (sharded optimizer state) + ``ShardedDataParallel`` (sharded gradients).

Each gradient is reduced only to the rank that owns its parameter, which
updates it and broadcasts the result. fairscale is imported on first use.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from mmvl.distributed.strategies.base import Strategy
from mmvl.distributed.strategies.zero_torch import fix_step_state, shallow_state_copy
from mmvl.errors import UserError
from mmvl.registry import register_strategy


def _fairscale():
    try:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS
    except ImportError as e:  # pragma: no cover - fairscale is a dependency
        raise UserError("distributed.strategy=zero_fairscale needs fairscale: pip install fairscale "
                        "(or use distributed.strategy=zero_torch).") from e
    return OSS, ShardedDataParallel


@register_strategy("zero_fairscale")
class ZeroFairscaleStrategy(Strategy):
    """fairscale OSS + ShardedDDP; the checkpoint format is the plain torch one."""

    name = "zero_fairscale"
    needs_process_group = True
    shards_optimizer_state = True
    full_gradients = False  # ShardedDDP reduces each gradient to the rank that owns its optimizer state
    communicates_in_backward = True

    def wrap(self, model, optimizer):
        if optimizer is None:
            raise UserError("distributed.strategy=zero_fairscale shards the optimizer, so it needs one; "
                            "use distributed.strategy=ddp for evaluation-only runs.")
        OSS, ShardedDataParallel = _fairscale()
        # broadcast_fp16 halves the parameter broadcast but rounds the other ranks' weights: opt-in only
        optimizer = OSS(self.param_groups(optimizer), optim=type(optimizer),
                        broadcast_fp16=bool(self.distributed.broadcast_fp16),
                        **self.optimizer_defaults(optimizer))
        model = ShardedDataParallel(
            model, optimizer,
            broadcast_buffers=bool(self.distributed.broadcast_buffers),
            reduce_buffer_size=int(self.distributed.reduce_buffer_size))

        def zero_grad(set_to_none: bool = True) -> None:
            model.zero_grad(set_to_none=set_to_none)

        # ShardedDDP keeps gradients as views of its reduce buckets: dropping them through the
        # optimizer (set_to_none) would make it reduce stale buckets, so only it may clear them.
        optimizer.zero_grad = zero_grad
        return model, optimizer

    def make_grad_scaler(self, enabled: bool) -> Any:
        if not enabled:
            return None
        from fairscale.optim.grad_scaler import ShardedGradScaler

        return ShardedGradScaler()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        with model.no_sync():
            yield

    def clip_grad_norm_(self, model, optimizer, max_norm: float) -> torch.Tensor:
        """Each rank holds the reduced gradients of its own shard only: OSS combines the norms."""
        return optimizer.clip_grad_norm(max_norm)

    def optimizer_state_dict(self, model, optimizer) -> dict[str, Any]:
        """Consolidated on rank 0 (collective: call on every rank); ``{}`` on the others."""
        optimizer.consolidate_state_dict(recipient_rank=0)
        if self.env.rank != 0:
            return {}
        state = optimizer.state_dict()
        optimizer._all_states = []  # drop the consolidated copy held by OSS
        return state

    def load_optimizer_state_dict(self, model, optimizer, state) -> None:
        """Load a full state on every rank; each keeps its own shard (``step`` fixed up, fairscale#1083)."""
        optimizer.load_state_dict(shallow_state_copy(state))
        fix_step_state(optimizer.optim)
        optimizer.state.clear()  # the wrapper's copy of the shard is never read
