"""easy_vqa_generative: easy-VQA's questions, or captions read off them, as prompt_answer samples for a VLM."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import mmvl.data.datasets  # noqa: F401  (registers easy_vqa_generative)
from mmvl import registry
from mmvl.data.datasets.easy_vqa_generative import image_captions
from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
from tests.fixtures.easy_vqa_files import write_easy_vqa_root

ROOT = Path(__file__).resolve().parents[3]
TRAIN = [["is there a red shape?", "yes", 0], ["what color is the circle?", "red", 0],
         ["what is the blue shape?", "rectangle", 1], ["does the image not contain a gray shape?", "yes", 1],
         ["what color is the shape?", "green", 2],  # image 2: the shape stays open
         ["what shape is present?", "triangle", 3], ["what color is the shape?", "teal", 3]]
TEST = [["is there not a circle?", "yes", 0], ["is no triangle present?", "yes", 0],  # ruled out: a rectangle
        ["what color is the rectangle?", "black", 0], ["is there a blue shape?", "no", 1]]


def write_root(root: Path) -> Path:
    return write_easy_vqa_root(root, {"train": (TRAIN, 4), "test": (TEST, 2)})


def builder(root: Path, **overrides):
    cfg = OmegaConf.load(ROOT / "configs" / "datasets" / "easy_vqa_generative.yaml").dataset_config
    # no image_processor: pixels / 255 (torchvision's transforms take seconds to import)
    cfg = OmegaConf.merge(cfg.easy_vqa_generative, {"data_root": str(root), "processors": {"image_processor": None}},
                          overrides)
    return registry.DATASETS.get("easy_vqa_generative")(cfg, str(root))


def test_captions_come_from_the_questions_and_answers():
    rows = TRAIN + [[q, a, i + 10] for q, a, i in TEST]
    captions = image_captions(*zip(*[(q, a, i) for q, a, i in rows]))
    assert captions == {0: "the image shows a red circle", 1: "the image shows a blue rectangle",
                        3: "the image shows a teal triangle", 10: "the image shows a black rectangle"}
    # two colours named for one image: no caption rather than a guess
    assert image_captions(["what color is the circle?", "is there a red shape?"], ["blue", "yes"], [0, 0]) == {}


def test_caption_samples_label_only_the_caption(tmp_path):
    b = builder(write_root(tmp_path), task="caption", val_images=1)
    train, val, test = (b.build(s) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (2, 1, 1)  # image 2 has no caption; image 3 is val's
    assert [train[i]["answer"] for i in range(2)] == ["the image shows a red circle",
                                                      "the image shows a blue rectangle"]
    item = train[1]
    assert item["question_type"] == 3 and item["image"].shape == (3, 8, 8) and item["id"] == item["image_id"] == 1
    labelled = item["targets"].ne(IGNORE_INDEX)
    proc = b.text_processor
    assert proc.decode(item["targets"][labelled].tolist()) == item["answer"]
    prompt = item["input_ids"][~labelled]
    assert (prompt == proc.tokenizer.image_id).sum() == 16 and proc.decode(prompt.tolist()) == "describe the image"
    batch = b.collate([train[0], train[1]])
    assert batch["input_ids"].shape == batch["targets"].shape
    assert batch["answer"] == [train[0]["answer"], item["answer"]]
    written = torch.stack([train[0]["targets"][-7:], item["targets"][-7:].flip(0)])  # generated ids, eos-ended
    rows = b.predictions(batch, written)
    assert rows == [{"id": 0, "answer": "the image shows a red circle", "reference": "the image shows a red circle"},
                    {"id": 1, "answer": "", "reference": item["answer"]}]  # the flipped row starts with eos
    assert b.model_info()["image_token_id"] == proc.tokenizer.image_id and b.extra_metrics("test") == {}


def test_vqa_samples_are_the_questions_and_share_the_vocabulary(tmp_path):
    root = write_root(tmp_path)
    b, c = builder(root, val_images=0), builder(root, task="caption", val_images=0)
    train = b.build("train")
    assert len(train) == len(TRAIN) and [train[i]["answer"] for i in range(3)] == ["yes", "red", "rectangle"]
    assert train[2]["question_type"] == 1 and b.text_processor.decode(train[2]["input_ids"].tolist()).startswith(
        "what is the blue shape")
    assert b.text_processor.tokenizer.itos == c.text_processor.tokenizer.itos  # a caption model can be asked questions


def test_errors_name_the_fix(tmp_path):
    root = write_root(tmp_path)
    with pytest.raises(UserError, match="task='captions'; use one of vqa, caption"):
        builder(root, task="captions")
    with pytest.raises(UserError, match="caption_prompt is empty"):
        builder(root, task="caption", caption_prompt="")
    with pytest.raises(UserError, match="needs prompt_answer"):
        builder(root, val_images=0, processors={"text_processor": {"type": "vocab"}}).build("test")
    with pytest.raises(UserError, match="easy_vqa_generative: val_images is 0, so there is no val split"):
        builder(root, val_images=0).build("val")


def test_conversation_trains_on_each_images_questions_and_asks_val_and_test_alone(tmp_path):
    b = builder(write_root(tmp_path), task="conversation", val_images=1,
                processors={"text_processor": {"params": {"max_length": 64}}})
    train, val, test = (b.build(s) for s in ("train", "val", "test"))
    assert len(train) == 3 and len(val) == 2 and len(test) == len(TEST)  # images 0-2; image 3's 2 questions
    proc = b.text_processor
    item = train[0]  # image 0: two questions, both answers labelled, each followed by the end token
    labelled = item["targets"][item["targets"].ne(IGNORE_INDEX)].tolist()
    assert sorted(proc.decode([t]) for t in labelled if t != proc.end_id) == ["red", "yes"]
    assert labelled.count(proc.end_id) == 2 and item["input_ids"].eq(proc.tokenizer.image_id).sum() == 16
    orders = set()
    for epoch in range(6):  # the turns' order is drawn per epoch, the same for the same epoch
        train.set_epoch(epoch)
        orders.add(proc.decode(train[0]["input_ids"].tolist()))
        assert proc.decode(train[0]["input_ids"].tolist()) == proc.decode(train[0]["input_ids"].tolist())
    assert len(orders) == 2
    # val and test: one question each, with no history (earlier questions would name the answers)
    assert [val[i]["answer"] for i in range(2)] == ["triangle", "teal"]
    assert val[0]["targets"].ne(IGNORE_INDEX).sum() == 2  # the answer word and its end token
    assert b.collate([val[0], val[1]])["input_ids"].shape[0] == 2


def test_sampled_conversation_turns_draw_how_many_questions_each_epoch(tmp_path):
    b = builder(write_root(tmp_path), task="conversation", val_images=1, conversation_turns="sampled",
                processors={"text_processor": {"params": {"max_length": 64}}})
    train, proc = b.build("train"), b.text_processor
    counts = set()
    for epoch in range(12):
        train.set_epoch(epoch)
        counts.add(int(train[0]["targets"].eq(proc.end_id).sum()))  # one end token an answer
    assert counts == {1, 2}  # image 0 has two questions: one or both, drawn per epoch
    with pytest.raises(UserError, match="conversation_turns='some'; use all or sampled"):
        builder(write_root(tmp_path / "other"), task="conversation", conversation_turns="some")


@pytest.mark.parametrize("order", ["shuffled", "closed_first"])
def test_closed_first_asks_the_yes_no_questions_before_the_open_ones(tmp_path, order):
    """closed_first: an image's yes/no turns come before its open ones in every epoch (an earlier
    "what color" answer would give a later "is there a red shape?" away); shuffled draws both orders."""
    b = builder(write_root(tmp_path), task="conversation", val_images=1, conversation_order=order,
                processors={"text_processor": {"params": {"max_length": 64}}})
    train, proc = b.build("train"), b.text_processor
    firsts = set()
    for epoch in range(8):
        train.set_epoch(epoch)
        for index in (0, 1):  # image 0: a yes/no and a colour question; image 1: a shape and a yes/no question
            targets = train[index]["targets"]
            firsts.add(proc.decode([targets[targets.ne(IGNORE_INDEX)][0].item()]))
    assert firsts == ({"yes"} if order == "closed_first" else {"yes", "red", "rectangle"})
    with pytest.raises(UserError, match="conversation_order='yes_no'; use one of shuffled, closed_first"):
        builder(write_root(tmp_path / "other"), task="conversation", conversation_order="yes_no")


@pytest.mark.parametrize("task", ["conversation", "vqa"])
def test_declared_lengths_follow_the_samples_tokens(tmp_path, task):
    """What ``training.group_by_length`` sorts by: each sample's declared length is its real token
    count within one end token a user turn (the estimate counts words, not tokens), and is held to max_length."""
    b = builder(write_root(tmp_path), task=task, val_images=1, processors={"text_processor": {"params": {"max_length": 64}}})
    train = b.build("train")
    declared = train.sample_lengths()
    real = [int(train[i]["attention_mask"].sum()) for i in range(len(train))]
    turns = [int(train[i]["targets"].eq(b.text_processor.end_id).sum()) for i in range(len(train))]
    assert len(declared) == len(train) and all(0 <= d - r <= t for d, r, t in zip(declared, real, turns))
    short = builder(write_root(tmp_path / "short"), task=task, val_images=1,
                    processors={"text_processor": {"params": {"max_length": 20}}}).build("train")
    assert max(short.sample_lengths()) <= 20
    if task == "conversation":  # a sampled conversation's length is drawn per epoch: no fixed grouping
        sampled = builder(write_root(tmp_path / "sampled"), task=task, val_images=1,
                          conversation_turns="sampled").build("train")
        with pytest.raises(UserError, match="conversation_turns=sampled"):
            sampled.sample_lengths()


BALANCE = [["what color is the shape?", "red", 0], ["is there a blue shape?", "no", 0],
           ["is there not a green shape?", "yes", 0], ["does the image contain a yellow shape?", "no", 0],
           ["what color is the shape?", "teal", 1], ["is there a teal shape?", "yes", 1],
           ["what color is the shape?", "gray", 2]]


def words(proc, ids) -> str:
    """Every token of a sample, turn ends and all (``decode`` stops at the first answer's end)."""
    return " ".join(proc.tokenizer.itos[i] for i in ids.tolist())


@pytest.mark.parametrize("mode", ["as_asked", "balanced"])
def test_balanced_colour_questions_ask_as_often_about_the_images_own_colour(tmp_path, mode):
    """balanced: a yes/no turn naming a colour the image lacks is, by a drawn chance, asked about the
    image's colour with the answer flipped, so that each epoch expects as many turns about the image's
    colour as about others (here 3 about others, 1 about its own: a chance of 1/3 gives 2 and 2)."""
    root = write_easy_vqa_root(tmp_path, {"train": (BALANCE, 3), "test": (TEST, 2)})
    b = builder(root, task="conversation", val_images=1, colour_questions=mode,
                processors={"text_processor": {"params": {"max_length": 96}}})
    train, proc = b.build("train"), b.text_processor
    seen = []
    for epoch in range(300):
        train.set_epoch(epoch)
        text = words(proc, train[0]["input_ids"])
        seen.append([q in text for q in ("is there a red shape ? yes", "is there not a red shape ? no",
                                         "does the image contain a red shape ? yes")])
        assert ("is there a blue shape ? no" in text) != seen[-1][0]  # the turn is asked one way or the other
        assert ("what color is the shape ? red" in text)  # open turns stay as asked
        train.set_epoch(epoch)
        assert words(proc, train[0]["input_ids"]) == text  # the same draw for the same epoch
        assert "is there a teal shape ? yes" in words(proc, train[1]["input_ids"])
    recoloured = np.asarray(seen).mean(0)
    if mode == "as_asked":
        assert recoloured.tolist() == [0.0, 0.0, 0.0]
    else:
        assert train.recolour_chance == pytest.approx(1 / 3)
        assert np.all((recoloured > 0.25) & (recoloured < 0.42)), recoloured  # 300 draws each at 1/3


def test_colour_questions_refuses_an_unknown_value_or_a_task_it_does_not_change(tmp_path):
    with pytest.raises(UserError, match="colour_questions='even'; use one of as_asked, balanced"):
        builder(write_root(tmp_path), task="conversation", colour_questions="even")
    with pytest.raises(UserError, match="colour_questions=balanced .* task='vqa'; set task=conversation"):
        builder(write_root(tmp_path / "other"), task="vqa", colour_questions="balanced")
