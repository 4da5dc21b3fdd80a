"""``torch.nn.DataParallel``: one process driving every visible GPU (no process group)."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Sequence

import torch

from mmvl.distributed.strategies.base import Strategy
from mmvl.registry import register_strategy


def dp_device_ids(device: torch.device, count: int) -> list[int]:
    """Every visible GPU, starting with ``device`` (``training.device=cuda:N``): DataParallel
    scatters from and gathers to ``device_ids[0]``, which must hold the model."""
    first = device.index if device.index is not None else 0
    return [first] + [i for i in range(count) if i != first]


def mean_replica_losses(output: Any, replicas: int) -> Any:
    """``output["losses"]`` with each per-replica vector reduced to its mean.

    DataParallel's gather turns the 0-dim loss of each replica into a vector of
    ``replicas`` values; the losses contract (and evaluation's means) is a scalar.
    """
    if not isinstance(output, Mapping) or not isinstance(output.get("losses"), Mapping):
        return output
    losses = {k: v.mean() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == replicas else v
              for k, v in output["losses"].items()}
    return {**output, "losses": losses}


class _AutocastReplica:
    """Runs one replica's forward under the caller's autocast state.

    Autocast's dtype is thread-local, and DataParallel runs each replica in a new
    thread that re-enters autocast with the default dtype (fp16 on CUDA): without this,
    a bf16 run would compute in fp16 with no grad scaler.
    """

    def __init__(self, module: torch.nn.Module, device_type: str, enabled: bool, dtype: torch.dtype):
        self.module, self.device_type, self.enabled, self.dtype = module, device_type, enabled, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
            return self.module(*args, **kwargs)


def autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    """This thread's autocast (enabled, dtype) for ``device_type``."""
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class MMVLDataParallel(torch.nn.DataParallel):
    """DataParallel whose replicas keep the caller's autocast dtype and whose losses stay scalars."""

    def parallel_apply(self, replicas: Sequence[torch.nn.Module], inputs: Sequence[Any],
                       kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        enabled, dtype = autocast_state(device_type)
        wrapped = [_AutocastReplica(r, device_type, enabled, dtype) for r in replicas]
        return super().parallel_apply(wrapped, inputs, kwargs)

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        with warnings.catch_warnings():  # "all input tensors were scalars": reduced right below
            warnings.filterwarnings("ignore", message=".*all input tensors were scalars.*")
            gathered = super().gather(outputs, output_device)
        return mean_replica_losses(gathered, len(outputs))


@register_strategy("dp")
class DataParallelStrategy(Strategy):
    """Replicates the model on each forward; gradients land on the model's device.

    The model's device (``training.device``, e.g. ``cuda:1``) comes first in
    ``device_ids``; outputs are gathered there. A scalar loss in the model's output
    comes back as the mean over replicas. Autocast (fp16/bf16) runs inside each
    replica with the configured dtype. With one or no GPU the model is left as it is.
    """

    name = "dp"
    replicas_in_one_process = True

    def wrap(self, model, optimizer):
        count = torch.cuda.device_count() if self.env.device.type == "cuda" else 0
        if count > 1:
            model = MMVLDataParallel(model, device_ids=dp_device_ids(self.env.device, count),
                                     output_device=self.env.device)
        return model, optimizer

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, torch.nn.DataParallel) else model
