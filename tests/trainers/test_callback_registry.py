"""Callbacks come from the registry: the built-ins through ``training.builtin_callbacks`` (an ordered
list in configs/defaults.yaml), the user's after them; state is keyed by registered name."""
from __future__ import annotations

import torch

from mmvl import registry
from mmvl.config import load_config
from mmvl.trainers import Trainer
from mmvl.trainers.callbacks import Callback, LoggingCallback
from tests.fixtures.toy import register, toy_opts


class Tally(Callback):
    """Counts the updates it saw, from ``start``; its state is that count."""

    def __init__(self, trainer, start: int = 0):
        super().__init__(trainer)
        self.count = start

    def on_update_end(self, info):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = int(state["count"])


def _register() -> None:
    register()
    if "tally" not in registry.CALLBACKS:
        registry.CALLBACKS.register("tally", Tally)


def _trainer(tmp_path, *extra: str) -> Trainer:
    _register()
    return Trainer(load_config(toy_opts(tmp_path, "training.evaluation_interval=0", *extra)))


def test_the_builtins_are_the_listed_names_in_order(tmp_path):
    t = _trainer(tmp_path, "training.max_updates=2")
    listed = list(load_config(toy_opts(tmp_path)).training.builtin_callbacks)
    # trackers and curves are off in the toy options (training.tensorboard/curves=false: no tracker left),
    # ema too (training.ema.decay=0)
    assert t.callback_keys == [n for n in listed if n not in ("trackers", "curves", "ema")]


def test_naming_a_builtin_does_not_add_a_second_one(tmp_path):
    t = _trainer(tmp_path, "training.callbacks=[logging]")
    assert sum(isinstance(c, LoggingCallback) for c in t.callbacks) == 1
    assert t.callback_keys.count("logging") == 1


def test_two_instances_keep_their_own_state_across_a_resume(tmp_path):
    both = "training.callbacks=[{type: tally, params: {start: 0}}, {type: tally, params: {start: 100}}]"
    first = _trainer(tmp_path, both, "training.max_updates=4", "training.checkpoint_interval=4",
                     "checkpoint.resume=false")
    assert first.callback_keys[-2:] == ["tally", "tally[1]"]
    first.fit()
    # the checkpoint of update 4 is written by the built-in checkpoint callback, which runs before
    # the user's: their state then is that of update 3
    saved = torch.load(first.checkpoints.last_path, weights_only=True)["callbacks"]
    assert saved["tally"] == {"count": 3} and saved["tally[1]"] == {"count": 103}
    resumed = _trainer(tmp_path, both, "training.max_updates=6")
    assert [c.count for c in resumed.callbacks[-2:]] == [3, 103]
    resumed.fit()
    assert [c.count for c in resumed.callbacks[-2:]] == [5, 105]


def test_state_keyed_by_class_name_is_read_once(tmp_path):
    """A checkpoint of mmvl before registered names (callbacks keyed by class name) still resumes."""
    t = _trainer(tmp_path, "training.callbacks=[tally, tally]")
    t._load_callbacks({"Tally": {"count": 7}, "EarlyStopCallback": t.callbacks[3].state_dict()})
    assert [c.count for c in t.callbacks[-2:]] == [7, 0]
