"""VQA v2, COCO Captions (matching) and Hateful Memes: official formats, targets, errors, and
a few training updates of every vision-and-language model on every dataset's tiny fixture."""
from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import mmvl.data.datasets.coco_captions  # noqa: F401  (registration, until the package imports these)
import mmvl.data.datasets.hateful_memes  # noqa: F401
import mmvl.data.datasets.vqa2  # noqa: F401
import mmvl.models  # noqa: F401  (visual_bert)
import mmvl.models.concat_bert  # noqa: F401
import mmvl.models.mmbt  # noqa: F401
from mmvl import registry
from mmvl.config import load_config
from mmvl.data.predictions import write_predictions
from mmvl.errors import UserError
from mmvl.metrics import build_metrics
from mmvl.trainers import run
from tests.fixtures.vl_data import FIRST_TRAIN_ANSWERS, write_all, write_image

ROOT = Path(__file__).resolve().parents[3]
VL_DATASETS = ["vqa2", "coco_captions", "hateful_memes"]
VL_MODELS = ["visual_bert", "mmbt", "concat_bert"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_data")
    write_all(root)
    return root


def builder(name: str, data_dir, **overrides):
    """A builder from the shipped YAML with small images and ``overrides`` merged in."""
    cfg = OmegaConf.load(ROOT / "configs" / "datasets" / f"{name}.yaml").dataset_config[name]
    cfg.image_size = 32
    cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides))
    return registry.DATASETS.get(name)(cfg, str(data_dir))


def test_registered():
    for name in VL_DATASETS:
        assert registry.DATASETS.get(name).config_path == f"datasets/{name}.yaml"
    for name in ("vocab", "vqa_answer", "torchvision_transforms", "bert_tokenizer"):
        assert name in registry.PROCESSORS


# -- VQA v2 ------------------------------------------------------------------------------------
def test_vqa2_soft_scores_and_accuracy_by_hand(data_dir):
    b = builder("vqa2", data_dir)
    ds = b.build("train")
    vocab = b.answer_processor.index
    first = ds[0]
    assert first["id"] == 1 and first["image_id"] == 9 and first["image"].shape == (3, 32, 32)
    # answers: red, Red., red, red, blue, blue, dark-green, no, no, yes
    expected = {"red": 1.0, "blue": 2 / 3, "dark green": 1 / 3, "no": 2 / 3, "yes": 1 / 3}
    assert FIRST_TRAIN_ANSWERS.count("red") == 3
    for answer, score in expected.items():
        assert first["targets"][vocab[answer]].item() == pytest.approx(score)
    assert first["targets"].sum().item() == pytest.approx(3.0)  # nothing else scores
    # most frequent first: "no" (9 x 4 'dark?' questions + 2), then "red" (9 + 4)
    assert b.answer_processor.vocab[:2] == ["no", "red"]
    # VQA accuracy of hand-picked answers on the first three questions
    picks = ["blue", "maybe", "red"]  # q1: 2/3; q2 ('no' x9, 'maybe' x1): 1/3; q3 ('red' x9): 1
    scores = torch.full((3, len(vocab)), -5.0)
    for row, answer in enumerate(picks):
        scores[row, vocab[answer]] = 5.0
    targets = torch.stack([ds[i]["targets"] for i in range(3)])
    metric = build_metrics(["vqa_accuracy"])[0]
    assert metric({"targets": targets}, {"scores": scores})["vqa_accuracy"] == pytest.approx((2 / 3 + 1 / 3 + 1) / 3)


def test_vqa2_top_k_oracle_predictions_and_unlabelled_test(data_dir):
    b = builder("vqa2", data_dir, processors={"answer_processor": {"params": {"top_k": 2}}})
    assert b.model_info()["num_labels"] == 2 and b.answer_processor.vocab == ["no", "red"]
    # val colours (yellow, white, black) are not in the vocabulary {no, red}: only the 3 'no' questions
    assert b.extra_metrics("val")["vqa_accuracy/oracle"] == pytest.approx(3 / 6)
    test = b.build("test")
    batch = b.collate([test[i] for i in range(len(test))])
    assert "targets" not in batch and batch["image"].shape == (4, 3, 32, 32)
    assert b.extra_metrics("test") == {}
    rows = b.predictions({"id": batch["id"]}, torch.tensor([[0.0, 1.0]] * 4))
    assert rows[0] == {"question_id": int(batch["id"][0]), "answer": "red"} and len(rows) == 4


def test_vqa2_bad_files_raise_user_errors_naming_the_file(data_dir, tmp_path):
    (tmp_path / "vqa2").mkdir()
    q = tmp_path / "vqa2" / "v2_OpenEnded_mscoco_train2014_questions.json"
    with pytest.raises(UserError, match="v2_OpenEnded_mscoco_train2014_questions.json.*does not exist"):
        builder("vqa2", tmp_path).build("train")
    q.write_text('{"questions": [{"image_id": 1, "question": "hm?", "question_id": 1}, {"image_')
    with pytest.raises(UserError, match=r"questions.json.*not valid JSON \(line 1"):
        builder("vqa2", tmp_path).build("train")
    q.write_text(json.dumps({"questions": [{"image_id": 1, "question_id": 1}]}))
    with pytest.raises(UserError, match=r"questions.json.*questions\[0\] has no 'question' field"):
        builder("vqa2", tmp_path).build("train")
    q.write_text(json.dumps({"qs": []}))
    with pytest.raises(UserError, match="no top-level 'questions' field"):
        builder("vqa2", tmp_path).build("train")
    q.write_text(json.dumps({"questions": [{"image_id": 1, "question": "hm?", "question_id": 7}]}))
    a = tmp_path / "vqa2" / "v2_mscoco_train2014_annotations.json"
    a.write_text(json.dumps({"annotations": [{"question_id": 7, "answers": [{"answer_id": 1}]}]}))
    with pytest.raises(UserError, match=r"annotations.json.*answers\[0\] has no 'answer' field"):
        builder("vqa2", tmp_path).build("train")
    a.write_text(json.dumps({"annotations": [{"question_id": 8, "answers": []}]}))
    with pytest.raises(UserError, match="no annotation for question_id 7"):
        builder("vqa2", tmp_path).build("train")
    with pytest.raises(UserError, match="on_bad_image"):
        builder("vqa2", data_dir, on_bad_image="ignore")


def test_bad_images_error_or_skip(data_dir, tmp_path, caplog):
    import shutil

    shutil.copytree(data_dir / "hateful_memes", tmp_path / "hateful_memes")
    (tmp_path / "hateful_memes" / "img" / "01001.png").write_bytes(b"not a png")  # train item 1
    (tmp_path / "hateful_memes" / "img" / "01002.png").unlink()  # train item 2
    strict = builder("hateful_memes", tmp_path).build("train")
    with pytest.raises(UserError, match="01001.png.*cannot be decoded"):
        strict[1]
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        lenient = builder("hateful_memes", tmp_path, on_bad_image="skip").build("train")
    assert len(lenient) == 6 and [lenient[i]["id"] for i in range(2)] == [1000, 1003]
    assert "skipped 2 of 8 samples" in caplog.text
    # an image that is readable at build time but truncated on disk: the next sample is served
    truncated = tmp_path / "hateful_memes" / "img" / "01003.png"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        item = lenient[1]
    assert item["id"] == 1004 and "1 skipped so far" in caplog.text
    (tmp_path / "hateful_memes" / "img" / "01000.png").unlink()
    with pytest.raises(UserError, match="01000.png.*does not exist"):
        builder("hateful_memes", tmp_path).build("train")


# -- Hateful Memes -----------------------------------------------------------------------------
def test_hateful_memes_labels_test_split_and_csv(data_dir, tmp_path):
    b = builder("hateful_memes", data_dir)
    train = b.build("train")
    assert [train[i]["targets"] for i in range(4)] == [0, 1, 0, 1]
    test = b.collate([b.build("test")[i] for i in range(4)])
    assert "targets" not in test and test["id"].tolist() == [1014, 1015, 1016, 1017]
    assert b.prediction_format == "csv"
    rows = b.predictions({"id": test["id"]}, torch.tensor([[0.0, 2.0], [2.0, 0.0], [0.0, 0.0], [1.0, -1.0]]))
    path = write_predictions(str(tmp_path), "hateful_memes", "test", rows, b.prediction_format)
    read = list(csv.DictReader(open(path)))
    assert [r["id"] for r in read] == ["1014", "1015", "1016", "1017"]
    assert [r["label"] for r in read] == ["1", "0", "1", "0"]
    assert float(read[0]["proba"]) == pytest.approx(1 / (1 + math.exp(-2)))


def test_hateful_memes_jsonl_errors(tmp_path):
    folder = tmp_path / "hateful_memes"
    folder.mkdir()
    path = folder / "train.jsonl"
    path.write_text('{"id": 1, "img": "img/1.png", "label": 0, "text": "a"}\n\n{"id": 2, "img": "img/2.png", "lab\n')
    with pytest.raises(UserError, match="train.jsonl' line 3 is not valid JSON"):
        builder("hateful_memes", tmp_path).build("train")
    path.write_text('{"id": 1, "img": "img/1.png", "label": 0}\n')
    with pytest.raises(UserError, match="train.jsonl' line 1 has no 'text' field"):
        builder("hateful_memes", tmp_path).build("train")
    path.write_text('{"id": 1, "img": "i.png", "label": 0, "text": "a"}\n{"id": 2, "img": "i.png", "text": "b"}\n')
    with pytest.raises(UserError, match="line 2 lacks a label"):
        builder("hateful_memes", tmp_path).build("train")
    path.write_text('{"id": 1, "img": "i.png", "label": 3, "text": "a"}\n')
    with pytest.raises(UserError, match="label 3"):
        builder("hateful_memes", tmp_path).build("train")
    with pytest.raises(UserError, match="dev_seen.jsonl.*does not exist"):
        builder("hateful_memes", tmp_path).build("val")


# -- COCO Captions -----------------------------------------------------------------------------
def test_coco_matching_pairs_are_deterministic_and_correct(data_dir):
    def pairs(**kw):
        ds = builder("coco_captions", data_dir, **kw).build("train")
        return [(ds[i]["targets"], ds[i]["image_id"], ds[i]["caption_id"]) for i in range(len(ds))]

    a, again = pairs(negative_ratio=0.5), pairs(negative_ratio=0.5)
    assert a == again and len(a) == 8
    b = builder("coco_captions", data_dir, negative_ratio=0.5)
    records = {r["id"]: r["image_id"] for r in b.records("train")}
    assert {t for t, _, _ in a} == {0, 1}  # both kinds present
    for target, image_id, caption_id in a:
        assert target == int(records[caption_id] == image_id)
    assert pairs(negative_ratio=0.5, seed=1) != a
    assert all(t == 0 for t, _, _ in pairs(negative_ratio=1.0))
    assert all(t == 1 for t, _, _ in pairs(negative_ratio=0.0))
    with pytest.raises(UserError, match="negative_ratio"):
        builder("coco_captions", data_dir, negative_ratio=1.5).build("train")
    with pytest.raises(UserError, match="split 'test' is not configured"):
        b.build("test")


def test_coco_errors_name_the_file(tmp_path, caplog):
    path = tmp_path / "coco" / "annotations" / "captions_train2014.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}],
                                "annotations": [{"id": 5, "image_id": 2, "caption": "x"}]}))
    with pytest.raises(UserError, match="captions_train2014.json.*image_id 2"):
        builder("coco_captions", tmp_path).build("train")
    path.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}],
                                "annotations": [{"id": 5, "image_id": 1}]}))
    with pytest.raises(UserError, match=r"annotations\[0\] has no 'caption' field"):
        builder("coco_captions", tmp_path).build("train")
    path.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}],
                                "annotations": [{"id": 5, "image_id": 1, "caption": "x"}]}))
    write_image(tmp_path / "coco" / "images" / "train2014" / "a.jpg", "red", (8, 8))
    with pytest.raises(UserError, match="at least two images"):
        builder("coco_captions", tmp_path).build("train")
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        b = builder("coco_captions", tmp_path, negative_ratio=0.0, mask_probability=0.15)
        assert b.build("train")[0]["targets"] == 1
    assert "no masking" in caplog.text


# -- region features instead of pixels ---------------------------------------------------------
def test_features_replace_pixels(data_dir, tmp_path):
    folder = tmp_path / "feats"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for k in range(8):
        np.save(folder / f"{1000 + k:05d}.npy", rng.standard_normal((3 + k % 2, 6)).astype(np.float32))
    b = builder("hateful_memes", data_dir,
                processors={"features": {"type": "features", "params": {"path": str(folder), "max_features": 4}}})
    batch = b.collate([b.build("train")[i] for i in range(4)])
    assert "image" not in batch and batch["features"].shape == (4, 4, 6)
    assert batch["feature_mask"].tolist()[:2] == [[1, 1, 1, 0], [1, 1, 1, 1]]
    model = registry.MODELS.get("mmbt")(OmegaConf.create(dict(TINY, vocab_size=b.model_info()["vocab_size"],
                                                              num_labels=2, feature_dim=6)))
    assert model(batch)["scores"].shape == (4, 2)


# -- training every model on every dataset -----------------------------------------------------
TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
LOSSES = {"vqa2": "logit_bce", "coco_captions": "cross_entropy", "hateful_memes": "cross_entropy"}


def tiny_opts(model: str, dataset: str, data_dir, save_dir) -> list[str]:
    """Opts for a 3-update run with the tiniest sizes the model's YAML lets us set."""
    base = [f"model={model}", f"datasets={dataset}", f"env.data_dir={data_dir}", f"env.save_dir={save_dir}"]
    mcfg = load_config(base).model_config[model]
    opts = base + ["training.max_updates=3", "training.batch_size=4", "training.num_workers=0",
                   "training.progress_bar=false", "training.log_interval=1", "evaluation.predict=true",
                   "scheduler.params.num_warmup_steps=1", f"dataset_config.{dataset}.image_size=32",
                   f"model_config.{model}.losses=[{{type: {LOSSES[dataset]}}}]"]
    opts += [f"model_config.{model}.{k}={v}" for k, v in TINY.items() if k in mcfg]
    encoder = mcfg.get("image_encoder")
    if encoder is not None and encoder.get("type") == "cnn" and "params" in encoder:
        opts.append(f"model_config.{model}.image_encoder.params={{channels: [8, 16], strides: [4, 4]}}")
    return opts


@pytest.mark.parametrize("dataset", VL_DATASETS)
@pytest.mark.parametrize("model", VL_MODELS)
def test_every_model_trains_on_every_dataset(model, dataset, data_dir, tmp_path):
    assert model in registry.MODELS and dataset in registry.DATASETS
    torch.manual_seed(0)
    results = run(load_config(tiny_opts(model, dataset, data_dir, tmp_path)))
    assert results["updates"] == 3
    train = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"train"' in line]
    assert [e["update"] for e in train] == [1, 2, 3]
    assert all(math.isfinite(e["total_loss"]) for e in train)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    val = results["val"][dataset]
    metric = {"vqa2": "vqa_accuracy", "coco_captions": "roc_auc", "hateful_memes": "binary_f1"}[dataset]
    assert metric in val and math.isfinite(val["total_loss"])
    fmt = "csv" if dataset == "hateful_memes" else "json"
    assert (tmp_path / "predictions" / f"{dataset}_val.{fmt}").is_file()


PROJECTS = sorted(str(p.relative_to(ROOT)) for m in VL_MODELS for d in ("hateful_memes", "vqa2")
                  for p in [ROOT / "projects" / m / "configs" / d / "defaults.yaml"])


@pytest.mark.parametrize("project", PROJECTS)
def test_project_configs_load(project, tmp_path):
    cfg = load_config([f"config={ROOT / project}", f"env.save_dir={tmp_path}"])
    model, dataset = cfg.model, cfg.datasets[0]
    assert project.split("/")[1] == model and project.split("/")[3] == dataset
    assert cfg.model_config[model].text_encoder.pretrained_path == "minilm"
    assert cfg.dataset_config[dataset].processors.text_processor.params.tokenizer_path == "minilm"
    assert cfg.model_config[model].losses[0].type == LOSSES[dataset]


def test_minilm_through_the_config_equals_the_checkpoint(data_dir, tmp_path):
    """``text_encoder.pretrained_path=minilm`` with ``tokenizer_path=minilm``: weights and vocab agree."""
    from safetensors.torch import load_file

    from mmvl.build import build_datasets, build_model
    from mmvl.data.processors.text import minilm_dir

    cfg = load_config([f"config={ROOT / 'projects/mmbt/configs/hateful_memes/defaults.yaml'}",
                       f"env.data_dir={data_dir}", f"env.save_dir={tmp_path}", "dataset_config.hateful_memes.image_size=32",
                       "model_config.mmbt.image_encoder.params={stages: 1}"])
    builders = build_datasets(cfg)
    model = build_model(cfg, builders)
    reference = load_file(str(minilm_dir() / "model.safetensors"))
    own = model.bert.state_dict()
    assert model.bert.config.vocab_size == builders["hateful_memes"].text_processor.vocab_size == 30522
    compared = [k for k in reference if k in own]
    assert len(compared) >= 100
    for key in compared:
        torch.testing.assert_close(own[key], reference[key])
    ds = builders["hateful_memes"].build("val")
    batch = builders["hateful_memes"].collate([ds[i] for i in range(2)])
    assert batch["input_ids"][0, 0].item() == 101  # BERT's [CLS]
    assert model.eval()(batch)["scores"].shape == (2, 2)


def test_unlabelled_test_split_through_the_trainer(data_dir, tmp_path):
    """run_type=test on the label-less test split writes the challenge CSV."""
    opts = tiny_opts("concat_bert", "hateful_memes", data_dir, tmp_path)
    results = run(load_config(opts + ["run_type=test", "dataset_config.hateful_memes.metrics=[]"]))
    assert results["test"]["hateful_memes"] == {}  # no targets: no loss, no metrics
    rows = list(csv.DictReader(open(tmp_path / "predictions" / "hateful_memes_test.csv")))
    assert [r["id"] for r in rows] == ["1014", "1015", "1016", "1017"]
    assert all(0.0 <= float(r["proba"]) <= 1.0 and r["label"] in ("0", "1") for r in rows)
