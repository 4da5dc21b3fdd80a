"""Weights & Biases: a run per ``init_trackers``, offline unless it can reach the service.

Offline is chosen when neither ``WANDB_MODE`` nor ``init_kwargs["mode"]`` says otherwise and no
``WANDB_API_KEY`` is set: a cluster node without network or key must not stop or hang at
``wandb.init``. The run's files go under ``init_kwargs["dir"]`` (the Trainer: ``env.wandb_logdir``
or ``<save_dir>``), else ``logging_dir``, in ``wandb/offline-run-*``; the log says where, and
``wandb sync <that folder>`` uploads it later.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from mmvl.registry import register_tracker
from mmvl.tracking.base import Tracker, Value, numbers

log = logging.getLogger("mmvl")


def wandb_mode(init_kwargs: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """``online`` or ``offline`` (or what the user set): offline without a key."""
    if init_kwargs.get("mode"):
        return str(init_kwargs["mode"])
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


@register_tracker("wandb")
class WandBTracker(Tracker):
    name = "wandb"
    package = "wandb"

    def __init__(self, project_name: str, logging_dir: str, **init_kwargs: Any):
        super().__init__(project_name, logging_dir, **init_kwargs)
        import wandb

        kwargs = dict(init_kwargs)
        kwargs["mode"] = wandb_mode(init_kwargs)
        kwargs["dir"] = str(kwargs.get("dir") or logging_dir)
        os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(project=kwargs.pop("project", project_name), **kwargs)
        self.folder = str(self.run.settings.sync_dir)
        if kwargs["mode"] == "offline":
            log.info("W&B runs offline (no WANDB_API_KEY): its files are in %s; `wandb sync %s` uploads them.",
                     self.folder, self.folder)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    def log(self, values: Mapping[str, Value], step: int | None = None) -> None:
        kept = {k: (numbers(v) if isinstance(v, Mapping) else v) for k, v in values.items()}
        self.run.log(kept, step=step)

    def finish(self, final: Mapping[str, float] | None = None) -> None:
        if final:
            self.run.summary.update(dict(final))
        self.run.finish()
        log.info("W&B run %s written to %s", self.run.id, self.folder)
