"""``training.packing`` under DDP at 2 gloo ranks with gradient accumulation: each rank packs its own
micro-batches, the answer-token count is summed over ranks as for padded batches, so the packed run
logs the padded run's losses (the first update's within 1e-5)."""
from __future__ import annotations

import json

import pytest
import torch

from mmvl.config import load_config
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.easy_vqa_generative_run import opts, write_root

pytestmark = pytest.mark.proc  # 2 spawned ranks, 2 runs each


def _runs(env, root: str, data: str) -> bool:
    from pathlib import Path

    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    common = ["dataset_config.easy_vqa_generative.task=conversation", "distributed.strategy=ddp", "run_type=train",
              "training.batch_size=8", "training.gradient_accumulation=2", "training.max_updates=3",
              "training.log_interval=1"]
    for name, extra in (("padded", []), ("packed", ["training.packing=true"])):
        trainer = Trainer(load_config(opts(Path(data), Path(root) / name, *common, *extra)), env=env)
        trainer.fit()
    return isinstance(trainer.model, DistributedDataParallel)


def _losses(save) -> list[float]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["answer_tokens"] for r in rows if r.get("split") == "train" and "answer_tokens" in r]


def test_ddp_packed_run_logs_the_padded_run_s_losses(tmp_path):
    data = write_root(tmp_path / "easy_vqa")
    assert launch(_runs, world_size=2, args=(str(tmp_path), str(data)), timeout=400) == [True, True]
    padded, packed = _losses(tmp_path / "padded"), _losses(tmp_path / "packed")
    assert len(padded) == len(packed) == 3
    assert packed[0] == pytest.approx(padded[0], rel=1e-5)
    assert packed == pytest.approx(padded, rel=1e-3)
