"""``torch.nn.DataParallel``: one process driving every visible GPU (no process group)."""
from __future__ import annotations

import torch

from mmvl.distributed.strategies.base import Strategy
from mmvl.registry import register_strategy


@register_strategy("dp")
class DataParallelStrategy(Strategy):
    """Replicates the model on each forward; gradients land on the first device.

    Per-device outputs are gathered on ``env.device``; a scalar loss in the
    model's output comes back as one value per device, so the caller takes
    its mean. With one or no GPU the model is left as it is.
    """

    name = "dp"

    def wrap(self, model, optimizer):
        if self.env.device.type == "cuda" and torch.cuda.device_count() > 1:
            model = torch.nn.DataParallel(model, output_device=self.env.device)
        return model, optimizer

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, torch.nn.DataParallel) else model
