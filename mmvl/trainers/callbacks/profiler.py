"""``training.profiler``: torch.profiler over a window of updates, on rank 0.

After ``wait`` updates it warms up for ``warmup`` and records ``active`` updates
(CPU operators, and CUDA kernels on a GPU), then writes the trace to
``<save_dir>/profiler/rank0.<update>.pt.trace.json`` (Chrome trace format: Perfetto
and ``chrome://tracing`` open it; TensorBoard's profiler plugin reads the folder) and
logs the ten operators that took the most time, once. Only rank 0 profiles: the
other ranks run unchanged, so the trace shows rank 0 waiting for them at collectives.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from mmvl.io import atomic_write
from mmvl.errors import UserError
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol

log = logging.getLogger("mmvl")


@register_callback("profiler")
class ProfilerCallback(Callback):
    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        cfg = trainer.sections.training.profiler
        self.enabled = bool(cfg.enabled) and trainer.engine.is_main_process
        self.window = {k: int(getattr(cfg, k)) for k in ("wait", "warmup", "active")}
        if self.window["active"] < 1 or self.window["wait"] < 0 or self.window["warmup"] < 0:
            raise UserError(f"training.profiler: wait={self.window['wait']}, warmup={self.window['warmup']}, "
                            f"active={self.window['active']}; use wait, warmup >= 0 and active >= 1.")
        self.directory = os.path.join(str(trainer.sections.env.save_dir), "profiler")
        self.profiler: torch.profiler.profile | None = None
        self.trace: str | None = None

    def on_train_start(self) -> None:
        if not self.enabled or self.trace is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.trainer.engine.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(**self.window, repeat=1),
            on_trace_ready=self._write)
        self.profiler.start()

    def on_update_end(self, info: dict[str, Any]) -> None:
        if self.profiler is not None:
            self.profiler.step()  # writes the trace (``_write``) when the window closes
            if self.trace is not None:
                self.on_train_end()

    def on_train_end(self) -> None:
        if self.profiler is not None:  # the run ended inside the window: write what was recorded
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _write(self, profiler: torch.profiler.profile) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank0.{self.trainer.state.update}.pt.trace.json")
        export = f"{path}.export"
        try:
            profiler.export_chrome_trace(export)  # torch writes a path; the atomic writer publishes it
            with open(export, "rb") as src:
                atomic_write(path, "wb", lambda f: shutil.copyfileobj(src, f))
        finally:
            if os.path.exists(export):
                os.remove(export)
        self.trace = path
        sort = "device_time_total" if self.trainer.engine.device.type == "cuda" else "cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=10)
        log.info("Profiled updates %d-%d (trace: %s); top 10 operators by %s:\n%s",
                 self.trainer.state.update - self.window["active"] + 1, self.trainer.state.update, path, sort, table)
