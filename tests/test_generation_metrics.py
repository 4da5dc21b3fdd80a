"""Scores of generated text: the official VQA answer normalisation and accuracy, and caption metrics
equal to pycocoevalcap's scorers (called here directly on the same tokens)."""
from __future__ import annotations

import pytest

from mmvl.metrics.generation import caption_scores, normalize_vqa, vqa_accuracy


def test_official_vqa_normalisation_and_accuracy():
    assert normalize_vqa("Two dogs.") == "2 dogs"
    assert normalize_vqa("The Circle!") == "circle"
    refs = {1: ["2"] * 3 + ["3"] * 7, 2: ["yes", "no", "no"], 3: ["circle"]}
    assert vqa_accuracy({1: "two", 2: "Yes", 3: "a circle"}, refs) == pytest.approx((1.0 + 1 / 3 + 1.0) / 3)
    assert vqa_accuracy({3: "square"}, refs) == 0.0


def test_caption_scores_are_pycocoevalcaps():
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    cands = {1: "A red square.", 2: "a blue circle", 3: "two green circles"}
    refs = {1: ["a red square", "red square ."], 2: ["a green circle"], 3: ["2 green circles", "green circles"]}
    got = caption_scores(cands, refs)
    res = {1: ["a red square ."], 2: ["a blue circle"], 3: ["two green circles"]}
    gts = {1: ["a red square", "red square ."], 2: ["a green circle"], 3: ["2 green circles", "green circles"]}
    assert got["cider"] == pytest.approx(Cider().compute_score(gts, res)[0])
    assert got["bleu4"] == pytest.approx(Bleu(4).compute_score(gts, res, verbose=0)[0][3])
    assert got["rouge_l"] == pytest.approx(Rouge().compute_score(gts, res)[0])
    perfect = caption_scores({k: v[0] for k, v in refs.items()}, refs)
    assert perfect["cider"] > got["cider"] and perfect["rouge_l"] == pytest.approx(1.0)
