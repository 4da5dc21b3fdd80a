"""Checkpoint and stop on SIGTERM/SIGUSR1 (SLURM's warning signal, ``--signal=USR1@90``) and on
the first Ctrl-C (SIGINT); a second Ctrl-C stops at once. One Ctrl-C can arrive twice within a
moment (the terminal signals the whole process group and mmvl's launcher forwards it again):
signals :data:`SAME_CTRL_C_S` apart count as one.

The handler only sets a flag. One process reads it after every update (a Python
value: no device involved). Several processes must agree on the update at which
they stop, without a collective that waits on every update: every
``training.preemption_check_interval`` updates each rank starts an all-reduce (max)
of its flag on the communication device and reads the one it started at the
previous check, which finished long ago. So every rank stops at the same update, at
most two intervals after the signal, saves one checkpoint together and stops. Under
SLURM with ``checkpoint.slurm_requeue=true`` rank 0 then requeues the job.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Any

from mmvl.errors import UserError
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol

log = logging.getLogger("mmvl")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: two SIGINTs closer than this are one Ctrl-C delivered twice
SAME_CTRL_C_S = 1.0


@register_callback("preemption")
class PreemptionCallback(Callback):
    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        interval = trainer.sections.training.preemption_check_interval
        self.requeue = bool(trainer.sections.checkpoint.slurm_requeue)
        self.interval = 1 if interval is None else int(interval)
        if self.interval < 1:
            raise UserError(f"training.preemption_check_interval={self.interval} must be >= 1 (updates "
                            "between two checks of a preemption signal across the ranks).")
        self._pending: Any = None  # the Engine's async_max started at the previous check
        self._ctrl_c: float | None = None  # when the first Ctrl-C came

    def _handler(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._ctrl_c is not None and now - self._ctrl_c > SAME_CTRL_C_S:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the checkpoint
            if self._ctrl_c is None:
                self._ctrl_c = now
                if self.trainer.engine.is_main_process:
                    log.warning("Ctrl-C: saving a checkpoint at the next update the ranks agree on, then "
                                "stopping; press Ctrl-C again to stop at once.")
        self.received = signum

    def on_train_start(self) -> None:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: signals cannot be caught here
                return

    def _agreed_signal(self) -> int:
        """The signal any rank received before the previous check (0: none); same on every rank."""
        t = self.trainer
        if t.env.world_size == 1:
            return int(self.received or 0)
        if t.state.update % self.interval:
            return 0
        signum = self._pending.result() if self._pending is not None else 0
        self._pending = None if signum else t.engine.async_max(int(self.received or 0))
        return signum

    def on_update_end(self, info: dict[str, Any]) -> None:
        signum = self._agreed_signal()
        if not signum:
            return
        t, state = self.trainer, self.trainer.state
        name = signal.Signals(signum).name
        log.warning("Received %s: saving a checkpoint at update %d and stopping.", name, state.update)
        if state.last_saved != state.update:
            t.save_checkpoint()
        state.should_stop = True
        state.preempted = name
        if (self.requeue and "SLURM_JOB_ID" in os.environ
                and t.engine.is_main_process and signum != signal.SIGINT):  # Ctrl-C: the user stops it
            job = os.environ["SLURM_JOB_ID"]
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            if result.returncode == 0:
                log.warning("Requeued SLURM job %s.", job)
            else:
                log.error("scontrol requeue %s failed: %s", job, result.stderr.strip())

    def on_train_end(self) -> None:
        if self._pending is not None:  # every rank started it: finish it before other collectives
            self._pending.result()
            self._pending = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
