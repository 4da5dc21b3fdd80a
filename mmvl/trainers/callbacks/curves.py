"""``<save_dir>/curves.png``, redrawn at every evaluation and at the end of training (rank 0).

It is drawn from ``metrics.jsonl`` (so a resumed run's picture covers its whole history)
after the logging callback has written the evaluation. One picture costs a few tenths of a
second, paid only at evaluation time, never inside the training step.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from mmvl.config.schema import typed_section
from mmvl.registry import register_callback
from mmvl.trainers.callbacks.base import Callback
from mmvl.trainers.state import TrainerProtocol

log = logging.getLogger("mmvl")


@register_callback("curves")
class CurvesCallback(Callback):
    @classmethod
    def wanted(cls, sections: Any) -> bool:
        return bool(typed_section(sections, "training").curves)

    def __init__(self, trainer: TrainerProtocol, **params: Any):
        super().__init__(trainer)
        self.main = trainer.engine.is_main_process
        self.save_dir = str(trainer.sections.env.save_dir)
        self.drawn_size = -1  # metrics.jsonl's size at the last drawing: unchanged, no redraw

    def draw(self) -> None:
        events = os.path.join(self.save_dir, "metrics.jsonl")
        if not self.main or not os.path.isfile(events) or os.path.getsize(events) == self.drawn_size:
            return
        from mmvl.plots import draw_run
        from mmvl.runs import Run

        size = os.path.getsize(events)
        try:
            draw_run(Run(self.save_dir), os.path.join(self.save_dir, "curves.png"))
        except Exception as e:  # noqa: BLE001 - a picture must never end a training run
            log.warning("curves.png was not updated: %s: %s", type(e).__name__, e)
            return
        self.drawn_size = size

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None:
        if split == "val":  # the picture shows validation curves; a test evaluation adds none
            self.draw()

    def on_train_end(self) -> None:
        self.draw()
