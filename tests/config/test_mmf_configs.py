"""MMF configs load unchanged: MMF-structured project configs (written for these tests, under
tests/config/mmf/) load with model= and datasets=, their ``configs/...`` includes resolve against
mmvl's configs/, MMF's keys become mmvl's, the MMF keys mmvl does not use are listed in one warning
line, and keys that are neither mmvl's nor MMF's stay errors."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from mmvl.config import load_config
from mmvl.config.mmf import RENAMED, UNUSED
from mmvl.errors import UserError

HERE = Path(__file__).resolve().parent
PROJECTS = HERE / "mmf" / "projects"
RUNS = [("visual_bert", "vqa2"), ("visual_bert", "hateful_memes"), ("mmbt", "hateful_memes")]


def project(model: str, dataset: str) -> Path:
    return PROJECTS / model / "configs" / dataset / "defaults.yaml"


def load(model: str, dataset: str, *opts: str):
    return load_config([f"model={model}", f"datasets={dataset}", f"config={project(model, dataset)}", *opts])


@pytest.fixture(autouse=True)
def mmvl_logs_reach_caplog(monkeypatch):
    """A run earlier in the session (setup_logging) stops the mmvl logger from propagating."""
    monkeypatch.setattr(logging.getLogger("mmvl"), "propagate", True)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A local Hugging Face cache holding only ``bert-base-uncased``'s vocab.txt."""
    from huggingface_hub import constants

    from mmvl.data.processors.text import SPECIAL_TOKENS

    cache = tmp_path / "hf_hub"
    repo = cache / "models--bert-base-uncased"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    words = "look at this red green blue yellow white black thing number 0 1 2 3 4 5 6 7 8 9 what is".split()
    (snapshot / "vocab.txt").write_text("\n".join(SPECIAL_TOKENS + words) + "\n")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return snapshot


@pytest.mark.parametrize("model,dataset", RUNS)
def test_mmf_project_config_loads_unchanged(model, dataset, caplog):
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        cfg = load(model, dataset)
    assert cfg.model == model and list(cfg.datasets) == [dataset]
    text = cfg.dataset_config[dataset].processors.text_processor
    assert text.type == "bert_tokenizer" and text.params.tokenizer_path == "bert-base-uncased"
    assert "tokenizer_config" not in text.params
    assert cfg.optimizer.params.eps == pytest.approx(1e-8) and isinstance(cfg.optimizer.params.eps, float)
    assert cfg.scheduler.type == "warmup_linear" and cfg.scheduler.params.num_training_steps == cfg.training.max_updates
    assert cfg.training.early_stop.criteria == f"{dataset}/{'vqa_accuracy' if dataset == 'vqa2' else 'roc_auc'}"
    assert not caplog.records, "these configs hold no MMF key that mmvl ignores"


def test_keys_with_an_mmvl_equivalent_are_mapped():
    vqa = load("visual_bert", "vqa2")
    assert vqa.model_config.visual_bert.classifier_input == "last_text_token"  # pooler_strategy: vqa
    assert vqa.dataset_config.vqa2.processors.text_processor.params.do_lower_case is True
    assert OmegaConf.to_container(vqa.checkpoint.pretrained_state_mapping) == {"model.bert": "model.bert"}
    memes = load("visual_bert", "hateful_memes")
    assert memes.distributed.find_unused_parameters is True  # training.find_unused_parameters
    assert memes.dataset_config.hateful_memes.processors.text_processor.params.max_seq_length == 96
    opts = ["training.fp16=true", "training.update_frequency=4", "training.lr_scheduler=false"]
    cfg = load("visual_bert", "vqa2", *opts)
    assert cfg.training.precision == "fp16" and cfg.training.gradient_accumulation == 4
    assert cfg.scheduler.type is None  # MMF ignores the scheduler block without lr_scheduler


def test_mmf_includes_resolve_against_mmvl_configs():
    memes = load("visual_bert", "hateful_memes")  # configs/datasets/hateful_memes/with_features.yaml
    assert memes.dataset_config.hateful_memes.processors.features.type == "features"
    mmbt = load("mmbt", "hateful_memes")  # configs/models/mmbt/classification.yaml + .../bert.yaml
    assert [dict(x) for x in mmbt.model_config.mmbt.losses] == [{"type": "cross_entropy"}]
    assert mmbt.dataset_config.hateful_memes.processors.text_processor.params.max_seq_length == 128


def test_an_mmf_include_without_an_mmvl_equivalent_is_one_clear_error(tmp_path):
    user = tmp_path / "run.yaml"
    user.write_text("includes:\n- configs/datasets/vqa2/with_raw_images.yaml\n")
    with pytest.raises(UserError, match=r"configs/datasets/vqa2/with_raw_images.yaml has no mmvl equivalent"):
        load_config(["model=visual_bert", "datasets=vqa2", f"config={user}"])


def test_mmf_only_keys_are_listed_in_one_warning_line(tmp_path, caplog):
    user = tmp_path / "mmf_extras.yaml"
    user.write_text(yaml.safe_dump({
        "training": {"logger_level": "info", "wandb": {"enabled": False, "project": "mmf", "entity": "me"},
                     "seed": 3},
        "trainer": {"type": "lightning", "params": {"gpus": 1}},
        "model_config": {"visual_bert": {"bypass_transformer": False, "hidden_size": 64}},
        "dataset_config": {"vqa2": {"use_ocr": False, "return_features_info": False}},
        "env": {"report_dir": ""}}))
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        cfg = load_config(["model=visual_bert", "datasets=vqa2", f"config={user}",
                           "model_config.visual_bert.embedding_strategy=plain"])
    assert cfg.training.seed == 3 and cfg.model_config.visual_bert.hidden_size == 64  # mmvl's keys kept
    assert cfg.training.tracker_project == "mmf" and list(cfg.training.trackers) == ["tensorboard"]  # mapped
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    message = caplog.records[0].getMessage()
    for key in ("training.logger_level", "training.wandb", "trainer", "model_config.visual_bert.bypass_transformer",
                "dataset_config.vqa2.use_ocr", "dataset_config.vqa2.return_features_info=False", "env.report_dir",
                "model_config.visual_bert.embedding_strategy"):
        assert key in message, key
    assert str(user) in message and "command line" in message


@pytest.mark.parametrize("opt,needle", [
    ("training.logger_levle=info", "training.logger_levle"),
    ("model_config.visual_bert.pooler=vqa", "model_config.visual_bert.pooler"),
    ("dataset_config.vqa2.use_ocrr=false", "dataset_config.vqa2.use_ocrr"),
])
def test_keys_that_are_neither_mmvl_nor_mmf_stay_errors(opt, needle):
    with pytest.raises(UserError, match=f"Unknown config key '{needle}'"):
        load("visual_bert", "vqa2", opt)


def test_mmf_values_of_shared_keys():
    cfg = load("visual_bert", "vqa2", "run_type=train_inference", "training.trainer=mmf")
    assert cfg.run_type == "train_test" and cfg.training.trainer == "mmvl"
    cfg = load("visual_bert", "vqa2", "training.clip_gradients=false")
    assert cfg.training.clip_grad_norm is None


def test_clip_gradients_with_its_norm(tmp_path):
    user = tmp_path / "clip.yaml"
    user.write_text("training:\n  clip_gradients: true\n  max_grad_l2_norm: 0.25\n")
    cfg = load_config(["model=visual_bert", "datasets=vqa2", f"config={user}"])
    assert cfg.training.clip_grad_norm == 0.25


def test_a_mapped_value_mmvl_does_not_have_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        cfg = load("visual_bert", "vqa2", "model_config.visual_bert.pooler_strategy=bert")
    assert "model_config.visual_bert.pooler_strategy=bert" in caplog.text
    assert cfg.model_config.visual_bert.classifier_input == "last_text_token"  # the file's vqa stays


def test_the_tables_do_not_shadow_mmvl_keys():
    """Keys mmvl has keep mmvl's meaning; the table is only consulted for the others (and says so)."""
    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "defaults.yaml").read_text())
    for key in [*RENAMED, *UNUSED]:
        parts = key.split(".")
        if "*" in parts:
            continue
        node = base
        for part in parts:
            node = node.get(part) if isinstance(node, dict) else None
        # a mapping may hold MMF-only keys next to mmvl's (checkpoint.reset.all); a value is mmvl's alone
        assert node is None or isinstance(node, dict), f"{key} is an mmvl key now: remove it from mmvl/config/mmf.py"


def test_tokenizer_from_the_local_hugging_face_cache(hf_cache):
    from mmvl.data.processors.text import BertTokenizerProcessor

    tok = BertTokenizerProcessor(tokenizer_path="bert-base-uncased", max_seq_length=16)
    assert Path(tok.vocab_file) == hf_cache / "vocab.txt"
    assert tok("look at this")["input_ids"].tolist()[1:4] == [5, 6, 7]


def test_tokenizer_not_in_the_cache_is_one_clear_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from mmvl.data.processors.text import BertTokenizerProcessor

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="'bert-base-uncased' is not in the local cache .*never downloads"):
        BertTokenizerProcessor(tokenizer_path="bert-base-uncased")


def test_pooler_strategy_vqa_reads_the_token_before_sep():
    """``last_text_token`` (MMF's ``pooler_strategy: vqa``): the classifier sees each sample's text
    token before [SEP], not the pooled [CLS]."""
    from mmvl.models.visual_bert import VisualBert

    torch.manual_seed(0)
    model = VisualBert(OmegaConf.create({
        "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0,
        "vocab_size": 30, "num_labels": 3, "max_position_embeddings": 40, "feature_dim": 6,
        "classifier_input": "last_text_token"})).eval()
    ids = torch.tensor([[2, 7, 8, 9, 3, 0], [2, 7, 3, 0, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids > 0).long(), "token_type_ids": torch.zeros_like(ids),
             "features": torch.randn(2, 4, 6), "boxes": torch.rand(2, 4, 4), "feature_mask": torch.ones(2, 4)}
    seen = {}
    model.bert.encoder.register_forward_hook(lambda m, i, o: seen.update(hidden=o[0]))
    model.classifier.register_forward_hook(lambda m, i, o: seen.update(head_in=i[0]))
    model(batch)
    torch.testing.assert_close(seen["head_in"], seen["hidden"][[0, 1], [3, 1]])  # the tokens 9 and 7


def test_an_mmf_config_trains_end_to_end(hf_cache, tmp_path):
    """MMF's MMBT-on-Hateful-Memes structure, unchanged, plus tiny sizes on the command line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    from vl_data import write_hateful_memes

    from mmvl_cli.run import main

    write_hateful_memes(tmp_path / "data")
    tiny = ["model_config.mmbt.hidden_size=16", "model_config.mmbt.num_hidden_layers=1",
            "model_config.mmbt.num_attention_heads=2", "model_config.mmbt.intermediate_size=32",
            "model_config.mmbt.image_encoder.params={channels: [4, 8], strides: [4, 4]}",
            "dataset_config.hateful_memes.image_size=32", "training.batch_size=4", "training.max_updates=2",
            "training.num_workers=0", "training.progress_bar=false", "training.evaluation_interval=2",
            "training.log_interval=1", "scheduler.params.num_warmup_steps=1"]
    assert main(["model=mmbt", "datasets=hateful_memes", f"config={project('mmbt', 'hateful_memes')}",
                 f"env.data_dir={tmp_path / 'data'}", f"env.save_dir={tmp_path / 'save'}", *tiny]) == 0
    events = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert [e["update"] for e in events if e["split"] == "train"] == [1, 2]
    assert {"roc_auc", "binary_f1", "accuracy"} <= set([e for e in events if e["split"] == "val"][-1])
