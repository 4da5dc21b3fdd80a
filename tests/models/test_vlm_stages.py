"""The two LLaVA stages of projects/vlm/configs: stage 1 trains the projector only, stage 2 starts
from stage 1's checkpoint (``checkpoint.resume_pretrained``) and trains the projector and the LM
with the image encoder frozen. Both run the shipped configs at tiny size through the Trainer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.trainers import Trainer

PROJECT = Path(__file__).resolve().parents[2] / "projects" / "vlm" / "configs" / "sort_of_clevr_generative"
TINY = ["dataset_config.sort_of_clevr_generative.num_images=12",
        "dataset_config.sort_of_clevr_generative.num_val_images=4",
        "dataset_config.sort_of_clevr_generative.num_test_images=4",
        "dataset_config.sort_of_clevr_generative.questions_per_image=2",
        "model_config.vlm.image_encoder.params.channels=[8,8,8]",
        "model_config.vlm.language_model.random.hidden_size=32",
        "model_config.vlm.language_model.random.intermediate_size=64",
        "model_config.vlm.language_model.random.num_hidden_layers=1",
        "training.batch_size=8", "training.max_updates=3", "training.evaluation_interval=3",
        "training.checkpoint_interval=3", "training.log_interval=3", "training.progress_bar=false",
        "training.gradient_accumulation=2", "optimizer.params.lr=1e-2"]


def _params(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if n.startswith(prefix + ".")}


def _changed(before: dict, after: dict) -> list[str]:
    return [n for n in before if not torch.equal(before[n], after[n])]


@pytest.mark.slow  # two tiny training runs through the Trainer (~15-20 s on a shared CPU)
def test_stage_two_starts_from_stage_one_with_its_parts_frozen(tmp_path):
    common = [f"env.data_dir={tmp_path / 'data'}", *TINY]
    one = Trainer(load_config([f"config={PROJECT / 'stage1.yaml'}", f"env.save_dir={tmp_path / 's1'}", *common]))
    model = one.engine.unwrap_model(one.model)
    start = {part: _params(model, part) for part in ("image_encoder", "projector", "lm")}
    assert [n for n, p in model.named_parameters() if p.requires_grad] == list(start["projector"])
    one.fit()
    after_one = {part: _params(model, part) for part in start}
    assert _changed(start["projector"], after_one["projector"])
    assert not _changed(start["image_encoder"], after_one["image_encoder"])
    assert not _changed(start["lm"], after_one["lm"])
    ckpt = tmp_path / "s1" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()

    two = Trainer(load_config([f"config={PROJECT / 'stage2.yaml'}", f"env.save_dir={tmp_path / 's2'}",
                               f"checkpoint.resume_file={ckpt}", *common]))
    model2 = two.engine.unwrap_model(two.model)
    loaded = {part: _params(model2, part) for part in start}
    for part in start:  # stage 1's weights, not a fresh initialisation
        assert not _changed(after_one[part], loaded[part]), part
    assert two.update == 0  # weights only: counters start fresh
    frozen = {n for n, p in model2.named_parameters() if not p.requires_grad}
    assert frozen == set(loaded["image_encoder"])
    two.fit()
    after_two = {part: _params(model2, part) for part in start}
    assert not _changed(loaded["image_encoder"], after_two["image_encoder"])
    assert _changed(loaded["projector"], after_two["projector"]) and _changed(loaded["lm"], after_two["lm"])

    # mmvl_predict decodes the test split from stage 2's checkpoint: one row per question, in order
    from mmvl_cli.predict import main

    assert main([f"config={PROJECT / 'stage2.yaml'}", f"env.save_dir={tmp_path / 's2'}", *common,
                 f"checkpoint.resume_file={tmp_path / 's2' / 'checkpoints' / 'last.ckpt'}",
                 "checkpoint.resume_pretrained=false"]) == 0
    rows = json.loads((tmp_path / "s2" / "predictions" / "sort_of_clevr_generative_test.json").read_text())
    assert [r["id"] for r in rows] == list(range(8)) and all(isinstance(r["answer"], str) for r in rows)
