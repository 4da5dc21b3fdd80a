"""vocab, vqa_answer and torchvision_transforms processors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmvl.data.processors.answers import VQAAnswerProcessor, normalize_answer, soft_scores
from mmvl.data.processors.image import TorchvisionTransforms
from mmvl.data.processors.vocab import SPECIAL_TOKENS, VocabProcessor, tokenize
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS


def test_registered():
    assert PROCESSORS.get("vocab") is VocabProcessor
    assert PROCESSORS.get("vqa_answer") is VQAAnswerProcessor
    assert PROCESSORS.get("torchvision_transforms") is TorchvisionTransforms


# -- vocab -------------------------------------------------------------------------------------
def test_vocab_from_texts_ids_and_truncation():
    texts = ["Is it red?", "is it blue", "what is it"]
    proc = VocabProcessor(texts=texts, max_seq_length=5)
    assert tokenize("Is it red?") == ["is", "it", "red", "?"]
    # specials first, then by frequency (is, it: 3), ties alphabetical
    assert proc.itos == SPECIAL_TOKENS + ["is", "it", "?", "blue", "red", "what"]
    out = proc("It is GREEN")
    cls, sep, unk = proc.stoi["[CLS]"], proc.stoi["[SEP]"], proc.stoi["[UNK]"]
    assert out["input_ids"].tolist() == [cls, proc.stoi["it"], proc.stoi["is"], unk, sep]
    assert out["attention_mask"].tolist() == [1] * 5 and out["token_type_ids"].tolist() == [0] * 5
    long = proc("is it red ? is it")["input_ids"].tolist()
    assert len(long) == 5 and long[0] == cls and long[-1] == sep  # truncation keeps [CLS] and [SEP]
    assert VocabProcessor(texts=texts, min_count=2).itos == SPECIAL_TOKENS + ["is", "it"]
    assert VocabProcessor(texts=texts, max_size=7).vocab_size == 7


def test_vocab_file_round_trip_and_errors(tmp_path):
    proc = VocabProcessor(texts=["a b c", "b c"])
    loaded = VocabProcessor(vocab_file=str(proc.save(tmp_path / "vocab.txt")))
    assert loaded.itos == proc.itos and torch.equal(loaded("c a z")["input_ids"], proc("c a z")["input_ids"])
    with pytest.raises(UserError, match="missing.txt"):
        VocabProcessor(vocab_file=str(tmp_path / "missing.txt"))
    (tmp_path / "bad.txt").write_text("a\nb\n")
    with pytest.raises(UserError, match=r"bad.txt.*\[PAD\]"):
        VocabProcessor(vocab_file=str(tmp_path / "bad.txt"))
    (tmp_path / "dup.txt").write_text("[PAD]\n[UNK]\na\na\n")
    with pytest.raises(UserError, match="'a' more than once"):
        VocabProcessor(vocab_file=str(tmp_path / "dup.txt"))
    with pytest.raises(UserError, match="vocab_file"):
        VocabProcessor()
    with pytest.raises(UserError, match="max_seq_length"):
        VocabProcessor(texts=["a"], max_seq_length=2)


# -- vqa_answer --------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, normal", [
    (" Yes. ", "yes"), ("2,000", "2000"), ("3.5", "3.5"), ("t-shirt", "t shirt"), ("Red!", "red"),
    ("don't know", "don't know"), ("(a) dog?", "a dog"), ("", ""),
])
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_soft_scores_by_hand():
    answers = ["Red", "red.", "red", "red", "blue", "blue", "green", "no", "No", "yes"]
    assert soft_scores(answers) == pytest.approx({"red": 1.0, "blue": 2 / 3, "green": 1 / 3, "no": 2 / 3,
                                                  "yes": 1 / 3})


def test_answer_vocabulary_top_k_and_targets(tmp_path):
    train = [["yes"] * 10, ["no"] * 6 + ["yes"] * 4, ["two"] * 3 + ["2"] * 7, ["cat"]]
    proc = VQAAnswerProcessor(answers=train, top_k=3)
    assert proc.vocab == ["yes", "2", "no"]  # 14, 7, 6; 'two' (3) and 'cat' (1) cut by top_k
    targets = proc(["yes", "yes", "no", "two", "two", "two", "two", "cat", "no", "no"])["targets"]
    torch.testing.assert_close(targets, torch.tensor([2 / 3, 0.0, 1.0]))
    assert proc.answer(1) == "2" and proc.num_answers == 3
    assert VQAAnswerProcessor(answers=train, top_k=None, min_count=3).vocab == ["yes", "2", "no", "two"]
    again = VQAAnswerProcessor(vocab_file=str(proc.save(tmp_path / "answers.txt")))
    assert again.vocab == proc.vocab
    with pytest.raises(UserError, match="nope.txt"):
        VQAAnswerProcessor(vocab_file=str(tmp_path / "nope.txt"))
    with pytest.raises(UserError, match="top_k"):
        VQAAnswerProcessor(answers=train, top_k=0)
    with pytest.raises(UserError, match="empty"):
        VQAAnswerProcessor(answers=train, min_count=100)
    with pytest.raises(UserError, match="vocab_file"):
        VQAAnswerProcessor()


# -- torchvision_transforms --------------------------------------------------------------------
def image(w: int = 40, h: int = 30) -> Image.Image:
    pixels = np.zeros((h, w, 3), dtype=np.uint8)
    pixels[:, : w // 2] = (255, 0, 0)
    return Image.fromarray(pixels)


def test_pipeline_resize_scale_normalise():
    proc = TorchvisionTransforms(transforms=[
        {"type": "Resize", "params": {"size": [16, 24], "interpolation": "nearest"}}, "ToImage",
        {"type": "ToDtype", "params": {"dtype": "float32", "scale": True}},
        {"type": "Normalize", "params": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}}])
    out = proc(image())
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == (3, 16, 24)
    assert out[0, 0, 0].item() == 1.0 and out[1, 0, 0].item() == -1.0 and out[0, 0, -1].item() == -1.0
    # no transforms, or a PIL result: float in [0, 1]
    plain = TorchvisionTransforms()(image())
    assert plain.shape == (3, 30, 40) and plain.max().item() == 1.0 and plain.min().item() == 0.0
    assert TorchvisionTransforms(transforms=["ToImage"])(image()).dtype == torch.float32


def test_nested_transforms_and_determinism():
    spec = [{"type": "RandomApply", "params": {"transforms": [{"type": "RandomHorizontalFlip", "params": {"p": 1.0}}],
                                                "p": 1.0}}]
    flipped = TorchvisionTransforms(transforms=spec)(image())
    assert flipped[0, 0, -1].item() == 1.0 and flipped[0, 0, 0].item() == 0.0


def test_transform_errors():
    with pytest.raises(UserError, match="unknown transform 'Resise'.*'Resize'"):
        TorchvisionTransforms(transforms=[{"type": "Resise", "params": {"size": 8}}])
    with pytest.raises(UserError, match="unknown transform 'Lambda'"):
        TorchvisionTransforms(transforms=["Lambda"])
    with pytest.raises(UserError, match="dtype 'float99'"):
        TorchvisionTransforms(transforms=[{"type": "ToDtype", "params": {"dtype": "float99"}}])
    with pytest.raises(UserError, match="interpolation 'bilinearr'.*'bilinear'"):
        TorchvisionTransforms(transforms=[{"type": "Resize", "params": {"size": 8, "interpolation": "bilinearr"}}])
    with pytest.raises(UserError, match="Resize"):
        TorchvisionTransforms(transforms=[{"type": "Resize", "params": {"sise": 8}}])
    with pytest.raises(UserError, match="unknown keys"):
        TorchvisionTransforms(transforms=[{"type": "Resize", "size": 8}])
