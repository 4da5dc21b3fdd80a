"""``DistributedDataParallel``: one process per device, gradients all-reduced in buckets."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from mmvl.distributed.strategies.base import Strategy
from mmvl.errors import UserError
from mmvl.registry import register_strategy


#: DDP's switch for copying rank 0's buffers at every forward (renamed in recent torch)
_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                else "broadcast_buffers")


def ddp_options(distributed: Any) -> dict:
    """DDP keyword arguments from the typed ``distributed`` section (MMF's
    ``training.find_unused_parameters`` is mapped to ``distributed.find_unused_parameters`` when the
    config is loaded)."""
    return {
        "find_unused_parameters": bool(distributed.find_unused_parameters),
        "static_graph": bool(distributed.static_graph),
        "bucket_cap_mb": float(distributed.bucket_cap_mb),
        "gradient_as_bucket_view": bool(distributed.gradient_as_bucket_view),
        _BUFFER_SYNC: bool(distributed.broadcast_buffers),
    }


def wrap_ddp(model: torch.nn.Module, distributed: Any, env) -> DistributedDataParallel:
    """``model`` under DDP. A model that leaves some parameters without a gradient in an update (a
    released VLM: vision layers after the one it reads, a batch without images) needs DDP to look
    for them: without ``find_unused_parameters`` DDP would wait for their gradients and fail at the
    next update with a message that does not say which setting fixes it, so it is refused here."""
    if getattr(model, "leaves_parameters_unused", False) and not distributed.find_unused_parameters:
        name = getattr(model, "model_name", type(model).__name__)
        raise UserError(f"model {name} leaves some parameters without a gradient in an update (vision layers it does "
                        "not read, a batch without images), which DDP must look for; set "
                        "distributed.find_unused_parameters=true (projects/hf_vlm/configs/defaults.yaml does).")
    # the GPU init_distributed chose, which is not the local rank under SLURM --gpus-per-task
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_options(distributed))


@register_strategy("ddp")
class DDPStrategy(Strategy):
    """Replicated model and optimizer; every rank holds the full, averaged gradient.

    Clipping therefore needs no extra communication: the local norm is the
    global one.
    """

    name = "ddp"
    needs_process_group = True
    communicates_in_backward = True

    def wrap(self, model, optimizer):
        return wrap_ddp(model, self.distributed, self.env), optimizer

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        with model.no_sync():
            yield
