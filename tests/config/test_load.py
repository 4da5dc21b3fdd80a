"""load_config: layer order, includes, model/dataset choice, user_dir, resolvers, save."""
from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from mmvl.config import config_root, load_config, parse_opts, save_config
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
def names():
    """Unique model/dataset names registered for one test, unregistered after."""
    tag = uuid.uuid4().hex[:8]
    made = {"m1": f"cfg_m1_{tag}", "m2": f"cfg_m2_{tag}", "d1": f"cfg_d1_{tag}", "d2": f"cfg_d2_{tag}"}
    for key, name in made.items():
        (MODELS if key.startswith("m") else DATASETS).register(name, type(name, (), {}))
    yield made
    for key, name in made.items():
        (MODELS if key.startswith("m") else DATASETS).unregister(name)


@pytest.fixture
def root(tmp_path, names):
    """A config root: the real defaults.yaml plus tiny model/dataset YAMLs."""
    r = tmp_path / "configs"
    r.mkdir()
    shutil.copy(REPO_DEFAULTS, r / "defaults.yaml")
    m1, m2, d1, d2 = names["m1"], names["m2"], names["d1"], names["d2"]
    write(r / "models" / f"{m1}.yaml", {"model_config": {m1: {"hidden": 8, "layers": 2}},
                                         "training": {"log_interval": 11, "batch_size": 16}})
    write(r / "models" / f"{m2}.yaml", {"model_config": {m2: {"hidden": 4}}})
    write(r / "datasets" / f"{d1}.yaml", {"dataset_config": {d1: {"split": "a"}},
                                           "training": {"log_interval": 22}})
    write(r / "datasets" / f"{d2}.yaml", {"dataset_config": {d2: {"split": "b"}},
                                           "training": {"log_interval": 23}})
    return r


def test_defaults_are_resolved_and_sane(root):
    cfg = load_config([], config_root=root)
    assert cfg.run_type == "train_val" and cfg.model is None and list(cfg.datasets) == []
    assert cfg.scheduler.params.num_training_steps is None  # the trainer fills in the run length
    assert cfg.distributed.world_size == max(1, torch.cuda.device_count())
    assert cfg.env.save_dir == "./save" and cfg.env.user_dir is None
    assert "${" not in OmegaConf.to_yaml(cfg)


def test_each_layer_overrides_the_previous(root, names, tmp_path):
    m1, d1, d2 = names["m1"], names["d1"], names["d2"]
    user = write(tmp_path / "user.yaml", {"training": {"log_interval": 33}})
    assert load_config([], config_root=root).training.log_interval == 100
    assert load_config([f"model={m1}"], config_root=root).training.log_interval == 11
    opts = [f"model={m1}", f"datasets={d1}"]
    assert load_config(opts, config_root=root).training.log_interval == 22
    assert load_config([f"model={m1}", f"datasets={d1},{d2}"], config_root=root).training.log_interval == 23
    assert load_config([*opts, f"config={user}"], config_root=root).training.log_interval == 33
    cfg = load_config([*opts, f"config={user}", "training.log_interval=44"], config_root=root)
    assert cfg.training.log_interval == 44
    assert cfg.training.batch_size == 16  # from the model YAML, untouched later
    assert cfg.model_config[m1].hidden == 8 and cfg.dataset_config[d1].split == "a"


def test_model_and_datasets_chosen_by_cli_over_user_file(root, names, tmp_path):
    m1, m2, d1, d2 = names["m1"], names["m2"], names["d1"], names["d2"]
    user = write(tmp_path / "u.yaml", {"model": m1, "datasets": f"{d1}, {d2}",
                                       "model_config": {m1: {"hidden": 99}}})
    cfg = load_config([f"config={user}"], config_root=root)
    assert cfg.model == m1 and list(cfg.datasets) == [d1, d2]
    assert cfg.model_config[m1].hidden == 99 and cfg.model_config[m1].layers == 2
    user2 = write(tmp_path / "u2.yaml", {"model": m1, "datasets": [d1]})
    cfg = load_config([f"config={user2}", f"model={m2}", f"dataset={d2}"], config_root=root)
    assert cfg.model == m2 and list(cfg.datasets) == [d2]
    assert m1 not in cfg.model_config and d1 not in cfg.dataset_config
    assert cfg.training.log_interval == 23


def test_a_files_section_for_an_unchosen_component_is_set_aside(root, names, tmp_path):
    """A project file configuring d1 and m1, run with datasets=d2 model=m2 on the command line: its
    d1/m1 sections configure nothing this run builds; a misspelt section or a command-line key for
    an unchosen dataset is still refused."""
    m1, m2, d1, d2 = names["m1"], names["m2"], names["d1"], names["d2"]
    project = write(tmp_path / "p.yaml", {"model": m1, "datasets": [d1], "model_config": {m1: {"hidden": 99}},
                                          "dataset_config": {d1: {"split": "c"}}})
    cfg = load_config([f"config={project}", f"datasets={d2}", f"model={m2}"], config_root=root)
    assert list(cfg.datasets) == [d2] and d1 not in cfg.dataset_config and m1 not in cfg.model_config
    assert load_config([f"config={project}"], config_root=root).dataset_config[d1].split == "c"
    typo = write(tmp_path / "t.yaml", {"datasets": [d1], "dataset_config": {d1 + "x": {"split": "c"}}})
    with pytest.raises(UserError, match="Unknown config key"):
        load_config([f"config={typo}"], config_root=root)
    with pytest.raises(UserError, match="Unknown config key"):
        load_config([f"config={project}", f"datasets={d2}", f"dataset_config.{d1}.split=c"], config_root=root)


def test_class_config_path_relative_and_absolute(root, tmp_path):
    rel_name, abs_name = f"cfg_rel_{uuid.uuid4().hex[:6]}", f"cfg_abs_{uuid.uuid4().hex[:6]}"
    write(root / "elsewhere" / "r.yaml", {"model_config": {rel_name: {"x": 1}}})
    absolute = write(tmp_path / "abs" / "a.yaml", {"dataset_config": {abs_name: {"y": 2}}})
    MODELS.register(rel_name, type("R", (), {"config_path": "elsewhere/r.yaml"}))
    DATASETS.register(abs_name, type("A", (), {"config_path": str(absolute)}))
    try:
        cfg = load_config([f"model={rel_name}", f"datasets={abs_name}"], config_root=root)
        assert cfg.model_config[rel_name].x == 1 and cfg.dataset_config[abs_name].y == 2
    finally:
        MODELS.unregister(rel_name)
        DATASETS.unregister(abs_name)


def test_unknown_model_and_dataset_suggest(root, names):
    with pytest.raises(UserError, match=f"Did you mean '{names['m1']}'"):
        load_config([f"model={names['m1']}x"], config_root=root)
    with pytest.raises(UserError, match="Unknown dataset"):
        load_config(["datasets=no_such_dataset_zz"], config_root=root)


def test_includes_nested_relative_and_ordered(root, tmp_path):
    base = write(tmp_path / "shared" / "base.yaml", {"training": {"seed": 5, "log_interval": 1, "num_workers": 1}})
    write(tmp_path / "shared" / "mid.yaml", {"includes": ["base.yaml"], "training": {"log_interval": 2}})
    write(tmp_path / "other.yaml", {"training": {"num_workers": 7, "seed": 6}})
    top = write(tmp_path / "runs" / "top.yaml",
                {"includes": ["../shared/mid.yaml", "../other.yaml"], "training": {"log_interval": 3}})
    cfg = load_config([f"config={top}"], config_root=root)
    assert cfg.training.log_interval == 3  # own keys beat includes
    assert cfg.training.num_workers == 7 and cfg.training.seed == 6  # later include beats earlier
    assert "includes" not in cfg
    assert base.exists()


def test_include_cycle_and_missing_include(tmp_path, root):
    a = write(tmp_path / "a.yaml", {"includes": ["sub/b.yaml"]})
    write(tmp_path / "sub" / "b.yaml", {"includes": ["../a.yaml"]})
    with pytest.raises(UserError, match=r"include cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config([f"config={a}"], config_root=root)
    c = write(tmp_path / "c.yaml", {"includes": ["nope.yaml"]})
    with pytest.raises(UserError, match="nope.yaml.*included from"):
        load_config([f"config={c}"], config_root=root)


def test_cli_values_are_typed_yaml(root):
    cfg = load_config(["optimizer.params.lr=1e-3", "evaluation.metrics=[accuracy,f1]",
                       "training.fp16=true", "training.clip_grad_norm=1.5"], config_root=root)
    assert cfg.optimizer.params.lr == pytest.approx(1e-3)
    assert list(cfg.evaluation.metrics) == ["accuracy", "f1"]
    assert cfg.training.clip_grad_norm == 1.5
    parsed = parse_opts(["config=a.yaml", "datasets=x,y", "training.seed=3"])
    assert parsed.config_files == ["a.yaml"]
    assert parsed.overrides == [("datasets", ["x", "y"]), ("training.seed", 3)]


def test_bad_arguments_and_files(root, tmp_path):
    with pytest.raises(UserError, match="'train' is not key=value"):
        load_config(["train"], config_root=root)
    with pytest.raises(UserError, match="does not exist"):
        load_config([f"config={tmp_path / 'missing.yaml'}"], config_root=root)
    bad = write(tmp_path / "bad.yaml", "training:\n  seed: [1,\n  other: 2\n")
    with pytest.raises(UserError, match=r"YAML syntax error in .*bad\.yaml line \d+"):
        load_config([f"config={bad}"], config_root=root)
    with pytest.raises(UserError, match="not a folder"):
        load_config([], config_root=tmp_path / "nowhere")


def test_config_root_env_var(monkeypatch, root):
    monkeypatch.setenv("MMVL_CONFIG_ROOT", str(root))
    assert config_root() == root
    (root / "defaults.yaml").write_text(REPO_DEFAULTS.read_text().replace("seed: 1", "seed: 77"))
    assert load_config([]).training.seed == 77


def test_env_resolver_and_oc_env(root, tmp_path, monkeypatch):
    user = write(tmp_path / "u.yaml", "training:\n  seed: ${env:CFG_TEST_SEED,4}\n"
                                      "env:\n  data_dir: ${oc.env:CFG_TEST_DATA,/d}\n")
    assert load_config([f"config={user}"], config_root=root).training.seed == 4
    monkeypatch.setenv("CFG_TEST_SEED", "9")
    monkeypatch.setenv("CFG_TEST_DATA", "/data/x")
    monkeypatch.setenv("MMVL_SAVE_DIR", "/tmp/saves")
    cfg = load_config([f"config={user}"], config_root=root)
    assert cfg.training.seed == 9 and cfg.env.data_dir == "/data/x" and cfg.env.save_dir == "/tmp/saves"
    with pytest.raises(UserError, match="CFG_TEST_UNSET_VAR"):
        load_config(["env.data_dir=${env:CFG_TEST_UNSET_VAR}"], config_root=root)


def test_save_config_round_trip(root, names, tmp_path):
    opts = [f"model={names['m1']}", f"datasets={names['d1']}", "training.fp16=true",
            "optimizer.params.lr=2e-5"]
    cfg = load_config(opts, config_root=root)
    out = save_config(cfg, tmp_path / "run" / "config.yaml")
    text = out.read_text()
    assert "${" not in text and f"world_size: {max(1, torch.cuda.device_count())}" in text
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no tmp files left
    again = load_config([f"config={out}"], config_root=root)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
    save_config({"a": 1}, out)  # overwrite atomically, plain dicts accepted
    assert yaml.safe_load(out.read_text()) == {"a": 1}


def _write_user_package(folder: Path, model: str, yaml_path: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        "from mmvl.registry import register_model\n"
        f"@register_model({model!r})\n"
        "class M:\n"
        f"    config_path = {str(yaml_path)!r}\n"
    )


@pytest.mark.parametrize("how", ["cli", "file", "env"])
def test_user_dir_registers_model(root, tmp_path, monkeypatch, how):
    tag = uuid.uuid4().hex[:8]
    model, pkg = f"user_model_{tag}", tmp_path / "plugins" / f"mmvl_user_{tag}"
    model_yaml = write(tmp_path / "m.yaml", {"model_config": {model: {"depth": 3}}})
    _write_user_package(pkg, model, model_yaml)
    opts = [f"model={model}"]
    if how == "cli":
        opts.append(f"env.user_dir={pkg}")
    elif how == "file":
        opts.append(f"config={write(tmp_path / 'u.yaml', {'env': {'user_dir': str(pkg)}})}")
    else:
        monkeypatch.setenv("MMVL_USER_DIR", str(pkg))
    try:
        cfg = load_config(opts, config_root=root)
        assert cfg.model_config[model].depth == 3 and cfg.env.user_dir == str(pkg)
        assert load_config(opts, config_root=root).model == model  # second import is a no-op
    finally:
        MODELS.unregister(model)
        sys.modules.pop(pkg.name, None)
        if str(pkg.parent) in sys.path:
            sys.path.remove(str(pkg.parent))


def test_user_dir_missing_is_user_error(root, tmp_path):
    with pytest.raises(UserError, match="env.user_dir .* is not an existing folder"):
        load_config([f"env.user_dir={tmp_path / 'nope'}"], config_root=root)


def test_diamond_include_is_merged_once_at_first_position(root, tmp_path):
    write(tmp_path / "d.yaml", {"training": {"seed": 1, "num_workers": 1}})
    write(tmp_path / "b.yaml", {"includes": ["d.yaml"], "training": {"seed": 2}})
    write(tmp_path / "c.yaml", {"includes": ["d.yaml"], "training": {"num_workers": 3}})
    top = write(tmp_path / "top.yaml", {"includes": ["b.yaml", "c.yaml"]})
    cfg = load_config([f"config={top}"], config_root=root)
    assert cfg.training.seed == 2 and cfg.training.num_workers == 3  # d does not undo b


def test_save_config_marks_its_file_and_keeps_the_users(tmp_path):
    from mmvl.config.load import CONFIG_MARK, check_config_file

    ours = tmp_path / "config.yaml"
    save_config({"a": 1}, ours)
    assert ours.read_text().splitlines()[0] == CONFIG_MARK
    save_config({"a": 2}, ours)  # its own file: rewritten
    assert "a: 2" in ours.read_text()
    users = tmp_path / "mine.yaml"
    users.write_text("training:\n  seed: 3\n")
    with pytest.raises(UserError, match="mine.yaml' is not a config mmvl wrote.*another env.save_dir"):
        save_config({"a": 1}, users)
    assert users.read_text() == "training:\n  seed: 3\n"
    legacy = tmp_path / "legacy.yaml"  # written by mmvl before the mark: a whole resolved config
    legacy.write_text(save_config(load_config([]), tmp_path / "x.yaml").read_text().split("\n", 1)[1])
    check_config_file(legacy)
