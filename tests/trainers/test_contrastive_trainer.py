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


@pytest.mark.slow  # ~5 s: a Trainer (timm, the MiniLM tokenizer, shards)
def test_clip_with_ema_layer_decay_and_retrieval(data, tmp_path):
    """The knobs of docs/contrastive_eval.md on the real clip model: layer-wise lr per tower, the EMA
    weights evaluated by the two-tower metrics (through the encoders), the live weights back after."""
    from mmvl.data.sample import collate
    from mmvl.metrics import build_metrics

    trainer = _trainer(data, tmp_path / "knobs", "training.batch_size=8", "training.ema.decay=0.5",
                       "optimizer.layer_decay=0.5", "optimizer.no_weight_decay=[logit_scale]")
    module = trainer.engine.unwrap_model(trainer.model)
    group = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    lr = {n: group[id(p)]["lr"] for n, p in module.named_parameters()}
    assert lr["image_encoder.model.blocks.0.attn.qkv.weight"] == pytest.approx(0.1 * 0.25)
    assert lr["image_encoder.model.blocks.1.attn.qkv.weight"] == pytest.approx(0.1 * 0.5)
    assert lr["text_encoder.transformer.resblocks.0.attn.in_proj_weight"] == pytest.approx(0.1 * 0.25)
    assert lr["text_projection.weight"] == pytest.approx(0.1) == lr["logit_scale"]
    assert group[id(module.logit_scale)]["weight_decay"] == 0.0
    trainer.fit()
    ema = next(c for c in trainer.callbacks if type(c).__name__ == "EmaCallback")
    assert ema.updates == 2
    live = {k: v.detach().clone() for k, v in module.state_dict().items()}
    got = trainer.evaluate("val")["image_text_shards"]
    for k, v in module.state_dict().items():  # the live weights are back
        torch.testing.assert_close(v, live[k], rtol=0, atol=0)
    val = trainer.builders["image_text_shards"].build("val")
    batch = collate([val[i] for i in range(len(val))])
    specs = [m for m in trainer.config.dataset_config.image_text_shards.metrics if m.type == "retrieval"]

    def direct() -> dict[str, float]:
        (metric,) = build_metrics(specs)
        metric.bind(module, lambda: trainer.builders["image_text_shards"].text_processor)
        with torch.no_grad():
            return metric(batch, {})

    with ema.evaluating("val"):
        expected = direct()
    assert {k: got[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    assert any(not torch.equal(w, live[n]) for n, w in ema.state()["weights"].items())  # an average, not a copy
