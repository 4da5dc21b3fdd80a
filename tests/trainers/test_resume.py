"""Resuming only under the config a checkpoint was saved with; ``checkpoint.resume=false`` moves old
checkpoints aside; ``checkpoint.reset.*`` resumes the weights under new settings;
``checkpoint.resume_pretrained`` loads model weights only (through ``pretrained_state_mapping``)."""
from __future__ import annotations

import os

import pytest
import torch

from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from mmvl.config.schema import resume_safe
from mmvl.trainers.resume import config_changes
from mmvl_cli.run import main
from tests.fixtures.toy import register, toy_opts

register()


def _opts(root, *extra: str) -> list[str]:
    return toy_opts(root, "training.max_updates=4", "training.checkpoint_interval=2",
                    "training.evaluation_interval=4", *extra)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmvl: error: ") and "Traceback" not in err, err
    return lines[0]


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.engine.unwrap_model(trainer.model).state_dict().items()}


def test_changed_lr_is_refused_with_the_keys_and_the_choices(tmp_path, capsys):
    assert main(_opts(tmp_path)) == 0
    before = sorted(os.listdir(tmp_path / "save" / "checkpoints"))
    changed = ["optimizer.params.lr=0.001", "training.seed=5", "training.batch_size=4",
               "model_config.toy_mlp.hidden_dropout_prob=0.25"]
    assert main(_opts(tmp_path, *changed)) == 2
    line = _one_error_line(capsys)  # the model's change first, a few more, the rest counted
    assert "another config: model_config.toy_mlp.hidden_dropout_prob (0.0 -> 0.25) and 3 more (all in train.log)" in line
    logged = [text for text in (tmp_path / "save" / "train.log").read_text().splitlines() if "every config" in text]
    assert len(logged) == 1 and all(f"{key} (" in logged[0] for key in (c.split("=")[0] for c in changed))
    for choice in ("env.save_dir", "checkpoint.resume=false", "checkpoint.reset.optimizer"):
        assert choice in line
    assert sorted(os.listdir(tmp_path / "save" / "checkpoints")) == before  # nothing touched


@pytest.mark.proc
def test_safe_changes_resume_silently(tmp_path, capsys):
    assert main(_opts(tmp_path)) == 0
    longer = _opts(tmp_path, "training.max_updates=6", "training.log_interval=1", "training.num_workers=1",
                   "training.checkpoint_interval=3", "training.device=cpu", "evaluation.predict=true",
                   f"env.data_dir={tmp_path}/data2", "checkpoint.max_to_keep=9")
    assert main(longer) == 0
    log = (tmp_path / "save" / "train.log").read_text()
    assert "last.ckpt at update 4" in log and "update 6/6" in log
    assert safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")["trainer"]["update"] == 6


def test_resume_false_moves_the_old_run_aside(tmp_path):
    assert main(_opts(tmp_path)) == 0
    old = safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")
    fresh = Trainer(load_config(_opts(tmp_path, "checkpoint.resume=false", "optimizer.params.lr=0.001")))
    assert fresh.update == 0 and fresh.resumed_from is None
    (moved,) = (tmp_path / "save" / "previous").iterdir()
    assert sorted(os.listdir(moved)) == ["checkpoints", "metrics.jsonl"]
    kept = safe_load(moved / "checkpoints" / "last.ckpt")
    for k, v in old["model"].items():
        assert torch.equal(kept["model"][k], v)
    assert not (tmp_path / "save" / "checkpoints").exists()


def test_reset_optimizer_resumes_the_weights_under_the_new_lr(tmp_path):
    assert main(_opts(tmp_path)) == 0
    saved = safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")
    t = Trainer(load_config(_opts(tmp_path, "training.max_updates=8", "optimizer.params.lr=0.001",
                                  "checkpoint.reset.optimizer=true")))
    assert t.update == 4  # counters and schedule position kept
    for k, v in _weights(t).items():
        assert torch.equal(v, saved["model"][k])
    assert not t.optimizer.state_dict()["state"]  # fresh moments
    # the schedule goes on from update 4 (warm-up of 2 done: the linear decay over 8), at the new base lr
    assert t.scheduler.last_epoch == 4 and t.scheduler.base_lrs[0] == pytest.approx(0.001)
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.001 * (8 - 4) / (8 - 2))


def test_reset_keeping_the_optimizer_state_still_applies_the_new_settings(tmp_path):
    assert main(_opts(tmp_path)) == 0
    saved = safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")
    t = Trainer(load_config(_opts(tmp_path, "optimizer.params.lr=0.001", "optimizer.params.weight_decay=0.5",
                                  "checkpoint.reset.scheduler=true")))
    moments = t.optimizer.state_dict()["state"]
    assert moments and torch.equal(moments[0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    assert t.scheduler.last_epoch == 0  # warm-up starts again: lr 0 at its first step
    assert t.optimizer.param_groups[0]["lr"] == 0.0
    assert t.optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.001)
    decay = [g for g in t.optimizer.param_groups if g.get("group") == "decay"]
    assert decay and all(g["weight_decay"] == 0.5 for g in decay)


def test_reset_counts_starts_counting_again(tmp_path):
    assert main(_opts(tmp_path)) == 0
    t = Trainer(load_config(_opts(tmp_path, "checkpoint.reset.counts=true")))
    assert t.update == 0 and t.optimizer.state_dict()["state"]  # weights and moments kept
    t.fit()
    assert t.update == 4


# -- resume_pretrained -------------------------------------------------------------------------------
@pytest.fixture
def pretrained(tmp_path):
    assert main(toy_opts(tmp_path / "pre", "training.max_updates=4")) == 0
    return tmp_path / "pre" / "save" / "checkpoints" / "last.ckpt"


def test_pretrained_loads_weights_only(tmp_path, pretrained):
    saved = safe_load(pretrained)
    t = Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={pretrained}", "optimizer.params.lr=0.001")))
    assert t.update == 0 and t.resumed_from is None
    assert not t.optimizer.state_dict()["state"] and t.scheduler.last_epoch == 0
    for k, v in _weights(t).items():
        assert torch.equal(v, saved["model"][k]), k
    t.fit()
    # a restart of the fine-tuning run continues from its own checkpoint, not from the pretrained one
    again = Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true",
                                         f"checkpoint.resume_file={pretrained}", "optimizer.params.lr=0.001",
                                         "training.max_updates=14")))
    assert again.update == 12 and again.resumed_from.endswith("last.ckpt")


def test_pretrained_state_mapping_loads_the_mapped_part(tmp_path, pretrained):
    saved = safe_load(pretrained)["model"]
    fresh = _weights(Trainer(load_config(toy_opts(tmp_path / "fresh"))))
    t = Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={pretrained}",
                                     "checkpoint.pretrained_state_mapping={net.0: net.0, net.1: net.1}")))
    for k, v in _weights(t).items():
        want = saved[k] if k.startswith(("net.0.", "net.1.")) else fresh[k]
        assert torch.equal(v, want), k


@pytest.mark.parametrize("mapping, needle", [
    ("{encoder: net.0}", r"\['encoder'\] match no key"),            # a checkpoint prefix that is not there
    ("{net.0: body.0}", "keys of .* are not in the model: \\['body.0"),  # a model prefix that is not there
    ("{net.4: net.1}", "checkpoint from another model"),          # lands on a layer of another shape
])
def test_pretrained_mapping_errors(tmp_path, pretrained, mapping, needle):
    with pytest.raises(UserError, match=needle):
        Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={pretrained}",
                                     f"checkpoint.pretrained_state_mapping={mapping}")))


def test_pretrained_without_mapping_needs_every_weight(tmp_path, pretrained):
    from mmvl.io import atomic_save

    state = safe_load(pretrained)
    del state["model"]["net.4.weight"]
    partial = atomic_save(state, tmp_path / "partial.ckpt")
    with pytest.raises(UserError, match=r"no weights for 1 model keys \['net.4.weight'\].*pretrained_state_mapping"):
        Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={partial}")))
    with pytest.raises(UserError, match="needs checkpoint.resume_file"):
        Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true")))


# -- the comparison itself ----------------------------------------------------------------------------
def test_config_changes_and_safe_keys():
    old = {"training": {"max_updates": 10, "seed": 1, "early_stop": {"patience": 3}},
           "optimizer": {"params": {"lr": 0.1}}, "env": {"save_dir": "a"}, "dropped": 1}
    new = {"training": {"max_updates": 20, "seed": 2, "early_stop": {"patience": 9}, "new_knob": 0},
           "optimizer": {"params": {"lr": 0.1, "betas": [0.9, 0.98]}}, "env": {"save_dir": "b"}}
    defaults = {"training": {"new_knob": 0}}
    assert config_changes(old, new, defaults) == [("optimizer.params.betas", "(unset)", [0.9, 0.98]),
                                                  ("training.seed", 1, 2)]
    moved = {**new, "model": "b", "datasets": ["y"], "model_config": {"b": {"size": 2}}, "dataset_config": {"y": 1}}
    assert [key for key, *_ in config_changes({**old, "model": "a", "datasets": ["x"]}, moved)] == [
        "model", "datasets", "model_config.b.size", "dataset_config.y", "optimizer.params.betas",
        "training.new_knob", "training.seed"]  # what matters most first, then alphabetical
    assert resume_safe("env.save_dir") and resume_safe("distributed.world_size")
    assert not resume_safe("training.seed") and not resume_safe("environment")


def test_pretrained_from_a_bare_state_dict(tmp_path, pretrained):
    from mmvl.io import atomic_save

    bare = atomic_save(safe_load(pretrained)["model"], tmp_path / "weights.pt")  # e.g. exported weights
    t = Trainer(load_config(toy_opts(tmp_path, "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={bare}")))
    for k, v in _weights(t).items():
        assert torch.equal(v, safe_load(bare, expect_keys=())[k])
    atomic_save({"trainer": {"update": 3}}, tmp_path / "no_weights.ckpt")
    with pytest.raises(UserError, match="holds no model weights"):
        Trainer(load_config(toy_opts(tmp_path / "b", "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={tmp_path / 'no_weights.ckpt'}")))
