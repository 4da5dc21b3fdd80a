"""``training.tensorboard``, MMF's switch for TensorBoard, as a filter on ``training.trackers``.

``auto`` (the default) keeps the ``tensorboard`` tracker that ``training.trackers`` lists when the
``tensorboard`` package is importable and drops it (with one log line) when not; ``true`` adds it
to the list and makes the package a requirement (a UserError without it); ``false`` drops it. The
event files themselves are written by :mod:`mmvl.tracking.tensorboard` through the trackers
callback (:mod:`mmvl.trainers.callbacks.trackers`).
"""
from __future__ import annotations

import importlib.util
import logging

from omegaconf import DictConfig

from mmvl.config.schema import typed_section
from mmvl.errors import UserError

log = logging.getLogger("mmvl")


def tensorboard_enabled(config: DictConfig) -> bool:
    """Resolve ``training.tensorboard`` (true | false | auto) against the installed packages."""
    value = typed_section(config, "training").tensorboard
    installed = importlib.util.find_spec("tensorboard") is not None
    if value is True and not installed:
        raise UserError("training.tensorboard=true but the tensorboard package is not installed; "
                        "`pip install tensorboard` (or 'mmvl[trackers]'), or set training.tensorboard=auto "
                        "(on when installed) or false.")
    if value == "auto" and not installed:
        log.info("training.tensorboard=auto: the tensorboard package is not installed, so no event "
                 "files are written (pip install tensorboard to get them).")
    return installed and value in (True, "auto")


def with_tensorboard_switch(config: DictConfig, names: list[str]) -> list[str]:
    """``names`` (``training.trackers``) with ``tensorboard`` kept, added or dropped as
    ``training.tensorboard`` says."""
    value = typed_section(config, "training").tensorboard
    if value is True and "tensorboard" not in names:
        names = [*names, "tensorboard"]
    if "tensorboard" in names and not tensorboard_enabled(config):
        names = [n for n in names if n != "tensorboard"]
    return names
