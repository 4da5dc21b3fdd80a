"""Every config key is real. The schema (mmvl/config/schema.py) is what code reads and
configs/defaults.yaml what users read; tests/config/test_schema.py holds the two equal. Here: each
shipped key is read (its name occurs in the code as an attribute, argument or string), and a read
of a key the schema lacks fails when it runs instead of returning a default."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from mmvl.config import schema
from mmvl.config.access import config_value

ROOT = Path(__file__).resolve().parents[2]
CODE = sorted(p for d in ("mmvl", "mmvl_cli") for p in (ROOT / d).rglob("*.py")
              if p != ROOT / "mmvl" / "config" / "schema.py")  # the declarations are not reads
COMPONENT_YAMLS = sorted((ROOT / "configs" / "models").rglob("*.yaml")) + sorted(
    (ROOT / "configs" / "datasets").rglob("*.yaml"))


def names_in(paths: list[Path]) -> set[str]:
    """Every attribute, argument and keyword name and every dotted part of a string constant."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(node.value.replace("{", ".").replace("}", ".").split("."))
    return names


def leaves(tree: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(tree, dict) and tree:
        return [leaf for key, value in tree.items() for leaf in leaves(value, (*prefix, str(key)))]
    return [prefix] if prefix else []


@pytest.fixture(scope="module")
def code_names() -> set[str]:
    return names_in(CODE)


def test_every_schema_field_is_read(code_names):
    unread = [key for key in schema.fields() if key.rsplit(".", 1)[-1] not in code_names]
    assert not unread, f"declared keys no code reads: {unread}; read them or remove them from the schema and YAML"


def test_every_model_and_dataset_key_is_read(code_names):
    unread = [f"{path.name}: {'.'.join(key)}" for path in COMPONENT_YAMLS
              for key in leaves(yaml.safe_load(path.read_text()) or {})
              # params are a builder's kwargs; a random LM's keys are its transformers config's (tests/models/test_vlm.py)
              if "params" not in key and "random" not in key and key[-1] not in code_names]
    assert not unread, f"shipped keys no code reads: {unread}"


def test_the_check_sees_an_unread_key(tmp_path):
    code = tmp_path / "mod.py"
    code.write_text("def f(config, batch_size=1):\n    return config.training.seed, config_value(config, 'env.save_dir')\n")
    names = names_in([code])
    assert {"seed", "save_dir", "batch_size"} <= names and "log_interval" not in names


@pytest.mark.parametrize("key", ["training.sed", "distributed.nccl.threads", "checkpoint.reset.optimiser"])
def test_reading_an_undeclared_key_fails(key):
    with pytest.raises(KeyError, match="not declared in mmvl/config/schema.py"):
        config_value({"training": {}}, key)


@pytest.mark.parametrize("key", ["training.seed", "optimizer.params.anything", "model_config.m.hidden",
                                 "image_encoder.type", "distributed.nccl.socket_nthreads"])
def test_declared_and_open_keys_read(key):
    assert config_value({}, key, "default") == "default"
