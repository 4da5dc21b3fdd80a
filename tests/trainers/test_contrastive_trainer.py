"""The Trainer's contrastive path on shards: accumulation equals one step on the whole batch; caching
off is refused; recall@k of the clip model is reported."""
from __future__ import annotations

import pytest
import torch

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from tests.fixtures.shard_data import write_pair_shards

TINY = "projects/clip/configs/image_text_shards/tiny.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip_shards")
    train = write_pair_shards(root, n_samples=32, per_shard=8, size=32)
    write_pair_shards(root, n_samples=8, per_shard=8, prefix="val", size=32, first=100)
    return root, train["pattern"]


def _trainer(data, save, *opts) -> Trainer:
    root, pattern = data
    return Trainer(load_config([f"config={TINY}", f"env.data_dir={root}", f"env.save_dir={save}",
                                f"dataset_config.image_text_shards.splits.train.shards={pattern}",
                                "dataset_config.image_text_shards.shuffle_buffer=1", "training.max_updates=2",
                                "training.log_interval=1", "training.evaluation_interval=100",
                                "training.checkpoint_interval=100", "scheduler.type=null",
                                # SGD: Adam scales float noise in zero gradients (attention key biases) to full steps
                                "optimizer.type=sgd", "optimizer.params={lr: 0.1}", *opts]))


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.unwrap_model(trainer.model).state_dict().items()}


@pytest.mark.slow  # ~12 s: three Trainers (timm, the MiniLM tokenizer, shards)
def test_accumulation_keeps_the_contrast_global_and_caching_off_is_refused(data, tmp_path):
    big = _trainer(data, tmp_path / "big", "training.batch_size=16")
    big.fit()
    acc = _trainer(data, tmp_path / "acc", "training.batch_size=8", "training.gradient_accumulation=2")
    assert acc.cached_contrast
    acc.fit()
    for k, v in _params(big).items():
        torch.testing.assert_close(_params(acc)[k], v, rtol=0, atol=1e-5, msg=k)
    with pytest.raises(UserError, match="cache_features=false"):
        _trainer(data, tmp_path / "off", "training.batch_size=8", "training.update_frequency=2",
                 "model_config.clip.losses=[{type: clip, params: {cache_features: false}}]")
    results = big.evaluate("val")["image_text_shards"]
    assert {"recall@1", "recall@5", "recall@1/i2t", "clip"} <= set(results)
