"""Metrics against hand-computed values on small whole-set inputs."""
import itertools
import math

import pytest
import torch

from mmvl.errors import UserError
from mmvl.metrics import binary_roc_auc, build_metrics, concat_for_metrics
from mmvl.registry import METRICS


def _metric(name, **params):
    return METRICS.get(name)(**params)


def test_accuracy_index_and_soft_targets():
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    idx = torch.tensor([0, 1, 1, 0])
    assert _metric("accuracy")({"targets": idx}, {"scores": scores}) == {"accuracy": 0.5}
    soft = torch.tensor([[1.0, 0.0], [0.3, 0.6], [0.0, 1.0], [0.9, 0.3]])  # argmax = [0, 1, 1, 0]
    assert _metric("accuracy")({"targets": soft}, {"scores": scores})["accuracy"] == 0.5


def test_grouped_accuracy_with_int_and_string_groups():
    scores = torch.tensor([[1.0, 0.0]] * 5)  # always predicts 0
    targets = torch.tensor([0, 1, 0, 0, 1])
    families = torch.tensor([0, 0, 1, 1, 1])
    m = _metric("accuracy", group_key="question_family", group_names=["non_relational", "relational"])
    assert m.required_keys == ("targets", "question_family")
    got = m({"targets": targets, "question_family": families}, {"scores": scores})
    assert got == pytest.approx({"accuracy": 3 / 5, "accuracy/non_relational": 1 / 2, "accuracy/relational": 2 / 3})
    got = _metric("accuracy", group_key="fam")({"targets": targets, "fam": ["a", "a", "b", "b", "b"]},
                                                {"scores": scores})
    assert got == pytest.approx({"accuracy": 0.6, "accuracy/a": 0.5, "accuracy/b": 2 / 3})
    with pytest.raises(UserError, match="group_names"):
        m({"targets": targets, "question_family": torch.tensor([0, 0, 2, 1, 1])}, {"scores": scores})


def test_vqa_accuracy_uses_soft_score_of_argmax():
    # soft scores min(#humans/3, 1): answer counts (3, 1) -> (1.0, 0.333); (0, 2) -> (0, 0.667)
    targets = torch.tensor([[1.0, 1 / 3, 0.0], [0.0, 2 / 3, 0.0], [0.0, 0.0, 1.0]])
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    got = _metric("vqa_accuracy")({"targets": targets}, {"scores": scores})
    assert got["vqa_accuracy"] == pytest.approx((1 / 3 + 2 / 3 + 0.0) / 3)


def test_binary_f1_and_macro_f1():
    # preds [1, 1, 0, 0, 1], labels [1, 0, 1, 0, 1]: tp=2 fp=1 fn=1 -> f1 = 4/6
    scores = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([1, 0, 1, 0, 1])
    assert _metric("binary_f1")({"targets": labels}, {"scores": scores})["binary_f1"] == pytest.approx(4 / 6)
    logit = torch.tensor([1.0, 2.0, -1.0, -3.0, 0.5])  # one logit per sample, same predictions
    assert _metric("binary_f1")({"targets": labels}, {"scores": logit})["binary_f1"] == pytest.approx(4 / 6)
    # class 0: tp=1 fp=1 fn=1 -> 1/2; so macro = (1/2 + 2/3) / 2
    assert _metric("macro_f1")({"targets": labels}, {"scores": scores})["macro_f1"] == pytest.approx((0.5 + 4 / 6) / 2)
    # 3 classes; class 2 never predicted -> f1 0
    scores3 = torch.eye(3)[[0, 1, 1, 0]]
    labels3 = torch.tensor([0, 1, 2, 0])  # c0: tp2 -> 1; c1: tp1 fp1 -> 2/3; c2: fn1 -> 0
    assert _metric("macro_f1")({"targets": labels3}, {"scores": scores3})["macro_f1"] == pytest.approx((1 + 2 / 3) / 3)


def _pairwise_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_roc_auc_with_ties_matches_pairwise_count():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.randint(0, 5, (40,), generator=gen).float()  # many ties
        labels = torch.randint(0, 2, (40,), generator=gen)
        if labels.unique().numel() < 2:
            continue
        assert binary_roc_auc(scores, labels) == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()))
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4])
    labels = torch.tensor([0, 0, 1, 1, 1])
    # pairs: 0.35>0.1, 0.35<0.4; 0.8>both; 0.4>0.1, 0.4==0.4 -> (1+0+1+1+1+0.5)/6
    got = _metric("roc_auc")({"targets": labels}, {"scores": scores})["roc_auc"]
    assert got == pytest.approx(4.5 / 6)
    two_col = torch.stack([torch.zeros(5), scores], 1)  # softmax[:, 1] is monotone in the logit
    assert _metric("roc_auc")({"targets": labels}, {"scores": two_col})["roc_auc"] == pytest.approx(4.5 / 6)


def test_roc_auc_single_class_is_nan_and_multiclass_rejected():
    got = _metric("roc_auc")({"targets": torch.tensor([1, 1])}, {"scores": torch.tensor([0.1, 0.2])})
    assert math.isnan(got["roc_auc"])
    with pytest.raises(UserError, match="binary"):
        _metric("roc_auc")({"targets": torch.tensor([0, 2])}, {"scores": torch.zeros(2, 3)})


def test_recall_at_k_text_to_image_and_image_to_text():
    # 4 captions x 3 images; caption -> image targets [0, 0, 1, 2]
    scores = torch.tensor([
        [0.9, 0.1, 0.0],  # match rank 0
        [0.1, 0.5, 0.3],  # match (0.1) rank 2
        [0.2, 0.6, 0.7],  # match (0.6) rank 1
        [0.5, 0.5, 0.5],  # tie with all: counted against the match -> rank 2
    ])
    targets = torch.tensor([0, 0, 1, 2])
    got = _metric("recall@k", k=[1, 2], i2t=True)({"targets": targets}, {"scores": scores})
    assert got["recall@1"] == pytest.approx(1 / 4)
    assert got["recall@2"] == pytest.approx(2 / 4)
    # image columns: img0 captions 0,1 -> caption0 scores 0.9 best -> rank 0
    # img1 caption 2 (0.6): others 0.1, 0.5, 0.5 -> rank 0; img2 caption 3 (0.5): 0.0,0.3,0.7 -> rank 1
    assert got["recall@1/i2t"] == pytest.approx(2 / 3)
    assert got["recall@2/i2t"] == pytest.approx(1.0)
    assert set(_metric("recall@k")({"targets": targets}, {"scores": scores})) == {"recall@1", "recall@5", "recall@10"}
    with pytest.raises(UserError, match="image"):
        _metric("recall@k")({"targets": torch.tensor([0, 0, 1, 7])}, {"scores": scores})


def test_concat_and_streaming_match_whole_set():
    b1 = {"targets": torch.tensor([0, 1]), "ids": ["a", "b"], "scalar": torch.tensor(1.0)}
    b2 = {"targets": torch.tensor([1]), "ids": ["c"], "scalar": torch.tensor(2.0)}
    joined = concat_for_metrics([b1, b2])
    assert joined["targets"].tolist() == [0, 1, 1] and joined["ids"] == ["a", "b", "c"]
    assert joined["scalar"].tolist() == [1.0, 2.0]
    m = _metric("binary_f1")
    m.update({"targets": b1["targets"]}, {"scores": torch.tensor([1.0, 1.0])})
    m.update({"targets": b2["targets"]}, {"scores": torch.tensor([-1.0])})
    assert m.compute()["binary_f1"] == pytest.approx(2 / 4)  # tp1 fp1 fn1
    with pytest.raises(UserError, match="lacks"):
        concat_for_metrics([b1, {"targets": b2["targets"]}])


def test_build_metrics_and_user_errors():
    ms = build_metrics(["accuracy", {"type": "recall@k", "params": {"k": [1]}}])
    assert [m.name for m in ms] == ["accuracy", "recall@k"] and ms[1].ks == [1]
    with pytest.raises(UserError, match="vqa_accuracy"):
        build_metrics(["vqa_acuracy"])
    with pytest.raises(UserError, match="group_ky"):
        build_metrics([{"type": "accuracy", "params": {"group_ky": "x"}}])
    with pytest.raises(UserError, match="question_family"):
        _metric("accuracy", group_key="question_family")({"targets": torch.tensor([0])},
                                                         {"scores": torch.zeros(1, 2)})
    with pytest.raises(UserError, match="0 samples"):
        _metric("accuracy")({"targets": torch.zeros(0)}, {"scores": torch.zeros(0, 2)})


# -- every registered metric ---------------------------------------------------------------------------
# One case per registered metric: (params, batch, perfect scores, wrong scores, value of the perfect
# scores, value of the wrong scores) for the metric's first key. A metric registered without a case
# fails test_every_registered_metric: add one here.
_T = torch.tensor
_ROWS = _T([0, 2, 1, 1, 0, 2])
_ONE_HOT = 3.0 * torch.eye(3)[_ROWS]
_WRONG = 3.0 * torch.eye(3)[(_ROWS + 1) % 3]
_BINARY = _T([1, 0, 1, 0, 0, 1])
_SOFT = _T([[1.0, 0.3, 0.0], [0.0, 0.0, 0.6], [0.3, 1.0, 0.0], [0.0, 1.0, 0.3], [0.6, 0.0, 0.0], [0.0, 0.3, 1.0]])
METRIC_CASES = {
    "accuracy": ({}, {"targets": _ROWS}, _ONE_HOT, _WRONG, 1.0, 0.0),
    "vqa_accuracy": ({}, {"targets": _SOFT}, _SOFT * 3, _T([[0.0, 0.0, 1.0]] * 6), 5.2 / 6, 1.9 / 6),
    "binary_f1": ({}, {"targets": _BINARY}, 2.0 * _BINARY - 1, 1 - 2.0 * _BINARY, 1.0, 0.0),
    "macro_f1": ({}, {"targets": _ROWS}, _ONE_HOT, _WRONG, 1.0, 0.0),
    "roc_auc": ({}, {"targets": _BINARY}, _BINARY * 2.0 - 0.5, 1.5 - _BINARY * 2.0, 1.0, 0.0),
    "recall@k": ({"k": [1]}, {"targets": _T([0, 1, 2, 0, 1, 2])}, torch.eye(3)[[0, 1, 2, 0, 1, 2]],
                 torch.eye(3)[[1, 2, 0, 1, 2, 0]], 1.0, 0.0),
}


@pytest.mark.parametrize("name", [n for n in METRICS.names() if METRICS.get(n).__module__.startswith("mmvl.")])
def test_every_registered_metric(name):
    assert name in METRIC_CASES, f"metric {name!r} is registered but has no case in tests/test_metrics.py METRIC_CASES"
    params, batch, perfect, wrong, best, worst = METRIC_CASES[name]
    metric, = build_metrics([{"type": name, "params": params}])
    good, bad = metric(batch, {"scores": perfect}), metric(batch, {"scores": wrong})
    key = next(iter(good))
    assert key.startswith(name.split("@")[0]) and all(isinstance(v, float) for v in good.values())
    assert good[key] == pytest.approx(best) and bad[key] == pytest.approx(worst)
    # streaming over two parts gives the whole-set value
    metric.reset()
    for part in (slice(0, 2), slice(2, None)):
        metric.update({k: v[part] for k, v in batch.items()}, {"scores": perfect[part]})
    assert metric.compute() == pytest.approx(good)
    with pytest.raises(UserError, match=name):
        metric({}, {"scores": perfect})


def test_every_metric_case_is_registered():
    assert set(METRIC_CASES) <= set(METRICS.names()), sorted(set(METRIC_CASES) - set(METRICS.names()))
