"""The loop/callback contract (mmvl/trainers/state.py): the evaluation keeps the best value, early stop
only stops, the checkpoint callback writes best.ckpt from the state alone, and the Trainer dispatches
every hook and every published event itself. Built on stand-ins for the Trainer: no model, no data."""
from __future__ import annotations

from types import MethodType, SimpleNamespace

import pytest
from omegaconf import OmegaConf

from mmvl.checkpoint import schema
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from mmvl.trainers.callbacks import Callback, CheckpointCallback, EarlyStopCallback
from mmvl.trainers.evaluation import BestTracker
from mmvl.trainers.state import HOOKS, LOG_HOOK, Best, Evaluation, Sections, TrainerState


def _host(**training) -> SimpleNamespace:
    """What a callback sees of a Trainer (TrainerProtocol), with save_checkpoint recording its calls."""
    config = OmegaConf.create({"training": {"checkpoint_interval": 0, **training}})
    host = SimpleNamespace(state=TrainerState(max_updates=100), sections=Sections.of(config), saved=[],
                           callbacks=[], _published=[])
    host.save_checkpoint = lambda is_best=False, full=False: host.saved.append((host.state.update, is_best))
    host.publish = MethodType(Trainer.publish, host)
    host.dispatch = MethodType(Trainer.dispatch, host)
    return host


def _evaluate(host: SimpleNamespace, tracker: BestTracker, update: int, accuracy: float, loss: float) -> None:
    """What Trainer.evaluate does after the metrics are in: record, keep the best, then dispatch."""
    results = {"toy": {"accuracy": accuracy, "cross_entropy": loss, "total_loss": loss}}
    host.state.update = update
    host.state.last_eval = Evaluation(update, "val", results)
    tracker.update(host.state, "val", results)
    host.dispatch("on_evaluation_end", "val", results)


def test_the_evaluation_keeps_the_best_without_early_stop_and_best_ckpt_follows():
    host = _host()
    host.callbacks = [CheckpointCallback(host)]  # no early stop at all
    tracker = BestTracker(None, None, {"cross_entropy"})  # default: first metric that is not a loss
    for update, accuracy in ((2, 0.5), (4, 0.75), (6, 0.25)):
        _evaluate(host, tracker, update, accuracy, loss=1.0)
        host.dispatch("on_update_end", {})
    assert host.state.best == Best(0.75, 4)
    assert host.saved == [(2, True), (4, True)]  # a new best at 2 and 4; 6 was worse


def test_losses_are_minimised_and_other_splits_are_ignored():
    state = TrainerState()
    tracker = BestTracker("toy/total_loss", None, set())
    for update, loss in ((1, 2.0), (2, 1.0), (3, 1.5)):
        state.update = update
        tracker.update(state, "val", {"toy": {"total_loss": loss}})
    tracker.update(state, "test", {"toy": {"total_loss": 0.0}})
    assert state.best == Best(1.0, 2)
    with pytest.raises(UserError, match="training.early_stop.criteria"):
        BestTracker("toy/nope", None, set()).update(state, "val", {"toy": {"total_loss": 1.0}})


def test_is_best_needs_a_validation_at_this_very_update():
    state = TrainerState(update=4, best=Best(0.5, 4))
    assert not state.is_best  # resumed at the best's update: no evaluation yet
    state.last_eval = Evaluation(4, "test", {})
    assert not state.is_best
    state.last_eval = Evaluation(4, "val", {})
    assert state.is_best
    state.update = 5
    assert not state.is_best


@pytest.mark.parametrize("early_first", [True, False])
def test_early_stop_only_stops_after_patience_in_any_order(early_first):
    host = _host(early_stop={"enabled": True, "patience": 4})
    stop, ckpt = EarlyStopCallback(host), CheckpointCallback(host)
    host.callbacks = [stop, ckpt] if early_first else [ckpt, stop]
    tracker = BestTracker("toy/accuracy", None, set())
    stopped_at = None
    for update, accuracy in ((2, 0.5), (4, 0.5), (6, 0.5)):
        _evaluate(host, tracker, update, accuracy, loss=1.0)
        host.dispatch("on_update_end", {})
        if host.state.should_stop and stopped_at is None:
            stopped_at = update
    assert stopped_at == 6 and host.state.best == Best(0.5, 2)  # a tie is no improvement
    assert stop.state_dict() == {}  # nothing of its own to checkpoint any more


def test_early_stop_disabled_never_stops():
    host = _host(early_stop={"enabled": False, "patience": 0})
    host.callbacks = [EarlyStopCallback(host)]
    tracker = BestTracker("toy/accuracy", None, set())
    for update in (1, 2, 3):
        _evaluate(host, tracker, update, 0.5, loss=1.0)
    assert not host.state.should_stop


def test_published_events_reach_every_on_log_after_the_round_in_order():
    host = _host()
    calls = []

    class Recorder(Callback):
        def __init__(self, trainer, name):
            super().__init__(trainer)
            self.name = name

        def on_update_end(self, info):
            calls.append((self.name, "on_update_end"))
            if self.name == "publisher":
                self.trainer.publish({"n": 1})
                self.trainer.dispatch("on_evaluation_end", "val", {})  # an evaluation inside the round

        def on_evaluation_end(self, split, results):
            calls.append((self.name, "on_evaluation_end"))
            if self.name == "publisher":
                self.trainer.publish({"n": 2})

        def on_log(self, event):
            calls.append((self.name, event["n"]))

    host.callbacks = [Recorder(host, "sink"), Recorder(host, "publisher"), Recorder(host, "late")]
    host.dispatch("on_update_end", {})
    assert calls == [("sink", "on_update_end"), ("publisher", "on_update_end"),
                     ("sink", "on_evaluation_end"), ("publisher", "on_evaluation_end"), ("late", "on_evaluation_end"),
                     ("sink", 1), ("publisher", 1), ("late", 1), ("sink", 2), ("publisher", 2), ("late", 2),
                     ("late", "on_update_end")]
    assert host._published == []
    with pytest.raises(ValueError, match="on_update_end"):
        host.dispatch("on_upadte_end")
    assert LOG_HOOK not in HOOKS  # on_log is dispatched only as the events' delivery


def test_best_round_trips_and_older_checkpoints_give_it_from_early_stop_state():
    host = SimpleNamespace(state=TrainerState(update=7, best=Best(0.75, 6)), env=SimpleNamespace(world_size=2))
    counters = Trainer._counters(host)
    assert counters[schema.UPDATE] == 7 and counters[schema.WORLD_SIZE] == 2
    fresh = SimpleNamespace(state=TrainerState(), callback_keys=[], callbacks=[])
    Trainer._load_counters(fresh, counters)
    assert (fresh.state.update, fresh.state.best) == (7, Best(0.75, 6))
    for key in ("early_stop", "EarlyStopCallback"):  # by registered name; by class name (older still)
        old = SimpleNamespace(state=TrainerState(), callback_keys=[], callbacks=[])
        Trainer._load_counters(old, {schema.UPDATE: 6, schema.WORLD_SIZE: 1})
        Trainer._load_callbacks(old, {key: {"best_value": 0.5, "best_update": 4}})
        assert old.state.best == Best(0.5, 4)


def test_built_in_callbacks_read_only_their_sections(tmp_path):
    """Built on a host without ``config``: each callback takes its values from ``trainer.sections``."""
    import torch

    from mmvl.trainers.callbacks import EvaluationCallback, LoggingCallback, PreemptionCallback, ProfilerCallback

    config = OmegaConf.create({
        "run_type": "train", "env": {"save_dir": str(tmp_path)}, "checkpoint": {"slurm_requeue": True},
        "training": {"log_interval": 7, "checkpoint_interval": 5, "evaluation_interval": 3,
                     "preemption_check_interval": 2, "progress_bar": False,
                     "early_stop": {"enabled": True, "patience": 9}, "profiler": {"wait": 1}}})
    engine = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), precision="fp32")
    host = SimpleNamespace(state=TrainerState(), sections=Sections.of(config), engine=engine)
    assert not hasattr(host, "config")
    assert (EvaluationCallback(host).interval, EvaluationCallback(host).enabled) == (3, True)  # early stop on
    assert (EarlyStopCallback(host).enabled, EarlyStopCallback(host).patience) == (True, 9)
    assert CheckpointCallback(host).interval == 5
    preemption = PreemptionCallback(host)
    assert (preemption.interval, preemption.requeue) == (2, True)
    logging = LoggingCallback(host)
    assert (logging.interval, logging.progress_bar, logging.path) == (7, False, str(tmp_path / "metrics.jsonl"))
    profiler = ProfilerCallback(host)
    assert profiler.window == {"wait": 1, "warmup": 2, "active": 3} and not profiler.enabled
