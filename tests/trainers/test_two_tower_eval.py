"""A run's evaluation scores two-tower metrics through the model's encoders (no forward), equal to the
metrics computed directly on the trained model."""
from __future__ import annotations

import pytest
import torch

from mmvl.config import load_config
from mmvl.data.sample import collate
from mmvl.metrics import build_metrics
from mmvl.trainers import Trainer
from tests.fixtures.two_tower import CLASSNAMES, register

METRICS = ("evaluation.metrics=[{type: zero_shot, params: {classnames: [" + ", ".join(CLASSNAMES) + "], "
           "templates: ['a {} thing', '{}'], k: [1, 2]}}, {type: retrieval, params: {k: [1, 5], "
           "image_id_key: image_id, block_size: 4}}]")


def opts(tmp_path, *extra: str) -> list[str]:
    return ["model=two_tower", "datasets=pairs", f"env.save_dir={tmp_path}/save", f"env.data_dir={tmp_path}/data",
            "training.batch_size=8", "training.max_updates=4", "training.log_interval=2",
            "training.evaluation_interval=4", "training.checkpoint_interval=4", "training.num_workers=0",
            "training.progress_bar=false", "scheduler.params.num_warmup_steps=1", "optimizer.params.lr=0.01",
            "training.tensorboard=false", "training.curves=false", METRICS, *extra]


def test_run_evaluates_through_the_encoders(tmp_path):
    register()
    trainer = Trainer(load_config(opts(tmp_path)))
    calls = []
    trainer.model.register_forward_hook(lambda *a: calls.append(1))
    trainer.fit()
    forwards = len(calls)
    got = trainer.evaluate("val")["pairs"]
    assert len(calls) == forwards  # the forward never ran for the two-tower metrics
    assert set(got) == {"zero_shot_top1", "zero_shot_top2", "t2i_recall@1", "t2i_recall@5", "i2t_recall@1",
                        "i2t_recall@5", "mean_recall"}
    data = trainer.builders["pairs"].build("val")
    batch = collate([data[i] for i in range(len(data))])
    expected = {}
    for metric in build_metrics(list(trainer.config.evaluation.metrics)):
        metric.bind(trainer.model, lambda: trainer.builders["pairs"].text_processor)
        with torch.no_grad():
            expected.update(metric(batch, {}))
    assert got == pytest.approx(expected, abs=1e-6)


def _ddp_evaluate(env, root):
    register()
    trainer = Trainer(load_config(opts(root, "distributed.strategy=ddp", "run_type=val")), env=env)
    return trainer.evaluate("val")["pairs"]


@pytest.mark.slow  # ~16 s: two ranks start, build a run and train or evaluate it
@pytest.mark.proc
def test_two_ranks_under_ddp_equal_one_process(tmp_path):
    """21 samples over 2 ranks (one padded duplicate dropped), images shared across ranks: the same numbers."""
    from tests.distributed.dist_launch import launch

    register()
    single = Trainer(load_config(opts(tmp_path / "one", "run_type=val"))).evaluate("val")["pairs"]
    for result in launch(_ddp_evaluate, world_size=2, args=(str(tmp_path / "two"),), timeout=200):
        assert result == pytest.approx(single, abs=1e-6)
