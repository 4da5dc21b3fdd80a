"""Model EMA (``training.ema.decay``; 0: off): an exponential moving average of the weights,
evaluated in their place, checkpointed and resumed exactly.

After every optimizer update each averaged tensor moves ``1 - decay`` of the way to the live one
(one ``torch._foreach_lerp_`` on the device: no read-back, no sync; an update the fp16 scaler
skipped still moves the average toward the unchanged weights). The average covers the unwrapped
module's trainable parameters and floating-point buffers (BatchNorm statistics), so under ddp it is
the same on every rank. Evaluation swaps the averages into the model for the split (in place, one
tensor at a time: the parameters keep their identity, a compiled model does not recompile) and
swaps them back afterwards, also when the evaluation fails; it says so in the log. The averages are
the checkpoint's :data:`mmvl.checkpoint.schema.EMA` entry, by parameter name; a checkpoint without
one (EMA turned on at a resume) starts them from the resumed weights.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from mmvl.checkpoint import State, schema
from mmvl.errors import UserError
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol

log = logging.getLogger("mmvl")


@register_callback("ema")
class EmaCallback(Callback):
    """Keeps the EMA of the model's weights (the built-in ``ema`` callback, before ``evaluation``)."""

    @classmethod
    def wanted(cls, sections: Any) -> bool:
        return float(sections.training.ema.decay or 0) != 0  # a negative decay is built, and refused

    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.decay = float(trainer.sections.training.ema.decay or 0)
        if not 0 < self.decay < 1:
            raise UserError(f"training.ema.decay={self.decay} must be in (0, 1) (e.g. 0.999), or 0 to turn EMA off.")
        if trainer.engine.strategy.shards_parameters:
            raise UserError("training.ema.decay > 0 is not supported under distributed.strategy=fsdp (sharded "
                            "parameters); use ddp, or training.ema.decay=0.")
        self.updates = 0
        self._shadow: list[torch.Tensor] | None = None  # made from the model at first use (after a resume)
        trainer.engine.register_checkpointable(schema.EMA, self.checkpointable())

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        """The averaged tensors of the unwrapped module, by state-dict name, in a fixed order."""
        module = self.trainer.engine.unwrap_model(self.trainer.model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        return named

    def _live(self) -> list[torch.Tensor]:
        return [t.detach() for _, t in self._named()]

    def shadow(self) -> list[torch.Tensor]:
        if self._shadow is None:
            self._shadow = [t.clone() for t in self._live()]
        return self._shadow

    def on_update_end(self, info: dict[str, Any]) -> None:
        shadow = self.shadow()
        with torch.no_grad():
            torch._foreach_lerp_(shadow, self._live(), 1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def evaluating(self, split: str) -> Iterator[None]:
        """The EMA weights in the model while ``split`` is evaluated; the live ones back afterwards."""
        if self.trainer.engine.is_main_process:
            log.info("Evaluating %s with the EMA weights (training.ema.decay=%g, %d updates averaged)",
                     split, self.decay, self.updates)
        live, shadow = self._live(), self.shadow()
        _swap(live, shadow)
        try:
            yield
        finally:
            _swap(live, shadow)

    def state(self) -> dict[str, Any]:
        names = [n for n, _ in self._named()]
        return {"decay": self.decay, "updates": self.updates,
                "weights": {n: t.detach().to("cpu", copy=True) for n, t in zip(names, self.shadow())}}

    def load(self, state: dict[str, Any]) -> None:
        weights, named = state["weights"], self._named()
        missing = [n for n, _ in named if n not in weights]
        if missing:
            raise UserError(f"the checkpoint's EMA weights lack {missing[:3]} ({len(missing)} in all) of this "
                            "model's; resume with the model (and frozen parts) it was saved with.")
        self._shadow = [weights[n].to(t.device, t.dtype, copy=True) for n, t in named]
        self.updates = int(state.get("updates", 0))

    def checkpointable(self) -> State:
        return State(self.state, self.load)


@torch.no_grad()
def _swap(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Exchange the values of each pair in place (one temporary tensor at a time)."""
    for x, y in zip(a, b):
        tmp = x.clone()
        x.copy_(y)
        y.copy_(tmp)
