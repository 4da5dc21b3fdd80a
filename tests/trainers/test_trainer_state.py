"""What callbacks see of the Trainer: the per-interval train event (throughput, MFU) handed to
``on_log``, the declared state, ``save_checkpoint()`` and the LR schedule stepped by the loop."""
from __future__ import annotations

import json
import os
import signal

import pytest

from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from mmvl.trainers.callbacks import Callback, CheckpointCallback
from tests.fixtures.toy import register, toy_opts

register()
#: the toy model per sample: Linear(8, 16) and Linear(16, 3) forward (2*8*16 + 2*16*3), their weight
#: gradients (the same again) and the second layer's input gradient (2*16*3); LayerNorm/GELU count 0
TOY_FLOPS_PER_SAMPLE = 352 + 352 + 96


def test_log_events_carry_throughput_and_mfu_and_reach_on_log(tmp_path):
    trainer = Trainer(load_config(toy_opts(tmp_path, "training.peak_tflops=1e-6")))  # 1 MFLOP/s
    seen = []

    class Sink(Callback):
        def on_log(self, event):
            seen.append(event)

    trainer.callbacks.append(Sink(trainer))
    trainer.fit()
    assert trainer.flops.total == TOY_FLOPS_PER_SAMPLE * 8  # the first update, batch 8
    events = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    assert seen == events and {e["split"] for e in events} == {"train", "val"}
    train = [e for e in events if e["split"] == "train"]
    assert [e["update"] for e in train] == [4, 8, 12]
    for e in train:
        assert e["mfu"] == pytest.approx(TOY_FLOPS_PER_SAMPLE * e["samples_per_s"] / 1e6, rel=1e-2, abs=1e-4)
        assert e["samples_per_s"] > 0 and e["peak_mem_mb"] > 0 and "tokens_per_s" not in e  # no text here
    assert "MFU" in (tmp_path / "save" / "train.log").read_text()


def test_no_mfu_without_a_known_peak(tmp_path):
    Trainer(load_config(toy_opts(tmp_path, "training.max_updates=4"))).fit()
    train = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    assert "mfu" not in train[0]


def test_lr_schedule_steps_in_the_loop(tmp_path):
    """warmup_linear with 2 warm-up updates: the lr of update u is lr * min(1, (u-1)/2), then decays."""
    trainer = Trainer(load_config(toy_opts(tmp_path, "training.log_interval=1")))
    trainer.fit()
    lrs = [json.loads(line)["lr"] for line in open(tmp_path / "save" / "metrics.jsonl")
           if json.loads(line)["split"] == "train"]
    assert lrs[:3] == pytest.approx([0.0, 0.005, 0.01]) and lrs[-1] < lrs[2]
    assert trainer.scheduler.last_epoch == 12


def test_callbacks_save_through_the_trainer_without_finding_each_other(tmp_path):
    """Preemption saves through ``save_checkpoint()``: it works with no CheckpointCallback at all."""
    trainer = Trainer(load_config(toy_opts(tmp_path)))
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, CheckpointCallback)]
    state = trainer.state
    assert (state.should_stop, state.is_best, state.preempted, state.last_eval, state.last_saved) == \
        (False, False, None, None, -1)

    class Kill(Callback):
        def on_update_end(self, info):
            if self.trainer.state.update == 5:
                os.kill(os.getpid(), signal.SIGUSR1)

    trainer.callbacks.insert(0, Kill(trainer))
    trainer.fit()
    assert (state.update, state.preempted, state.last_saved) == (5, "SIGUSR1", 5)
    assert safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")["trainer"]["update"] == 5
    assert state.last_eval is None  # stopped before the evaluation at update 6


def test_preemption_check_interval_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="preemption_check_interval"):
        Trainer(load_config(toy_opts(tmp_path, "training.preemption_check_interval=0")))


@pytest.mark.cuda
def test_peak_memory_is_reset_every_log_interval_on_cuda(tmp_path):
    import torch

    trainer = Trainer(load_config(toy_opts(tmp_path, "training.device=cuda", "training.log_interval=2",
                                           "training.max_updates=6")))
    held = []

    class Spike(Callback):  # ~256 MB alive during update 2 only
        def on_update_start(self):
            if trainer.update + 1 == 2:
                held.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))

        def on_update_end(self, info):
            held.clear()

    trainer.callbacks.insert(0, Spike(trainer))
    trainer.fit()
    peaks = [json.loads(line)["peak_mem_mb"] for line in open(tmp_path / "save" / "metrics.jsonl")
             if json.loads(line)["split"] == "train"]
    assert len(peaks) == 3 and peaks[0] > 256 and peaks[1] < 128 and peaks[2] < 128, peaks
