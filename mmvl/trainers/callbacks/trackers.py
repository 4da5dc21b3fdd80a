"""The Trainer's trackers (``training.trackers``: TensorBoard, W&B, MLflow), rank 0 only.

What each tracker receives: ``train/<field>`` for every number of the logging callback's train
event (each loss, ``total_loss``, ``lr``, ``grad_norm``, throughput) at every ``log_interval``;
``<split>/<dataset>/<metric>`` at every evaluation; the resolved config at the start; at the end
the final metrics (the last ``train/total_loss`` and evaluation values: TensorBoard's hparams
table, W&B's summary). The train event comes through ``on_log``, so no collective runs twice.

Where (docs/first_run.md shows how to open each): TensorBoard in ``env.tensorboard_logdir``
(null: ``<save_dir>/tensorboard``), W&B in ``env.wandb_logdir`` (null: ``<save_dir>``)
``/wandb/offline-run-*`` without a key, MLflow in ``<save_dir>/mlruns``; the W&B project and MLflow
experiment are ``training.tracker_project``, the run is named after the save folder. The trackers
start at the first event and finish at the end of training (a test-split evaluation after it
starts them again).
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

from mmvl import tracking
from mmvl.config import schema
from mmvl.config.schema import typed_section
from mmvl.registry import register_callback
from mmvl.runs import BOOKKEEPING
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.callbacks.tensorboard import with_tensorboard_switch
from mmvl.trainers.state import TrainerProtocol


def active_trackers(config: Any) -> list[str]:
    """The trackers this run writes to: ``training.trackers`` after ``training.tensorboard``, checked
    (``config``: a loaded config or the Trainer's typed sections)."""
    names = [str(n) for n in schema.section(config, "training").trackers or []]  # null: none
    return tracking.resolve(with_tensorboard_switch(config, names), "training.trackers")


def tracker_kwargs(config: Any, update: int | None) -> dict[str, dict[str, Any]]:
    """Each tracker's constructor keywords: its folder from ``env.*_logdir``, the run's name."""
    env = typed_section(config, "env")
    save = str(env.save_dir)
    name = os.path.basename(os.path.normpath(save))
    return {"tensorboard": {"log_dir": env.tensorboard_logdir or os.path.join(save, "tensorboard"),
                            "purge_step": update},
            "wandb": {"dir": env.wandb_logdir or save, "name": name},
            "mlflow": {"run_name": name}}


@register_callback("trackers")
class TrackersCallback(Callback):
    @classmethod
    def wanted(cls, sections: Any) -> bool:
        return bool(active_trackers(sections))

    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.main = trainer.engine.is_main_process
        self.names = active_trackers(trainer.sections)
        self.trackers: list[tracking.Tracker] = []
        self.last_train: dict[str, float] = {}

    def _started(self, purge_step: int | None = None) -> list[tracking.Tracker]:
        if not self.trackers:
            sections = self.trainer.sections
            kwargs = tracker_kwargs(sections, purge_step)
            self.trackers = tracking.start(self.names, str(typed_section(sections, "training").tracker_project),
                                           str(sections.env.save_dir), {n: kwargs[n] for n in self.names if n in kwargs})
            values = OmegaConf.to_container(self.trainer.config, resolve=True)  # the whole config, recorded
            for tracker in self.trackers:
                tracker.store_init_configuration(values)  # type: ignore[arg-type]
        return self.trackers

    def on_train_start(self) -> None:
        if self.main:
            # a resumed run tells TensorBoard to drop what an earlier process logged past this update
            self._started(purge_step=self.trainer.state.update or None)

    def on_log(self, event: dict[str, Any]) -> None:
        if not self.main or event.get("split") != "train":
            return
        values = {f"train/{k}": v for k, v in _numbers(event).items()}
        self.last_train.update(values)
        for tracker in self._started():
            tracker.log(values, int(event["update"]))

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        if not self.main:
            return
        values = {f"{split}/{dataset}/{k}": v for dataset, vals in results.items() for k, v in _numbers(vals).items()}
        for tracker in self._started():
            tracker.log(values, self.trainer.state.update)

    def on_train_end(self) -> None:
        if not self.main or not self.trackers:
            return
        final = {k: v for k, v in self.last_train.items() if k == "train/total_loss"}
        last = self.trainer.state.last_eval
        if last is not None:
            _, split, results = last
            final.update({f"{split}/{d}/{k}": v for d, values in results.items() for k, v in _numbers(values).items()})
        for tracker in self.trackers:
            tracker.finish(final)
        self.trackers = []


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The plottable fields of an event: numbers, minus the bookkeeping ones (update, wall_s, ...)."""
    return {k: float(v) for k, v in values.items()
            if k not in BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool)}
