"""SIGUSR1/SIGTERM: the current update is checkpointed, the run stops, and resuming matches."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.trainers import Trainer
from mmvl.trainers.callbacks import Callback
from tests.fixtures.toy import register, toy_opts

register()


def _weights(trainer):
    return trainer.engine.unwrap_model(trainer.model).state_dict()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_saves_current_update_and_resume_matches(tmp_path, sig):
    opts = ("model_config.toy_mlp.hidden_dropout_prob=0.1", "training.checkpoint_interval=100")
    straight = Trainer(load_config(toy_opts(tmp_path / "a", *opts)))
    straight.fit()

    trainer = Trainer(load_config(toy_opts(tmp_path / "b", *opts)))

    class Kill(Callback):
        def on_update_end(self, info):
            if trainer.update == 7:
                os.kill(os.getpid(), sig)

    trainer.callbacks.insert(0, Kill(trainer))
    trainer.fit()
    assert trainer.update == 7 and trainer.preempted == signal.Signals(sig).name
    state = safe_load(str(tmp_path / "b" / "save" / "checkpoints" / "last.ckpt"))
    assert state["trainer"]["update"] == 7
    assert signal.getsignal(sig) is not None  # handlers restored after training

    resumed = Trainer(load_config(toy_opts(tmp_path / "b", *opts, "checkpoint.resume=true")))
    resumed.fit()
    for k, v in _weights(straight).items():
        assert torch.equal(v, _weights(resumed)[k]), k


def _two_ranks(env, root: str) -> tuple[int, str, int]:
    """Rank 1 alone is signalled after update 4; checks every 3 updates (asynchronous)."""
    register()
    torch.set_num_threads(1)
    trainer = Trainer(load_config(toy_opts(root, "distributed.strategy=ddp", "training.max_updates=20",
                                           "training.preemption_check_interval=3",
                                           "training.checkpoint_interval=100")), env=env)

    class Kill(Callback):
        def on_update_end(self, info):
            if trainer.update == 4 and env.rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    trainer.callbacks.insert(0, Kill(trainer))
    trainer.fit()
    return trainer.update, trainer.preempted, trainer.last_saved


@pytest.mark.slow  # two gloo processes
def test_every_rank_stops_at_the_same_update_within_two_intervals(tmp_path):
    from tests.distributed.dist_launch import launch

    results = launch(_two_ranks, world_size=2, args=(str(tmp_path),), timeout=120)
    # the flag joins the all-reduce started at update 6 and is read at update 9, on both ranks
    assert results == [(9, "SIGUSR1", 9), (9, "SIGUSR1", 9)]
    assert safe_load(str(tmp_path / "save" / "checkpoints" / "last.ckpt"))["trainer"]["update"] == 9
