"""Metrics against hand-computed values on small whole-set inputs."""
import itertools
import math

import pytest
import torch

from mmvl.errors import UserError
from mmvl.metrics import binary_roc_auc, build_metrics, concat_for_metrics
from mmvl.metrics.generation import caption_scores
from mmvl.registry import METRICS
from tests.fixtures.metric_reference import full_matrix_metric


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


# -- streaming equals the whole-set (full-matrix) computation mmvl used before -------------------
def _cases(seed):
    g = torch.Generator().manual_seed(seed)
    n = 257
    soft = (torch.randint(0, 4, (n, 9), generator=g) / 3.0).clamp(max=1.0)
    ties = torch.randint(0, 6, (n, 40), generator=g).float()  # many tied scores: ranks must agree exactly
    groups = torch.randint(0, 3, (n,), generator=g)
    return [
        ("accuracy", {}, torch.randint(0, 5, (n,), generator=g), torch.randn(n, 5, generator=g)),
        ("accuracy", {"group_key": "grp", "groups": groups.tolist()}, soft, torch.randn(n, 9, generator=g)),
        ("vqa_accuracy", {}, soft, torch.randn(n, 9, generator=g)),
        ("binary_f1", {}, torch.randint(0, 2, (n,), generator=g), torch.randn(n, 2, generator=g)),
        ("binary_f1", {}, torch.randint(0, 2, (n,), generator=g), torch.randn(n, generator=g)),
        ("macro_f1", {}, torch.randint(0, 6, (n,), generator=g), torch.randn(n, 5, generator=g)),
        ("roc_auc", {}, torch.randint(0, 2, (n,), generator=g), torch.randint(0, 9, (n, 2), generator=g).float()),
        ("roc_auc", {}, torch.randint(0, 2, (n,), generator=g), torch.randn(n, generator=g)),
        ("recall@k", {"k": [1, 3, 5]}, torch.randint(0, 40, (n,), generator=g), ties),
    ]


@pytest.mark.parametrize("batch", [1, 16, 100, 257])
@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_equals_full_matrix_reference(batch, seed):
    """Every registered metric, fed in batches, gives exactly the whole-set full-matrix result."""
    covered = set()
    for name, params, targets, scores in _cases(seed):
        covered.add(name)
        kwargs = {"k": params["k"], "i2t": True} if name == "recall@k" else \
            {"group_key": "grp"} if "group_key" in params else {}
        m = _metric(name, **kwargs)
        m.reset()
        for start in range(0, len(scores), batch):
            b = {"targets": targets[start:start + batch]}
            if "groups" in params:
                b["grp"] = torch.tensor(params["groups"][start:start + batch])
            m.update(b, {"scores": scores[start:start + batch]})
        m.sync()  # world size 1: a no-op
        got = m.compute()
        expected = full_matrix_metric(name, params, targets, scores)
        assert got == expected, name  # exact, not approximate
        assert set(got) == set(m({"targets": targets, **({"grp": torch.tensor(params["groups"])}
                                                         if "groups" in params else {})}, {"scores": scores}))
    # the others: tests/metrics/test_two_tower.py (encoders) and tests/metrics/test_generation.py (decoded text)
    assert covered == {n for n in METRICS.names() if not _encodes(n) and not METRICS.get(n).generates}


def test_streaming_state_is_per_sample_at_most():
    """No metric keeps a samples x classes matrix: the state grows by at most one value per sample."""
    n, classes = 400, 300
    g = torch.Generator().manual_seed(0)
    soft = (torch.randint(0, 4, (n, classes), generator=g) / 3.0).clamp(max=1.0)
    m = _metric("vqa_accuracy")
    m.reset()
    for start in range(0, n, 50):
        m.update({"targets": soft[start:start + 50]}, {"scores": torch.randn(50, classes, generator=g)})
    kept = sum(v.numel() for part in m._state.values() for v in (part[1] if isinstance(part[1], list) else [part[1]]))
    assert kept == n
    r = _metric("recall@k", k=[1, 5], i2t=True)
    r.reset()
    for start in range(0, n, 50):
        r.update({"targets": torch.randint(0, classes, (50,), generator=g)},
                 {"scores": torch.randn(50, classes, generator=g)})
    kept = sum(part[1].numel() for part in r._state.values())
    assert kept == 2 + 1 + (6 + 2) * classes  # hits per k, gallery size; per image: top-6, best own, caption count


def test_metric_written_for_the_whole_set_still_works():
    """A user metric of the earlier contract (only compute_metric) is fed the whole split once."""
    class Median(METRICS.get("accuracy").__mro__[1]):  # mmvl.metrics.Metric
        name = "median_score"

        def compute_metric(self, batch, output):
            assert len(output["scores"]) == 7 and batch["targets"].tolist() == list(range(7))
            return {"median_score": output["scores"].median().item()}

    m = Median()
    m.reset()
    m.update({"targets": torch.arange(3)}, {"scores": torch.tensor([5.0, 1.0, 2.0])})
    m.update({"targets": torch.arange(3, 7)}, {"scores": torch.tensor([7.0, 3.0, 4.0, 6.0])})
    assert m.compute() == {"median_score": 4.0}
    with pytest.raises(UserError, match="0 samples"):
        Median().compute()


def test_earlier_call_style_and_empty_metrics():
    """A subclass overriding __call__ (whole set) still works; one implementing nothing is a UserError."""
    class Mean(METRICS.get("accuracy").__mro__[1]):
        name = "mean_score"

        def __call__(self, batch, output):
            return {"mean_score": output["scores"].mean().item()}

    m = Mean()
    m.reset()
    m.update({"targets": torch.zeros(2)}, {"scores": torch.tensor([1.0, 2.0])})
    m.update({"targets": torch.zeros(1)}, {"scores": torch.tensor([6.0])})
    assert m.compute() == {"mean_score": 3.0}

    class Nothing(METRICS.get("accuracy").__mro__[1]):
        name = "nothing"

    n = Nothing()
    n.update({"targets": torch.zeros(1)}, {"scores": torch.zeros(1)})
    with pytest.raises(UserError, match="implements neither"):
        n.compute()

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
# metrics of generated text read output["generated"] (one text a sample) against batch["answer"]
_CAPTIONS = ["a red circle on gray", "two blue squares", "a green triangle", "one yellow circle",
             "a black rectangle here", "three teal dots"]
_OTHER = ["zebra", "piano keys", "violet sky", "old boat", "cold tea", "wet sand"]
_BY_INDEX = dict(enumerate(_CAPTIONS)), {i: [c] for i, c in enumerate(_CAPTIONS)}
for _name in ("cider", "bleu4", "rouge_l"):
    METRIC_CASES[_name] = ({}, {"answer": _CAPTIONS}, _CAPTIONS, _OTHER, caption_scores(*_BY_INDEX)[_name], 0.0)
METRIC_CASES["generated_vqa_accuracy"] = ({}, {"answer": ["yes", "2", "red", "no", "circle", "the box"]},
                                          ["yes", "two", "Red.", "no", "a circle", "box"], ["no"] * 6, 1.0, 1 / 6)


def _encodes(name: str) -> bool:
    """Two-tower metrics score through the model's encoders, not ``scores`` (tests/metrics/test_two_tower.py)."""
    return bool(getattr(METRICS.get(name), "uses_model", False))


@pytest.mark.parametrize("name", [n for n in METRICS.names()
                                  if METRICS.get(n).__module__.startswith("mmvl.") and not _encodes(n)])
def test_every_registered_metric(name):
    assert name in METRIC_CASES, f"metric {name!r} is registered but has no case in tests/test_metrics.py METRIC_CASES"
    params, batch, perfect, wrong, best, worst = METRIC_CASES[name]
    metric, = build_metrics([{"type": name, "params": params}])
    out = metric.output_keys[0]  # scores, or generated text
    good, bad = metric(batch, {out: perfect}), metric(batch, {out: wrong})
    key = next(iter(good))
    assert key.startswith(name.split("@")[0]) and all(isinstance(v, float) for v in good.values())
    assert good[key] == pytest.approx(best) and bad[key] == pytest.approx(worst, abs=1e-6)  # BLEU smooths a 0
    # streaming over two parts gives the whole-set value
    metric.reset()
    for part in (slice(0, 2), slice(2, None)):
        metric.update({k: v[part] for k, v in batch.items()}, {out: perfect[part]})
    assert metric.compute() == pytest.approx(good)
    with pytest.raises(UserError, match=name):
        metric({}, {"scores": perfect})


def test_every_metric_case_is_registered():
    assert set(METRIC_CASES) <= set(METRICS.names()), sorted(set(METRIC_CASES) - set(METRICS.names()))
