"""Progress bar, a log line every ``log_interval``, and ``metrics.jsonl`` (rank 0 only)."""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from mmvl.distributed import comm
from mmvl.optim import base_lr
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback

log = logging.getLogger("mmvl")


@register_callback("logging")
class LoggingCallback(Callback):
    def __init__(self, trainer: Any, **params: Any):
        super().__init__(trainer)
        self.main = trainer.engine.is_main_process
        self.interval = max(1, int(trainer.config.training.log_interval or 1))
        self.path = os.path.join(str(trainer.config.env.save_dir), "metrics.jsonl")
        self.bar: tqdm | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count, self.samples, self.start = 0, 0, time.perf_counter()

    def write(self, event: dict[str, Any]) -> None:
        if not self.main:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    def on_train_start(self) -> None:
        t = self.trainer
        # a bar only on a terminal: in a file (a SLURM log) its \r frames are noise, and the
        # log lines below say the same (update/total, loss, speed, time left)
        if self.main and t.config.training.get("progress_bar", True) and sys.stderr.isatty():
            self.bar = tqdm(total=t.max_updates, initial=t.update, desc="train", unit="upd",
                            dynamic_ncols=True, leave=False)
        self._reset_window()

    def on_update_end(self, info: dict[str, Any]) -> None:
        for k, v in info["losses"].items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.samples += info["samples"]
        if info.get("grad_norm") is not None:
            self.sums["grad_norm"] = self.sums.get("grad_norm", 0.0) + info["grad_norm"].float()
        if self.bar is not None:
            self.bar.update(1)
        t = self.trainer
        if t.update % self.interval == 0 or t.update >= t.max_updates:
            self._log(info)

    def _log(self, info: dict[str, Any]) -> None:
        t = self.trainer
        means = comm.reduce_dict({k: torch.as_tensor(v) / self.count for k, v in self.sums.items()})
        elapsed = time.perf_counter() - self.start
        event = {"update": t.update, "epoch": t.epoch, "split": "train",
                 **{k: float(v) for k, v in means.items()},
                 "lr": info.get("lr", base_lr(t.optimizer)),
                 "samples_per_s": round(self.samples / max(elapsed, 1e-9), 2),
                 "s_per_update": round(elapsed / self.count, 4),
                 "peak_mem_mb": round(_peak_memory_mb(t.engine.device), 1)}
        self.write(event)
        if self.main:
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{event['total_loss']:.4f}", refresh=False)
            log.info("update %d/%d | epoch %d | loss %.4f | lr %.3g | %.1f samples/s | "
                     "%.3f s/update | peak mem %.0f MB | eta %s", t.update, t.max_updates, t.epoch,
                     event["total_loss"], event["lr"], event["samples_per_s"],
                     event["s_per_update"], event["peak_mem_mb"],
                     _clock(event["s_per_update"] * (t.max_updates - t.update)))
        self._reset_window()

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        t = self.trainer
        for dataset, values in results.items():
            self.write({"update": t.update, "epoch": t.epoch, "split": split,
                        "dataset": dataset, **values})
            if self.main:
                shown = " | ".join(f"{k} {v:.4f}" for k, v in values.items())
                log.info("%s %s @ update %d | %s", split, dataset, t.update, shown)
        self.start = time.perf_counter()  # evaluation time is not training throughput

    def on_train_end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _clock(seconds: float) -> str:
    """``h:mm:ss``, as the progress bar shows time left."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
