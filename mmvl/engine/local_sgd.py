"""``LocalSGD``: each rank trains on its own for K steps, then the ranks average their parameters.

Accelerate's meaning, so its ``by_feature/local_sgd.py`` ports by its import line::

    with LocalSGD(accelerator=engine, model=model, local_sgd_steps=8, enabled=True) as local_sgd:
        for batch in loader:
            with engine.accumulate(model):
                ...
                optimizer.step()
            local_sgd.step()

Inside the block gradients are not communicated (the strategy's ``no_sync``, which ``accumulate``'s
boundary steps do not undo); every ``local_sgd_steps`` calls of :meth:`LocalSGD.step` every rank
replaces each parameter by its mean over the ranks, and leaving the block averages once more.
``enabled=False`` or one process does nothing but count.

Checkpoints. Between averages the ranks' parameters differ, and their optimizer states (momentum,
Adam's moments) always do: no rank's copy is the run's state. So while the block is open the
LocalSGD is a checkpointable (:data:`mmvl.checkpoint.schema.LOCAL_SGD`) holding its step count and
every rank's parameters and optimizer state (gathered on every rank, written by rank 0: a
checkpoint grows with the world size). A ``load_state`` before the block opens keeps that entry until the block's LocalSGD
claims it, so a script that loads its state and then opens the block, as Accelerate's do, resumes
bitwise where it stopped.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from mmvl.checkpoint import schema
from mmvl.distributed import comm
from mmvl.engine.prepared import inner
from mmvl.errors import UserError


class LocalSGD:
    """Local SGD over the Engine (``accelerator``) and its prepared ``model``."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise UserError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): give a whole number of steps of 1 or "
                            "more between averages, e.g. 8.")
        strategy = accelerator.strategy
        if enabled and getattr(strategy, "shards_optimizer_state", False):
            raise UserError(f"LocalSGD averages the full parameters every rank keeps, and distributed.strategy="
                            f"{strategy.name} shards them or their updates; use distributed.strategy=ddp.")
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self.enabled = bool(enabled) and accelerator.world_size > 1
        self.num_steps = 0
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            checkpointables = self.accelerator.checkpointables
            checkpointables.register(schema.LOCAL_SGD, self)
            pending = checkpointables.claim(schema.LOCAL_SGD)
            if pending:
                self.load_state_dict(pending)
            self._no_sync = self.accelerator.strategy.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._average()
            self.accelerator.checkpointables.unregister(schema.LOCAL_SGD)
            no_sync, self._no_sync = self._no_sync, None
            if no_sync is not None:
                no_sync.__exit__(*exc)

    def step(self) -> None:
        """Count one step; at each ``local_sgd_steps``-th, average the parameters over the ranks."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = self.accelerator.reduce(param.data, reduction="mean")

    # -- checkpoints (a collective: every rank calls state_dict) ----------------------------------------
    def _own(self) -> dict[str, Any]:
        optimizer = self.accelerator.prepared_optimizer
        return {"parameters": [p.detach().cpu().clone() for p in self.model.parameters()],
                "optimizer": inner(optimizer).state_dict() if optimizer is not None else {}}

    def state_dict(self) -> dict[str, Any]:
        """The step count and, rank by rank, the parameters and optimizer state."""
        return {"num_steps": self.num_steps, "ranks": comm.all_gather_object(self._own())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's parameters and optimizer state back, and the count; saved at the same world size."""
        ranks = state.get("ranks") or []
        if len(ranks) != self.accelerator.world_size:
            raise UserError(f"this LocalSGD state was saved by {len(ranks)} processes and this run has "
                            f"{self.accelerator.world_size}; resume it at {len(ranks)} processes.")
        own = ranks[self.accelerator.rank]
        with torch.no_grad():
            for param, saved in zip(self.model.parameters(), own["parameters"]):
                param.copy_(saved)
        optimizer = self.accelerator.prepared_optimizer
        if optimizer is not None and own["optimizer"]:
            inner(optimizer).load_state_dict(own["optimizer"])
        self.num_steps = int(state["num_steps"])
