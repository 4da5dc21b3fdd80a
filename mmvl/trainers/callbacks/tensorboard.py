"""TensorBoard event files in ``<save_dir>/tensorboard/`` (rank 0 only).

Tags: ``train/<field>`` for every number of the logging callback's train event (each
loss, ``total_loss``, ``lr``, ``grad_norm``, throughput) at every ``log_interval``;
``<split>/<dataset>/<metric>`` at every evaluation; ``config`` (the resolved config
as text) at the start; and at the end the config as hparams with the final metrics
(the last train losses and evaluation values, whose scalar tags the hparams table
reads). The train event comes through ``on_log``, so no collective runs twice.

``training.tensorboard``: ``auto`` (the default) turns this on when the ``tensorboard``
package is importable; ``true`` without it is a UserError.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mmvl.config.access import config_value
from mmvl.errors import UserError
from mmvl.registry import register_callback
from mmvl.runs import BOOKKEEPING, flatten
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol

log = logging.getLogger("mmvl")
#: the values of training.tensorboard


def tensorboard_enabled(config: DictConfig) -> bool:
    """Resolve ``training.tensorboard`` (true | false | auto) against the installed packages."""
    value = config_value(config, "training.tensorboard", "auto")
    installed = importlib.util.find_spec("tensorboard") is not None
    if value is True and not installed:
        raise UserError("training.tensorboard=true but the tensorboard package is not installed; "
                        "`pip install tensorboard`, or set training.tensorboard=auto (on when installed) "
                        "or false.")
    if value == "auto" and not installed:
        log.info("training.tensorboard=auto: the tensorboard package is not installed, so no event "
                 "files are written (pip install tensorboard to get them).")
    return installed and value in (True, "auto")


@register_callback("tensorboard")
class TensorBoardCallback(Callback):
    @classmethod
    def wanted(cls, config: Any) -> bool:
        return tensorboard_enabled(config)

    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.main = trainer.engine.is_main_process
        self.dir = os.path.join(str(trainer.config.env.save_dir), "tensorboard")
        self.writer: Any = None
        self.last_train: dict[str, float] = {}

    def _writer(self, purge_step: int | None = None) -> Any:
        """Opened on first use (and again after ``on_train_end`` for a test-split evaluation)."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=self.dir, purge_step=purge_step)
        return self.writer

    def on_train_start(self) -> None:
        if not self.main:
            return
        # a resumed run tells TensorBoard to drop what an earlier process logged past this update
        self._writer(purge_step=self.trainer.state.update or None)
        text = OmegaConf.to_yaml(self.trainer.config, resolve=True)
        # four-space indentation makes TensorBoard's Markdown show it as a code block
        self._writer().add_text("config", "\n".join("    " + line for line in text.splitlines()),
                                self.trainer.state.update)

    def on_log(self, event: dict[str, Any]) -> None:
        if not self.main or event.get("split") != "train":
            return
        writer = self._writer()
        for key, value in _numbers(event).items():
            writer.add_scalar(f"train/{key}", value, int(event["update"]))
            self.last_train[f"train/{key}"] = value
        writer.flush()

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        if not self.main:
            return
        writer = self._writer()
        for dataset, values in results.items():
            for key, value in _numbers(values).items():
                writer.add_scalar(f"{split}/{dataset}/{key}", value, self.trainer.state.update)
        writer.flush()

    def on_train_end(self) -> None:
        if not self.main:
            return
        from torch.utils.tensorboard.summary import hparams

        final = {k: v for k, v in self.last_train.items() if k == "train/total_loss"}
        last = self.trainer.state.last_eval
        if last is not None:
            _, split, results = last
            final.update({f"{split}/{d}/{k}": v for d, values in results.items()
                          for k, v in _numbers(values).items()})
        config = flatten(OmegaConf.to_container(self.trainer.config, resolve=True))
        hp = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in config.items()}
        writer = self._writer()
        for summary in hparams(hp, final):
            writer.file_writer.add_summary(summary, self.trainer.state.update)
        writer.close()
        self.writer = None


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The plottable fields of an event: numbers, minus the bookkeeping ones (update, wall_s, ...)."""
    return {k: float(v) for k, v in values.items()
            if k not in BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool)}
