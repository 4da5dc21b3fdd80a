"""SIGUSR1/SIGTERM: the current update is checkpointed, the run stops, and resuming matches."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from mmvl.checkpoint import safe_load
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
