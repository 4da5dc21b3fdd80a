"""Sort-of-CLEVR: deterministic generation, correct answers, the prior, tokens and collation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mmvl.data.datasets import sort_of_clevr as soc
from mmvl.data.datasets.sort_of_clevr import ANSWERS, SortOfClevrBuilder
from mmvl.data.processors.text import BertTokenizerProcessor, write_word_vocab
from mmvl.data.sample import collate
from mmvl.errors import UserError
from mmvl.registry import DATASETS, PROCESSORS

TINY = {"num_images": 6, "num_val_images": 3, "num_test_images": 2, "questions_per_image": 8, "seed": 3}


def builder(tmp_path, **overrides) -> SortOfClevrBuilder:
    return SortOfClevrBuilder(OmegaConf.create({**TINY, **overrides}), str(tmp_path))


def test_registered():
    assert DATASETS.get("sort_of_clevr") is SortOfClevrBuilder
    assert PROCESSORS.get("bert_tokenizer") is BertTokenizerProcessor


def test_same_seed_same_arrays_and_questions():
    a, qa = soc.generate_split(4, 10, seed=7, size=75, obj=5, background=255)
    b, qb = soc.generate_split(4, 10, seed=7, size=75, obj=5, background=255)
    c, _ = soc.generate_split(4, 10, seed=8, size=75, obj=5, background=255)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert qa == qb
    assert not np.array_equal(a["images"], c["images"])


def test_prepare_is_deterministic_atomic_and_idempotent(tmp_path):
    one, two = builder(tmp_path / "a"), builder(tmp_path / "b")
    one.prepare()
    two.prepare()
    assert one.root.name == two.root.name  # folder named by a hash of the generation params
    for split in ("train", "val", "test"):
        with np.load(one.root / f"{split}.npz", allow_pickle=False) as x, \
                np.load(two.root / f"{split}.npz", allow_pickle=False) as y:
            np.testing.assert_array_equal(x["images"], y["images"])
    assert sorted(p.name for p in one.root.parent.iterdir()) == [one.root.name]  # no temp folder left
    stamp = (one.root / "train.npz").stat().st_mtime_ns
    one.prepare()
    assert (one.root / "train.npz").stat().st_mtime_ns == stamp
    assert builder(tmp_path / "a", seed=4).root != one.root
    # held-out splits hold other images than train
    with np.load(one.root / "train.npz") as tr, np.load(one.root / "val.npz") as va:
        assert not any((v == t).all() for v in va["images"] for t in tr["images"])


def test_answers_on_a_hand_made_scene():
    # red, green, blue, orange, gray, yellow as (x, y); y grows downwards, image centre is 37.5
    xy = np.array([[10, 10], [30, 12], [65, 10], [10, 64], [40, 40], [66, 66]])
    shapes = np.array([1, 0, 0, 1, 1, 0])  # square, circle, circle, square, square, circle
    a = lambda qtype, color: ANSWERS[soc.answer(qtype, color, xy, shapes, 75)]  # noqa: E731
    assert a(0, 0) == "square" and a(0, 1) == "circle"
    assert a(1, 0) == "yes" and a(1, 2) == "no"          # left?
    assert a(2, 0) == "yes" and a(2, 3) == "no"          # top?
    assert a(3, 0) == "circle"                           # closest to red is green (20 px)
    assert a(3, 5) == "square"                           # closest to yellow is gray
    assert a(4, 0) == "circle"                           # furthest from red is yellow
    assert a(4, 2) == "square"                           # furthest from blue is orange
    assert a(5, 0) == "3" and a(5, 1) == "3"             # three squares, three circles
    img = soc.render(xy, shapes, 75, 5, 255)
    assert tuple(img[10, 10]) == soc.COLORS["red"]       # [row=y, col=x]
    assert tuple(img[15, 15]) == soc.COLORS["red"]       # a square's corner is filled
    assert tuple(img[12 + 5, 30 + 5]) == (255, 255, 255)  # a circle's is not
    assert tuple(img[12, 35]) == soc.COLORS["green"]
    assert tuple(img[0, 0]) == (255, 255, 255)


def test_generated_answers_match_the_scene(tmp_path):
    b = builder(tmp_path)
    b.prepare()
    with np.load(b.root / "val.npz", allow_pickle=False) as arrays:
        xy, shapes = arrays["centers"], arrays["shapes"]
    questions = b.questions("val")
    assert len(questions) == 3 * 8
    for q in questions:
        assert q["answer"] == soc.answer(q["type"], q["color"], xy[q["image"]], shapes[q["image"]], 75)
        assert soc.COLOR_NAMES[q["color"]] in q["question"]
    per_image = [sum(q["image"] == i for q in questions) for i in range(3)]
    assert per_image == [8, 8, 8]
    assert sum(q["type"] >= 3 for q in questions) == 3 * 4  # half relational


def test_prior_uses_training_answers(tmp_path):
    b = builder(tmp_path)
    b._questions = {  # hand-set questions: type 0 mostly 'square' in train
        "train": [{"type": 0, "answer": 1}, {"type": 0, "answer": 1}, {"type": 0, "answer": 0},
                  {"type": 5, "answer": 6}],
        "val": [{"type": 0, "answer": 1}, {"type": 0, "answer": 1}, {"type": 0, "answer": 0},
                {"type": 5, "answer": 6}, {"type": 3, "answer": 0}],
    }
    assert b.prior_answers() == {0: 1, 5: 6}
    # type 3 has no training answer: never right; types without questions are left out
    assert b.extra_metrics("val") == {
        "accuracy/prior": pytest.approx(3 / 5), "accuracy/prior/non_relational": pytest.approx(2 / 3),
        "accuracy/prior/relational": pytest.approx(1 / 2), "accuracy/prior/shape": pytest.approx(2 / 3),
        "accuracy/prior/closest": 0.0, "accuracy/prior/count": 1.0}


def test_per_type_accuracy_from_the_dataset_config():
    """The shipped metrics report accuracy per family and per question type, next to the overall figure."""
    from mmvl.config import load_config
    from mmvl.metrics import build_metrics

    config = load_config(["datasets=sort_of_clevr", "model=visual_bert"])
    metrics = build_metrics(list(config.dataset_config.sort_of_clevr.metrics))
    types = torch.tensor([0, 0, 1, 2, 3, 3, 3, 4, 5, 5])
    targets = torch.tensor([0, 1, 2, 3, 0, 1, 0, 1, 4, 5])
    predicted = torch.tensor([0, 0, 2, 2, 0, 1, 1, 1, 4, 9])  # right: 0, 2, 4, 5, 7, 8
    batch = {"targets": targets, "question_type": types, "question_family": (types >= 3).long()}
    output = {"scores": torch.nn.functional.one_hot(predicted, 10).float()}
    values = {}
    for metric in metrics:
        values.update(metric(batch, output))
    assert values == pytest.approx({
        "accuracy": 0.6, "accuracy/non_relational": 0.5, "accuracy/relational": 4 / 6,
        "accuracy/shape": 0.5, "accuracy/left": 1.0, "accuracy/top": 0.0, "accuracy/closest": 2 / 3,
        "accuracy/furthest": 1.0, "accuracy/count": 0.5})
    assert soc.TYPE_NAMES == list(config.dataset_config.sort_of_clevr.metrics[1].params.group_names)


def test_prior_on_generated_data_is_near_chance(tmp_path):
    b = builder(tmp_path, num_images=60, num_val_images=40, questions_per_image=36)
    b.prepare()
    values = b.extra_metrics("val")
    assert 0.35 < values["accuracy/prior"] < 0.6  # binary types ~0.5, counting ~0.31
    assert 0.2 < values["accuracy/prior/count"] < 0.45
    assert set(values) == {"accuracy/prior", *(f"accuracy/prior/{n}" for n in soc.FAMILY_NAMES + soc.TYPE_NAMES)}


def test_scenes_match_the_questions(tmp_path):
    b = builder(tmp_path)
    b.prepare()
    scenes = b.scenes("val")
    assert scenes["centers"].shape == (3, 6, 2) and scenes["shapes"].shape == (3, 6)
    for q in b.questions("val"):
        assert q["answer"] == soc.answer(q["type"], q["color"], scenes["centers"][q["image"]],
                                         scenes["shapes"][q["image"]], 75)


def test_items_and_model_info(tmp_path):
    b = builder(tmp_path)
    before = b.model_info()  # the lead's build code may ask before prepare()
    b.prepare()
    ds = b.build("train")
    assert len(ds) == 6 * 8
    item = ds[0]
    assert item["image"].shape == (3, 75, 75) and item["image"].dtype == torch.float32
    assert item["image"].min() >= -1.0 and item["image"].max() <= 1.0 and item["image"].max() == 1.0
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert item[key].dtype == torch.long and item[key].dim() == 1
    assert isinstance(item["targets"], int) and 0 <= item["targets"] < len(ANSWERS)
    assert item["question_family"] == int(item["question_type"] >= 3)
    info = b.model_info()
    assert info == before
    assert info["num_labels"] == len(ANSWERS) == len(b.answer_vocab)
    tokens = (b.root / "vocab.txt").read_text().split()
    assert info["vocab_size"] == len(tokens) and "red" in tokens and "[CLS]" in tokens
    assert "[UNK]" not in b.text_processor.tokenizer.convert_ids_to_tokens(item["input_ids"].tolist())


def test_tokens_are_unpadded_and_collate_pads_to_longest(tmp_path):
    vocab = write_word_vocab(["is the red object on the left?", "what is the shape of the red object?"],
                             tmp_path / "vocab.txt")
    proc = BertTokenizerProcessor(tokenizer_path=str(vocab), max_seq_length=32)
    short, long = proc("is the red object on the left?"), proc("what is the shape of the red object?")
    assert short["input_ids"].shape == (10,) and long["input_ids"].shape == (11,)
    assert short["attention_mask"].eq(1).all() and short["token_type_ids"].eq(0).all()
    batch = collate([short, long])
    assert batch["input_ids"].shape == (2, 11)
    assert batch["attention_mask"][0].tolist() == [1] * 10 + [0]
    assert batch["input_ids"][0, 10:].tolist() == [0]  # [PAD] is id 0
    assert proc("is the red object on the left?")["input_ids"].shape == (10,)  # cached, still unpadded
    truncated = BertTokenizerProcessor(tokenizer_path=str(tmp_path), max_seq_length=5)("what is the shape of it?")
    assert truncated["input_ids"].shape == (5,) and truncated["input_ids"][-1].item() == 3  # ends in [SEP]


def test_bad_params_raise_user_errors(tmp_path):
    with pytest.raises(UserError, match="questions_per_image"):
        builder(tmp_path, questions_per_image=40)
    with pytest.raises(UserError, match="tokenizer_path"):
        BertTokenizerProcessor(tokenizer_path=str(tmp_path / "nope"))
    with pytest.raises(UserError, match="split"):
        builder(tmp_path).questions("dev")
    with pytest.raises(UserError, match="prepare"):
        builder(tmp_path).build("train")


def test_meta_records_params(tmp_path):
    b = builder(tmp_path)
    b.prepare()
    meta = json.loads((b.root / "meta.json").read_text())
    assert meta["params"]["seed"] == 3 and meta["answers"] == ANSWERS


def test_regions_option_serves_features_instead_of_pixels(tmp_path):
    b = builder(tmp_path, regions="crops")
    assert b.model_info()["feature_dim"] == 507 and "feature_dim" not in builder(tmp_path).model_info()
    b.prepare()
    ds = b.build("val")
    batch = collate([ds[0], ds[1]])
    assert "image" not in batch
    assert batch["features"].shape == (2, 6, 507) and batch["features"].dtype == torch.float32
    assert 0.0 <= batch["features"].min() and batch["features"].max() == 1.0
    assert batch["boxes"].shape == (2, 6, 4) and batch["feature_mask"].eq(1).all()
    assert ((batch["boxes"][..., 2:] - batch["boxes"][..., :2]) * 75).sub(11).abs().max() < 1e-4
    with pytest.raises(UserError, match="regions"):
        builder(tmp_path, regions="boxes")


def test_generated_folder_follows_the_umask(tmp_path, umask):
    """Teammates can read a shared data folder: not mkdtemp's 0700."""
    from tests.fixtures.modes import tree, wrong_modes

    one = builder(tmp_path)
    one.prepare()
    assert wrong_modes(tree(one.root), umask) == []
