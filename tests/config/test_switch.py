"""Choosing another type for the optimizer or scheduler brings its parameters; run_type names stages."""
from __future__ import annotations

import logging

import pytest
import torch

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.optim import build_optimizer, build_scheduler, optimizer_section, scheduler_section
from mmvl.trainers.trainer import run
from tests.fixtures.toy import register, toy_opts

DEMO = "config=projects/relation_network/configs/sort_of_clevr/defaults.yaml"


def test_switching_the_optimizer_drops_what_it_refuses(caplog):
    with caplog.at_level(logging.INFO, logger="mmvl"):
        config = load_config([DEMO, "optimizer.type=sgd"])
    assert dict(config.optimizer.params) == {"lr": 1e-3, "weight_decay": 0.01}  # the demo's lr is kept
    assert "optimizer.type=sgd does not take eps" in caplog.text and "defaults.yaml" in caplog.text
    optimizer = build_optimizer(torch.nn.Linear(2, 2), optimizer_section(config))
    assert type(optimizer).__name__ == "SGD" and optimizer.defaults["momentum"] == 0  # SGD's own default


def test_a_refused_parameter_typed_on_the_command_line_is_still_an_error():
    config = load_config([DEMO, "optimizer.type=sgd", "optimizer.params.eps=1e-6"])
    with pytest.raises(UserError, match="optimizer.params.eps is not accepted by optimizer 'sgd'"):
        build_optimizer(torch.nn.Linear(2, 2), optimizer_section(config))


def test_a_misspelt_parameter_without_a_switch_still_stops():
    config = load_config([DEMO, "optimizer.params.epz=1e-6"])
    with pytest.raises(UserError, match="epz"):
        build_optimizer(torch.nn.Linear(2, 2), optimizer_section(config))


def test_switching_the_scheduler_keeps_what_it_takes():
    config = load_config([DEMO, "scheduler.type=warmup_cosine"])
    assert config.scheduler.params.num_warmup_steps == 300  # the demo's warm-up, taken by cosine too
    optimizer = build_optimizer(torch.nn.Linear(2, 2), optimizer_section(config))
    assert build_scheduler(optimizer, scheduler_section(config), max_updates=100) is not None


def test_switching_a_dataset_processor_drops_what_the_new_type_refuses(caplog):
    """easy_vqa_generative's prompt_answer text processor switched to vocab (a classifier's tokens)."""
    key = "dataset_config.easy_vqa_generative.processors.text_processor"
    with caplog.at_level(logging.INFO, logger="mmvl"):
        config = load_config(["model=concat_bert", "datasets=easy_vqa_generative",
                              f"{key}={{type: vocab, params: {{max_seq_length: 16}}}}"])
    params = dict(config.dataset_config.easy_vqa_generative.processors.text_processor.params)
    assert {k: v for k, v in params.items() if v is not None} == {"max_seq_length": 16}  # a null is never passed
    assert f"{key}.type=vocab does not take image_tokens" in caplog.text
    typed = load_config(["model=concat_bert", "datasets=easy_vqa_generative", f"{key}.type=vocab",
                         f"{key}.params.image_tokens=4"])  # typed on the command line: kept, and refused when built
    assert typed.dataset_config.easy_vqa_generative.processors.text_processor.params.image_tokens == 4


def test_training_with_a_switched_optimizer(tmp_path):
    register()
    results = run(load_config(toy_opts(tmp_path, "optimizer.type=sgd", "training.max_updates=4",
                                       "training.evaluation_interval=0")))
    assert results["updates"] == 4


@pytest.mark.parametrize("written, canonical", [
    ("train_val_test", "train_val_test"), ("train_val_inference", "train_val_test"),
    ("train_inference", "train_test"), ("val_train", "train_val"), ("predict", "test"), ("val", "val"),
])
def test_run_type_is_the_stages_it_names(written, canonical):
    assert load_config([DEMO, f"run_type={written}"]).run_type == canonical


def test_an_unknown_stage_is_one_line():
    with pytest.raises(UserError, match=r"run_type='train_vall' \(from command line\) must be one of train, val, test"):
        load_config([DEMO, "run_type=train_vall"])


@pytest.mark.parametrize("run_type", ["train_val_test", "train_val_inference"])
def test_every_named_stage_runs(tmp_path, run_type):
    register()
    results = run(load_config(toy_opts(tmp_path, f"run_type={run_type}", "training.max_updates=2",
                                       "training.evaluation_interval=0")))
    assert results["updates"] == 2 and {"val", "test"} <= set(results)
