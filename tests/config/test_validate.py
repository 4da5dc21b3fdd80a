"""Config validation: unknown keys, types, choices, aliases, with their sources."""
from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.registry import DATASETS, MODELS

REPO_DEFAULTS = Path(__file__).resolve().parents[2] / "configs" / "defaults.yaml"


def write(path: Path, data: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("MMVL_USER_DIR", "MMVL_CONFIG_ROOT", "MMVL_SAVE_DIR", "MMVL_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "configs"
    r.mkdir()
    shutil.copy(REPO_DEFAULTS, r / "defaults.yaml")
    return r


@pytest.fixture
def model(root):
    """A registered model whose YAML has processors with params and a required key."""
    name = f"val_model_{uuid.uuid4().hex[:8]}"
    MODELS.register(name, type(name, (), {}))
    write(root / "models" / f"{name}.yaml", {"model_config": {name: {
        "hidden": 8, "dropout": 0.1, "vocab": "???",
        "processors": {"text": {"type": "tok", "params": {"max_len": 5, "extra": {"a": 1}}}}}}})
    yield name
    MODELS.unregister(name)


def load(root, *opts):
    return load_config(list(opts), config_root=root)


def test_unknown_key_in_file_names_file_and_suggests(root, tmp_path):
    user = write(tmp_path / "run.yaml", {"training": {"batchsize": 8}})
    with pytest.raises(UserError) as err:
        load(root, f"config={user}")
    assert str(err.value) == (f"Unknown config key 'training.batchsize' in {user}. "
                              "Did you mean 'training.batch_size'?")


def test_unknown_key_in_cli_and_in_include(root, tmp_path):
    with pytest.raises(UserError, match=re.escape("'optimizer.lr_scalling' in command line. "
                                                  "Did you mean 'optimizer.lr_scaling'")):
        load(root, "optimizer.lr_scalling=linear")
    inc = write(tmp_path / "inc" / "inc.yaml", {"checkpoint": {"max_to_kep": 2}})
    top = write(tmp_path / "top.yaml", {"includes": ["inc/inc.yaml"], "training": {"seed": 3}})
    with pytest.raises(UserError, match=re.escape(f"in {inc}")):
        load(root, f"config={top}")
    dotted = write(tmp_path / "dotted.yaml", "training.seed: 3\n")
    with pytest.raises(UserError, match="nested keys"):
        load(root, f"config={dotted}")


def test_params_and_empty_mappings_are_open(root, model, tmp_path):
    user = write(tmp_path / "u.yaml", {
        "optimizer": {"params": {"betas": [0.9, 0.98]}},
        "scheduler": {"params": {"min_lr": 0.0}},
        "checkpoint": {"pretrained_state_mapping": {"bert.": "model.bert."}},
        "model_config": {model: {"vocab": "v.txt", "processors": {"text": {"params": {
            "lower": True, "extra": {"b": 2}}}}}},
        "training": {"callbacks": [{"type": "lr_monitor", "params": {"every": 3}}]},
    })
    cfg = load(root, f"model={model}", f"config={user}")
    assert list(cfg.optimizer.params.betas) == [0.9, 0.98]
    assert cfg.model_config[model].processors.text.params == {
        "max_len": 5, "lower": True, "extra": {"a": 1, "b": 2}}
    assert cfg.training.callbacks[0].params.every == 3
    assert cfg.checkpoint.pretrained_state_mapping["bert."] == "model.bert."
    with pytest.raises(UserError, match="must be an integer"):  # known keys inside params stay typed
        load(root, f"model={model}", f"model_config.{model}.vocab=v",
             f"model_config.{model}.processors.text.params.max_len=long")
    with pytest.raises(UserError, match="Unknown config key 'model_config.other'"):
        load(root, f"model={model}", f"model_config.{model}.vocab=v", "model_config.other.x=1")
    with pytest.raises(UserError, match="Unknown config key 'model_config.*hiden'"):
        load(root, f"model={model}", f"model_config.{model}.vocab=v", f"model_config.{model}.hiden=1")


def test_lists_replace_wholesale(root):
    cfg = load(root, "evaluation.metrics=[a,b,c]", "evaluation.metrics=[d]")
    assert list(cfg.evaluation.metrics) == ["d"]


@pytest.mark.parametrize("opt, wanted", [
    ("training.batch_size=abc", "must be a positive integer"),
    ("training.seed=1.5", "must be an integer"),
    ("training.progress_bar=3", "must be true or false"),
    ("training.tensorboard=3", "must be one of true, false, auto"),
    ("optimizer.params.lr=fast", "must be a number"),
    ("evaluation.metrics=accuracy", "must be a list"),
    ("training=5", "must be a mapping"),
    ("training.early_stop.enabled=yes_please", "must be true or false"),
])
def test_type_errors_name_key_and_source(root, opt, wanted):
    key = opt.split("=")[0]
    with pytest.raises(UserError, match=re.escape(f"'{key}' in command line") + ".*" + re.escape(wanted)):
        load(root, opt)


def test_numbers_are_coerced_where_harmless(root, tmp_path):
    user = write(tmp_path / "u.yaml", 'optimizer:\n  params:\n    lr: "1e-3"\n    eps: 1\n'
                                      "training:\n  device: 0\n")
    cfg = load(root, f"config={user}")
    assert cfg.optimizer.params.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.params.lr, float)
    assert cfg.optimizer.params.eps == 1.0 and isinstance(cfg.optimizer.params.eps, float)
    assert cfg.training.device == "0"
    assert load(root, "training.clip_grad_norm=null", "training.max_epochs=2").training.max_epochs == 2


@pytest.mark.parametrize("opt", ["training.precision=fp8", "distributed.strategy=horovod",
                                 "distributed.backend=mpi", "run_type=training",
                                 "checkpoint.resume=maybe", "optimizer.lr_scaling=cubic",
                                 "training.pin_memory=always"])
def test_choice_errors_list_the_choices(root, opt):
    with pytest.raises(UserError, match="must be one of"):
        load(root, opt)


def test_choices_accepted(root):
    cfg = load(root, "checkpoint.resume=auto", "distributed.strategy=fsdp", "run_type=test",
               "optimizer.lr_scaling=linear", "training.precision=bf16")
    assert cfg.checkpoint.resume == "auto" and cfg.distributed.strategy == "fsdp"
    assert load(root, "checkpoint.resume=true").checkpoint.resume is True
    assert [load(root, f"training.pin_memory={v}").training.pin_memory for v in ("auto", "true", "false")] == [
        "auto", True, False]


def test_positive_counts(root):
    with pytest.raises(UserError, match="'training.batch_size' in command line must be a positive integer"):
        load(root, "training.batch_size=0")
    with pytest.raises(UserError, match="training.max_updates.*positive integer or null"):
        load(root, "training.max_updates=-5")
    with pytest.raises(UserError, match="max_updates and training.max_epochs are null"):
        load(root, "training.max_updates=null")
    cfg = load(root, "training.max_updates=null", "training.max_epochs=3")
    assert cfg.training.max_epochs == 3 and cfg.scheduler.params.num_training_steps is None


def test_update_frequency_alias(root):
    cfg = load(root, "training.update_frequency=4")
    assert cfg.training.gradient_accumulation == 4
    assert load(root).training.gradient_accumulation == 1
    with pytest.raises(UserError, match="conflicts with training.gradient_accumulation=2"):
        load(root, "training.update_frequency=4", "training.gradient_accumulation=2")


def test_fp16_flag_sets_precision(root):
    cfg = load(root, "training.fp16=true")
    assert cfg.training.precision == "fp16"
    assert load(root, "training.precision=fp16").training.fp16 is True
    assert load(root).training.precision == "fp32"
    with pytest.raises(UserError, match="fp16=true conflicts with training.precision=bf16"):
        load(root, "training.fp16=true", "training.precision=bf16")


def test_data_parallel_flag_sets_strategy(root):
    assert load(root, "distributed.data_parallel=true").distributed.strategy == "dp"
    with pytest.raises(UserError, match="conflicts with distributed.strategy=ddp"):
        load(root, "distributed.data_parallel=true", "distributed.strategy=ddp")


def test_model_yaml_is_checked_outside_its_section(root):
    name = f"bad_yaml_model_{uuid.uuid4().hex[:8]}"
    path = write(root / "models" / f"{name}.yaml", {"model_config": {name: {"a": 1}}, "trainig": {"seed": 2}})
    MODELS.register(name, type(name, (), {}))
    try:
        with pytest.raises(UserError, match=re.escape(f"'trainig' in {path}. Did you mean 'training'")):
            load(root, f"model={name}")
    finally:
        MODELS.unregister(name)


def test_required_keys_and_interpolations(root, model, tmp_path):
    with pytest.raises(UserError, match=f"'model_config.{model}.vocab' is required"):
        load(root, f"model={model}")
    cfg = load(root, f"model={model}", f"model_config.{model}.vocab=v.txt",
               "training.log_interval=${training.evaluation_interval}")
    assert cfg.training.log_interval == 1000
    with pytest.raises(UserError, match="Cannot resolve config key 'training.log_interval'"):
        load(root, "training.log_interval=${training.no_such_key}")


def test_dataset_config_section_is_free_in_dataset_yaml(root):
    name = f"val_ds_{uuid.uuid4().hex[:8]}"
    DATASETS.register(name, type(name, (), {}))
    write(root / "datasets" / f"{name}.yaml", {"dataset_config": {name: {"anything": {"goes": 1}}}})
    try:
        cfg = load(root, f"datasets={name}", f"dataset_config.{name}.anything.goes=2")
        assert cfg.dataset_config[name].anything.goes == 2
    finally:
        DATASETS.unregister(name)
