"""TensorBoard event files: numbers as scalars, texts as text, a mapping of numbers as one chart,
the configuration as text at the start and, with the final metrics, as the hparams table at the end.

Where: ``init_kwargs["log_dir"]`` (the Trainer: ``env.tensorboard_logdir`` or
``<save_dir>/tensorboard``), else ``<logging_dir>/<project_name>`` as Accelerate writes it. Every
other init keyword goes to ``SummaryWriter`` (``purge_step``: a resumed run drops what an earlier
process logged past it).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import yaml

from mmvl.registry import register_tracker
from mmvl.tracking.base import Tracker, Value, flat, numbers


@register_tracker("tensorboard")
class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"

    def __init__(self, project_name: str, logging_dir: str, **init_kwargs: Any):
        super().__init__(project_name, logging_dir, **init_kwargs)
        from torch.utils.tensorboard import SummaryWriter

        kwargs = dict(init_kwargs)
        self.dir = str(kwargs.pop("log_dir", None) or os.path.join(logging_dir, project_name))
        self.writer = SummaryWriter(log_dir=self.dir, **kwargs)
        self.hparams: dict[str, Any] | None = None
        self.step = 0

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(_plain(values), sort_keys=False, default_flow_style=False)
        # four-space indentation makes TensorBoard's Markdown show it as a code block
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), self.step)
        self.hparams = {k: v if v is not None else "null" for k, v in flat(values).items()}
        self.writer.flush()

    def log(self, values: Mapping[str, Value], step: int | None = None) -> None:
        if step is not None:
            self.step = max(self.step, int(step))
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, step)
            elif isinstance(value, Mapping):
                self.writer.add_scalars(key, numbers(value), step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def finish(self, final: Mapping[str, float] | None = None) -> None:
        if self.hparams is not None:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(self.hparams, dict(final or {})):
                self.writer.file_writer.add_summary(summary, self.step)
        self.writer.close()


def _plain(values: Any) -> Any:
    """``values`` as YAML can write it (mappings and lists of scalars; anything else as text)."""
    if isinstance(values, Mapping):
        return {str(k): _plain(v) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return [_plain(v) for v in values]
    return values if values is None or isinstance(values, (bool, int, float, str)) else str(values)
