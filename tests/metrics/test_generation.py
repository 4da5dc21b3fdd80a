"""The registered metrics of generated text: several references a sample, per-group VQA accuracy,
and names known before evaluating (what early_stop.criteria is checked against at start)."""
from __future__ import annotations

import pytest

from mmvl.errors import UserError
from mmvl.metrics import build_metrics
from mmvl.metrics.generation import caption_scores, vqa_accuracy


def _fed(name: str, params: dict, batches: list[tuple[dict, list[str]]]) -> dict[str, float]:
    metric, = build_metrics([{"type": name, "params": params}])
    metric.reset()
    for batch, texts in batches:
        metric.update(batch, {"generated": texts})
    metric.sync()
    return metric.compute()


def test_several_references_a_sample_score_as_the_whole_set_functions_do():
    refs = [["a red circle", "the red circle"], ["two blue squares", "blue squares"], ["a dog"]]
    texts = ["a red circle", "blue squares", "a cat"]
    parts = [({"answer": refs[:2]}, texts[:2]), ({"answer": refs[2:]}, texts[2:])]
    expected = caption_scores(dict(enumerate(texts)), dict(enumerate(refs)))
    for name in ("cider", "bleu4", "rouge_l"):
        assert _fed(name, {}, parts) == pytest.approx({name: expected[name]})
    vqa_refs = [["2", "two", "2"], ["no"], ["yes"]]
    got = _fed("generated_vqa_accuracy", {}, [({"answer": vqa_refs}, ["two", "no", "no"])])
    assert got == pytest.approx({"generated_vqa_accuracy": vqa_accuracy(dict(enumerate(["two", "no", "no"])),
                                                                      dict(enumerate(vqa_refs)))})


def test_generated_vqa_accuracy_per_group():
    params = {"group_key": "question_type", "group_names": ["yes_no", "shape", "color"]}
    batches = [({"answer": ["yes", "red"], "question_type": [0, 2]}, ["yes", "blue"]),
               ({"answer": ["circle", "no"], "question_type": [1, 0]}, ["circle", "yes"])]
    assert _fed("generated_vqa_accuracy", params, batches) == pytest.approx({
        "generated_vqa_accuracy": 0.5, "generated_vqa_accuracy/yes_no": 0.5, "generated_vqa_accuracy/shape": 1.0,
        "generated_vqa_accuracy/color": 0.0})
    metric, = build_metrics([{"type": "generated_vqa_accuracy", "params": params}])
    assert metric.result_names() == ("generated_vqa_accuracy", "generated_vqa_accuracy/yes_no",
                                     "generated_vqa_accuracy/shape", "generated_vqa_accuracy/color")
    unnamed, = build_metrics([{"type": "generated_vqa_accuracy", "params": {"group_key": "question_type"}}])
    assert unnamed.result_names() is None  # its groups are known only once seen


def test_a_model_that_wrote_nothing_is_named():
    metric, = build_metrics(["cider"])
    with pytest.raises(UserError, match="metric 'cider' scores generated text and the model wrote none"):
        metric.update({"answer": ["a"]}, {"scores": [0.0]})
