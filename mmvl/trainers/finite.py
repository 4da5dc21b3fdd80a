"""Noticing a NaN/inf loss without waiting for the device on every update.

Each update only keeps a reference to its total loss (no device work);
:meth:`NonFiniteGuard.check` looks at the losses kept since the last check (one
all-reduce over the ranks, one wait) when the Trainer settles: at log intervals,
before checkpoints and evaluations. A non-finite update may thus be applied to the
weights in memory for up to one log interval, but it is never saved, and every rank
stops at the same update, naming the first bad one.
"""
from __future__ import annotations

from typing import Callable

import torch

from mmvl.errors import UserError

#: "no non-finite loss yet" (larger than any update number)
_NONE = 2**62


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; every rank raises it at the same update."""


class NonFiniteGuard:
    """Keeps the recent total losses (device tensors); ``check`` reads them on every rank."""

    def __init__(self, all_reduce: Callable[[torch.Tensor, str], torch.Tensor], enabled: bool = True):
        """``all_reduce``: the Engine's (``tensor, op -> tensor``), the trainer's door to collectives."""
        self.all_reduce, self.enabled = all_reduce, enabled
        self._first_update = 0  # the update of _recent[0]
        self._recent: list[torch.Tensor] = []  # total losses since the last check
        self._latest: dict[str, torch.Tensor] = {}

    def record(self, totals: dict[str, torch.Tensor], update: int) -> None:
        """Keep ``totals["total_loss"]`` of ``update`` (1-based): a reference, no device work."""
        if not self.enabled:
            return
        if not self._recent:
            self._first_update = update
        self._recent.append(totals["total_loss"])
        self._latest = totals

    def check(self) -> tuple[int, str] | None:
        """``(first non-finite update, the latest losses as text)`` over all ranks, or None.

        A collective once any update was recorded: every rank calls it at the same point.
        """
        if not self._recent:
            return None
        losses = torch.stack(self._recent)
        updates = torch.arange(self._first_update, self._first_update + len(losses), device=losses.device)
        first = torch.where(torch.isfinite(losses), _NONE, updates).min()
        first = int(self.all_reduce(first.reshape(1), "min").item())
        self._recent = []
        if first == _NONE:
            return None
        values = ", ".join(f"{k}={float(v):.4g}" for k, v in self._latest.items())
        return first, values
