"""easy_vqa: the package's files as a dataset (types, splits, targets, priors, errors), on a tiny folder of the
package's layout, and the installed package's counts."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import mmvl.data.datasets  # noqa: F401  (registers easy_vqa)
from mmvl import registry
from mmvl.data.datasets.easy_vqa import question_type
from mmvl.errors import UserError
from mmvl.metrics import build_metrics
from tests.fixtures.easy_vqa_files import write_easy_vqa_root

ROOT = Path(__file__).resolve().parents[3]
TRAIN = [["is there a red shape?", "yes", 0], ["what color is the shape?", "red", 0],
         ["what is the blue shape?", "circle", 1], ["does the image not contain a circle?", "no", 1],
         ["what shape is present?", "rectangle", 2], ["what is the color of the rectangle?", "green", 2],
         ["is there a green shape?", "yes", 2]]
TEST = [["is no red shape present?", "no", 0], ["what color is the circle?", "blue", 1]]


def write_root(root: Path) -> Path:
    return write_easy_vqa_root(root, {"train": (TRAIN, 3), "test": (TEST, 2)})


def builder(data_root, **overrides):
    cfg = OmegaConf.load(ROOT / "configs" / "datasets" / "easy_vqa.yaml").dataset_config.easy_vqa
    cfg = OmegaConf.merge(cfg, {"data_root": str(data_root) if data_root else None, **overrides})
    return registry.DATASETS.get("easy_vqa")(cfg, str(data_root or "."))


def test_question_types_follow_the_form():
    assert [question_type(q) for q, _, _ in TRAIN] == [0, 2, 1, 0, 1, 2, 0]
    with pytest.raises(UserError, match="neither a yes/no"):
        question_type("how many shapes are there?")


def test_splits_targets_and_prior(tmp_path):
    b = builder(write_root(tmp_path), val_images=1)
    train, val, test = (b.build(s) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (4, 3, 2)  # image 2 (the highest id) is val's
    assert {train[i]["image_id"] for i in range(4)} == {0, 1} and {val[i]["image_id"] for i in range(3)} == {2}
    vocab = b.answer_processor.vocab  # from train's answers only: the held-out 'rectangle'/'green' are not in it
    assert set(vocab) == {"yes", "red", "circle", "no"}
    item = train[1]
    assert item["question_type"] == 2 and vocab[item["targets"]] == "red"
    assert item["image"].shape == (3, 8, 8) and torch.allclose(item["image"], torch.full((3, 8, 8), -1.0))
    assert val[0]["targets"] == -100  # an answer outside the vocabulary: ignored by cross_entropy
    assert b.model_info()["num_labels"] == 4
    prior = b.extra_metrics("test")  # priors: yes/no 'no' (tie yes/no, alphabetical), colour 'red'
    assert prior == {"accuracy/prior": 0.5, "accuracy/prior/yes_no": 1.0, "accuracy/prior/color": 0.0}
    batch = b.collate([test[0], test[1]])
    metric = build_metrics(OmegaConf.to_container(b.config.metrics))[0]
    scores = torch.zeros(2, 4)
    scores[0, vocab.index("no")] = scores[1, vocab.index("red")] = 1.0
    metric.update(batch, {"scores": scores})
    assert metric.compute() == {"accuracy": 0.5, "accuracy/yes_no": 1.0, "accuracy/color": 0.0}
    rows = b.predictions(batch, scores)
    assert rows == [{"question_id": 0, "answer": "no"}, {"question_id": 1, "answer": "red"}]


def test_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match=r"pip install mmvl\[easy_vqa\]"):
        builder(None).build("test")
    with pytest.raises(UserError, match="has no train/questions.json"):
        builder(tmp_path).build("test")
    root = write_root(tmp_path / "d")
    with pytest.raises(UserError, match="no val split"):
        builder(root, val_images=0).build("val")
    with pytest.raises(UserError, match="leaves no training images"):
        builder(root, val_images=3).build("train")
    (root / "test" / "images" / "1.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match="1.png.*cannot be read"):
        builder(root, val_images=1).build("test")
    assert len(builder(root, val_images=1, on_bad_image="skip").build("test")) == 1
    (root / "train" / "questions.json").write_text('[["what?", "yes"]]')
    with pytest.raises(UserError, match="entry 0"):
        builder(root, val_images=1).build("train")


@pytest.mark.skipif(importlib.util.find_spec("easy_vqa") is None, reason="the easy-vqa package is not installed")
def test_the_installed_package(tmp_path):
    b = builder(None, max_samples=None)
    b.cache_dir = str(tmp_path)
    test = b.build("test")
    assert len(test) == 9673 and test[0]["image"].shape == (3, 64, 64)
    assert len(b.answer_processor.vocab) == 13
    assert b.extra_metrics("test")["accuracy/prior"] < 0.5
