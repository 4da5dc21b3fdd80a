"""Every shipped YAML (configs/ and projects/) loads and validates; every registered model
and dataset has a default config that loads."""
from __future__ import annotations

import glob
import os

import pytest

import mmvl  # noqa: F401  (registers built-ins)
from mmvl import registry
from mmvl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "projects", "**", "*.yaml"), recursive=True))


def test_there_are_project_configs():
    assert PROJECT_CONFIGS


@pytest.mark.parametrize("path", PROJECT_CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_project_config_loads(path, tmp_path):
    cfg = load_config([f"config={path}", f"env.save_dir={tmp_path}"])
    assert cfg.model in registry.MODELS
    for name in cfg.datasets:
        assert name in registry.DATASETS and name in cfg.dataset_config
    assert cfg.model in cfg.model_config


@pytest.mark.parametrize("model", registry.MODELS.names())
def test_every_registered_model_has_a_loading_config(model, tmp_path):
    cfg = load_config([f"model={model}", "datasets=sort_of_clevr", f"env.save_dir={tmp_path}"])
    assert model in cfg.model_config


@pytest.mark.parametrize("dataset", registry.DATASETS.names())
def test_every_registered_dataset_has_a_loading_config(dataset, tmp_path):
    cfg = load_config(["model=visual_bert", f"datasets={dataset}", f"env.save_dir={tmp_path}"])
    assert dataset in cfg.dataset_config
