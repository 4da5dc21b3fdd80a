"""Every config key is real: each key code reads is shipped (configs/defaults.yaml or a model/dataset
YAML), and each shipped key is read by code. Both directions come from a static scan of the code
(tests/config/key_scan.py) over whatever is in the tree, so new keys are checked as they land."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from key_scan import WILDCARD, exists, is_read, leaf_keys, scan, shipped_tree

ROOT = Path(__file__).resolve().parents[2]
CODE = sorted(p for d in ("mmvl", "mmvl_cli") for p in (ROOT / d).rglob("*.py"))
CONFIGS = ROOT / "configs"
COMPONENT_YAMLS = sorted((CONFIGS / "models").rglob("*.yaml")) + sorted((CONFIGS / "datasets").rglob("*.yaml"))
#: keys another developer is wiring right now. PENDING: shipped, not yet read; PENDING_READS: read,
#: not yet shipped. Each entry must still be pending here (the test says when to drop it), so the
#: tables only shrink, and every key is checked like the others once its owner's work has landed.
PENDING: dict[tuple[str, ...], str] = {}
PENDING_READS: dict[tuple[str, ...], str] = {}
OPEN_ROOTS = ("model_config", "dataset_config")


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


@pytest.fixture(scope="module")
def tree() -> dict:
    return shipped_tree(_yaml(CONFIGS / "defaults.yaml"), [_yaml(p) for p in COMPONENT_YAMLS])


@pytest.fixture(scope="module")
def reads():
    return scan(CODE, ROOT)


def test_the_scan_sees_the_code_and_the_configs(tree, reads):
    assert len(CODE) > 50 and COMPONENT_YAMLS
    found = {r.keys for r in reads if r.rooted}
    # one read of each form the scan understands, so a scanner regression cannot pass silently
    assert ("distributed", "reshard_after_forward") in found  # config_value(config, "a.b")
    assert ("training", "clip_grad_norm") in found  # config.training.get("clip_grad_norm")
    assert ("training", "seed") in found  # t = config.training; t.seed
    assert ("distributed", "nccl", WILDCARD) in found  # config_value(config, f"distributed.nccl.{key}")
    assert ("hidden_size",) in {r.keys for r in reads}  # BERT_KEYS = ("hidden_size", ...)


def test_every_shipped_key_is_read(tree, reads):
    unread = [".".join(k) for k in leaf_keys(tree) if k not in PENDING and not is_read(k, reads)]
    assert not unread, (f"shipped keys no code reads: {unread}; read them (mmvl.config.access.config_value) "
                        "or remove them from the YAML")


def test_pending_keys_are_still_pending(tree, reads):
    """Once a pending key's owner has landed, it must leave the table (and is then checked like any key)."""
    for key, owner in PENDING.items():
        assert key in leaf_keys(tree), f"{'.'.join(key)} is no longer shipped: drop it from PENDING"
        assert not is_read(key, reads), f"{'.'.join(key)} is now read ({owner}): drop it from PENDING"
    for key, owner in PENDING_READS.items():
        assert any(r.rooted and r.keys == key for r in reads), f"{'.'.join(key)} is no longer read: drop it"
        assert not exists(key, tree, OPEN_ROOTS), f"{'.'.join(key)} is now shipped ({owner}): drop it from PENDING_READS"


def test_every_key_code_reads_is_shipped(tree, reads):
    missing = sorted({f"{'.'.join(r.keys)} ({r.where})" for r in reads
                      if r.rooted and r.keys not in PENDING_READS and not exists(r.keys, tree, OPEN_ROOTS)})
    assert not missing, (f"code reads config keys that no shipped YAML has: {missing}; add each to "
                         "configs/defaults.yaml (or the model/dataset YAML) with a comment")


def test_the_checks_catch_both_kinds_of_mistake(tree, tmp_path):
    """The scan on a small file: an unread shipped key and a read key that is not shipped."""
    code = tmp_path / "mod.py"
    code.write_text("def f(config):\n    t = config.training\n    return t.batch_sise, config_value(config, 'training.seed')\n")
    reads = scan([code], tmp_path)
    assert not is_read(("training", "batch_size"), reads) and is_read(("training", "seed"), reads)
    assert not exists(("training", "batch_sise"), tree, OPEN_ROOTS)
    assert exists(("training", "seed"), tree, OPEN_ROOTS)
    assert exists(("optimizer", "params", "anything"), tree, OPEN_ROOTS)  # params are kwargs
    assert exists(("model_config", "some_model", "x"), tree, OPEN_ROOTS)  # one node per registered name
    assert exists(("image_encoder", "type"), tree, OPEN_ROOTS)  # a model reading its own config
