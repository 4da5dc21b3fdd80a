"""The Trainer counts the FLOPs of its first update on a side pass that leaves the run untouched:
the same count as ``FlopCounterMode`` around the real update, bitwise the same run as without
counting (dropout draws, BatchNorm statistics, gradients, data order), and a compiled model
compiles on update 1 (under a dispatch mode Dynamo skips, so counting the real update ran it eager).
FSDP's gradients held between micro-batches: tests/trainers/test_trainer_distributed.py (fsdp,
gradient_accumulation=2, equal to a single-process run)."""
from __future__ import annotations

import torch

from mmvl.config import load_config
from mmvl.trainers import Trainer
from mmvl.utils.flops import count_flops
from tests.fixtures.toy import register, toy_opts

register()
#: dropout draws from the CPU generator, BatchNorm updates running statistics, two micro-batches an update
OPTS = ("model_config.toy_mlp.hidden_dropout_prob=0.5", "model_config.toy_mlp.batch_norm=true",
        "training.gradient_accumulation=2", "training.max_updates=2", "training.log_interval=2",
        "training.evaluation_interval=100", "training.checkpoint_interval=100", "run_type=train")


def _trainer(tmp_path, name: str, *extra: str, count: bool = True) -> Trainer:
    trainer = Trainer(load_config(toy_opts(tmp_path / name, *OPTS, *extra)))
    if not count:
        trainer.flops.total = 0  # as if counted already: this run never counts
    return trainer


def test_counting_leaves_the_run_bitwise_unchanged_and_counts_as_before(tmp_path):
    counted = _trainer(tmp_path, "counted")  # each built, then trained (a Trainer seeds the generator)
    counted.fit()
    rng_counted = torch.get_rng_state()
    plain = _trainer(tmp_path, "plain", count=False)
    plain.fit()
    assert torch.equal(torch.get_rng_state(), rng_counted)  # the same draws after the same seeding
    assert counted.train_data.state_dict() == plain.train_data.state_dict()  # the same batches consumed
    want, got = plain.model.state_dict(), counted.model.state_dict()
    assert set(got) == set(want) and any("running_mean" in k for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]

    # today's count: FlopCounterMode around the real first update (both micro-batches) of the same run
    before = _trainer(tmp_path, "before", count=False)
    before.model.train()
    assert counted.flops.total == count_flops(before.train_step) > 0


def test_compiled_model_compiles_on_the_first_update(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = _trainer(tmp_path, "compiled", "training.compile=true", "training.compile_backend=eager",
                       "training.max_updates=1")
    trainer.fit()
    assert trainer.flops.total and counters["stats"]["unique_graphs"] >= 1  # counted, and update 1 compiled
    torch._dynamo.reset()
