"""Noticing a NaN/inf loss without waiting for the device on every update.

Each update adds three tiny device operations (``isfinite``, ``where``, ``minimum``)
that keep the first update whose loss was not finite; :meth:`NonFiniteGuard.check`
reads it (one all-reduce over the ranks, one wait) only when the Trainer settles: at
log intervals, before checkpoints and evaluations. A non-finite update may thus be
applied to the weights in memory for up to one log interval, but it is never saved,
and every rank stops at the same update.
"""
from __future__ import annotations

import torch

from mmvl.distributed import comm
from mmvl.errors import UserError

#: "no non-finite loss yet" (larger than any update number)
_NONE = 2**62


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; every rank raises it at the same update."""


class NonFiniteGuard:
    """Records the first non-finite total loss on the device; ``check`` reads it on every rank."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._first: torch.Tensor | None = None  # int64 on the loss's device
        self._latest: dict[str, torch.Tensor] = {}

    def record(self, totals: dict[str, torch.Tensor], update: int) -> None:
        """``totals["total_loss"]`` of ``update`` (1-based); queues device work only."""
        if not self.enabled:
            return
        total = totals["total_loss"]
        here = torch.where(torch.isfinite(total), _NONE, update)
        self._first = here if self._first is None else torch.minimum(self._first, here)
        self._latest = totals

    def check(self) -> tuple[int, str] | None:
        """``(first non-finite update, the latest losses as text)`` over all ranks, or None.

        A collective once any update was recorded: every rank calls it at the same point.
        """
        if self._first is None:
            return None
        first = int(comm.all_reduce(self._first.reshape(1), "min").item())
        if first == _NONE:
            return None
        values = ", ".join(f"{k}={float(v):.4g}" for k, v in self._latest.items())
        return first, values
