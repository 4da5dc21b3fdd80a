"""Checkpoint and stop on SIGTERM/SIGUSR1 (SLURM's warning signal, ``--signal=USR1@90``).

The handler only sets a flag; after each update every rank learns whether any
rank was signalled (one tiny all-reduce), so all ranks finish the same update,
save one checkpoint together and stop. Under SLURM with
``checkpoint.slurm_requeue=true`` rank 0 then requeues the job.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Any

import torch

from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback

log = logging.getLogger("mmvl")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@register_callback("preemption")
class PreemptionCallback(Callback):
    def __init__(self, trainer: Any, **params: Any):
        super().__init__(trainer)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    def on_train_start(self) -> None:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: signals cannot be caught here
                return

    def on_update_end(self, info: dict[str, Any]) -> None:
        if self.trainer.env.world_size == 1 and not self.received:
            return
        flag = torch.tensor([float(self.received or 0)])
        if self.trainer.env.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not flag.item():
            return
        t = self.trainer
        name = signal.Signals(int(flag.item())).name
        log.warning("Received %s: saving a checkpoint at update %d and stopping.", name, t.update)
        checkpoint = next(c for c in t.callbacks if type(c).__name__ == "CheckpointCallback")
        if checkpoint.saved_at != t.update:
            checkpoint.save()
        t.should_stop = True
        t.preempted = name
        if (t.config.checkpoint.get("slurm_requeue") and "SLURM_JOB_ID" in os.environ
                and t.engine.is_main_process):
            job = os.environ["SLURM_JOB_ID"]
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            if result.returncode == 0:
                log.warning("Requeued SLURM job %s.", job)
            else:
                log.error("scontrol requeue %s failed: %s", job, result.stderr.strip())

    def on_train_end(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
