"""A tiny end-to-end `mmvl_run` on Sort-of-CLEVR; guards the loss curve against recorded values."""
from __future__ import annotations

import json

import pytest
import torch

from mmvl_cli.run import main

# Recorded with torch 2.14.1 on CPU (one thread) from this exact config; a change in data
# generation, tokenisation, model initialisation, the loss or the step shows up here.
RECORDED = [2.2405617237091064, 2.246882438659668, 2.2375264167785645, 2.155728340148926]


def tiny_opts(tmp_path) -> list[str]:
    return ["model=visual_bert", "datasets=sort_of_clevr", f"env.save_dir={tmp_path}/save",
            f"env.data_dir={tmp_path}/data", "dataset_config.sort_of_clevr.num_images=64",
            "dataset_config.sort_of_clevr.num_val_images=8", "dataset_config.sort_of_clevr.num_test_images=8",
            "dataset_config.sort_of_clevr.questions_per_image=4",
            "model_config.visual_bert.hidden_size=32", "model_config.visual_bert.num_hidden_layers=1",
            "model_config.visual_bert.num_attention_heads=2", "model_config.visual_bert.intermediate_size=64",
            "model_config.visual_bert.hidden_dropout_prob=0.0",
            "model_config.visual_bert.attention_probs_dropout_prob=0.0",
            "model_config.visual_bert.max_position_embeddings=64", "model_config.visual_bert.image_size=75",
            "model_config.visual_bert.classifier_input=pooled_and_visual",
            "model_config.visual_bert.image_encoder.type=film_cnn",
            "model_config.visual_bert.image_encoder.params={channels: [8, 8, 16, 16]}",
            "training.batch_size=8", "training.max_updates=4", "training.log_interval=1",
            "training.evaluation_interval=4", "training.checkpoint_interval=4", "training.num_workers=0",
            "training.progress_bar=false", "scheduler.params.num_warmup_steps=1",
            "optimizer.params.lr=0.001"]


def test_tiny_sort_of_clevr_run_matches_recorded_losses(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(tiny_opts(tmp_path)) == 0
    finally:
        torch.set_num_threads(threads)
    events = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    losses = [e["total_loss"] for e in events if e["split"] == "train"]
    assert losses == pytest.approx(RECORDED, abs=1e-4)
    val = [e for e in events if e["split"] == "val"][-1]
    assert {"accuracy", "accuracy/relational", "accuracy/non_relational", "accuracy/prior"} <= set(val)
    assert (tmp_path / "save" / "checkpoints" / "last.ckpt").exists()
