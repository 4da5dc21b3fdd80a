"""Progress bar, a log line every ``log_interval``, and ``metrics.jsonl`` (rank 0 only).

Each train event holds the interval's mean losses, the lr, samples/s, tokens/s,
MFU (when the device's peak FLOP/s is known: ``training.peak_tflops`` or the table
in :mod:`mmvl.utils.flops`) and peak memory (CUDA: allocated by tensors, reset every
interval; CPU: the process's peak resident size). The FLOPs per sample are counted
once, on the first update. Every event carries ``wall_s``: the run's wall time so far
(training and evaluation, summed over resumed segments, downtime excluded). Every event is
published (``trainer.publish``): the Trainer hands it to every callback's ``on_log``
(TensorBoard, trackers), so the train event's collective runs once.
"""
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

from mmvl.io import cut_torn_line
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol
from mmvl.utils.flops import mfu, peak_flops

log = logging.getLogger("mmvl")


@register_callback("logging")
class LoggingCallback(Callback):
    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.main = trainer.engine.is_main_process
        training = trainer.sections.training
        self.interval = max(1, int(training.log_interval or 1))
        self.progress_bar = bool(training.progress_bar)
        self.path = os.path.join(str(trainer.sections.env.save_dir), "metrics.jsonl")
        if self.main:  # a run killed while writing left half an event: cut it, or the next one joins it
            torn = cut_torn_line(self.path)
            if torn:
                log.warning("metrics.jsonl ended in an unfinished line (%d bytes, from a run that was killed "
                            "while writing it); removed it before appending", torn)
        self.bar: tqdm | None = None
        self.peak = peak_flops(trainer.engine.device, trainer.engine.precision, training.peak_tflops)
        self.flops_per_sample: float | None = None
        self.wall_before, self.wall_start = 0.0, time.perf_counter()  # wall_s of earlier segments
        self._reset_window()

    def _reset_window(self) -> None:
        self.window: list[dict[str, torch.Tensor]] = []  # each update's losses (and grad norm): device tensors
        self.samples, self.tokens, self.start = 0, 0, time.perf_counter()
        self.restart_clock = False
        if self.trainer.engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.trainer.engine.device)

    def write(self, event: dict[str, Any]) -> None:
        """Append ``event`` to metrics.jsonl (rank 0) and publish it to every callback's ``on_log``."""
        event["wall_s"] = round(self.wall_before + time.perf_counter() - self.wall_start, 3)
        if self.main:
            with open(self.path, "ab") as f:  # one write of the whole line: a crash can tear only the last
                f.write((json.dumps(event) + "\n").encode("utf-8"))
        self.trainer.publish(event)

    def on_train_start(self) -> None:
        state = self.trainer.state
        # a bar only on a terminal: in a file (a SLURM log) its \r frames are noise, and the
        # log lines below say the same (update/total, loss, speed, time left)
        if self.main and self.progress_bar and sys.stderr.isatty():
            self.bar = tqdm(total=state.max_updates, initial=state.update, desc="train", unit="upd",
                            dynamic_ncols=True, leave=False)
        self._reset_window()

    def on_update_end(self, info: dict[str, Any]) -> None:
        if self.flops_per_sample is None and self.trainer.flops.total:  # counted on the first update
            self.flops_per_sample = self.trainer.flops.total * self.trainer.env.world_size / info["samples"]
        values = info["losses"]  # kept as they are: the means are taken at the log interval
        if info.get("grad_norm") is not None:
            values = {**values, "grad_norm": info["grad_norm"]}
        self.window.append(values)
        self.samples += info["samples"]
        self.tokens += info.get("tokens", 0)
        if self.bar is not None:
            self.bar.update(1)
        state = self.trainer.state
        if state.update % self.interval == 0 or state.update >= state.max_updates:
            self._log(info)

    def _log(self, info: dict[str, Any]) -> None:
        t, state = self.trainer, self.trainer.state
        keys = dict.fromkeys(k for values in self.window for k in values)  # datasets may differ in losses
        means = t.engine.reduce_dict({k: torch.stack([v[k].float() for v in self.window if k in v]).mean()
                                  for k in keys})
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        samples_per_s = self.samples / elapsed
        util = mfu(self.flops_per_sample, samples_per_s, self.peak, t.env.world_size)
        event = {"update": state.update, "epoch": state.epoch, "split": "train",
                 **{k: float(v) for k, v in means.items()},
                 "lr": info["lr"], "samples_per_s": round(samples_per_s, 2),
                 "s_per_update": round(elapsed / len(self.window), 4),
                 "peak_mem_mb": round(_peak_memory_mb(t.engine.device), 1)}
        if self.tokens:
            event["tokens_per_s"] = round(self.tokens / elapsed, 1)
        if util is not None:
            event["mfu"] = round(util, 4)
        if self.main:
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{event['total_loss']:.4f}", refresh=False)
            extra = (f" | {event['tokens_per_s']:.0f} tokens/s" if self.tokens else "") + \
                (f" | MFU {100 * util:.1f}%" if util is not None else "")
            log.info("update %d/%d | epoch %d | loss %.4f | lr %.3g | %.1f samples/s%s | "
                     "%.3f s/update | peak mem %.0f MB | eta %s", state.update, state.max_updates, state.epoch,
                     event["total_loss"], event["lr"], event["samples_per_s"], extra,
                     event["s_per_update"], event["peak_mem_mb"],
                     _clock(event["s_per_update"] * (state.max_updates - state.update)))
        self.write(event)
        self._reset_window()

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        state = self.trainer.state
        for dataset, values in results.items():
            self.write({"update": state.update, "epoch": state.epoch, "split": split,
                        "dataset": dataset, **values})
            if self.main:
                shown = " | ".join(f"{k} {v:.4f}" for k, v in values.items())
                log.info("%s %s @ update %d | %s", split, dataset, state.update, shown)
        self.restart_clock = True  # evaluation (and what follows it) is not training throughput

    def on_update_start(self) -> None:
        if self.restart_clock:
            self.start, self.restart_clock = time.perf_counter(), False

    def on_train_end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def state_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_before + time.perf_counter() - self.wall_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wall_before, self.wall_start = float(state.get("wall_s", 0.0)), time.perf_counter()


def _clock(seconds: float) -> str:
    """``h:mm:ss``, as the progress bar shows time left."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
