"""Two-tower evaluation: blocked retrieval equals the full similarity matrix (recall@k's brute force),
zero-shot equals the classifier computed by hand, at world 1 and on 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

from mmvl.data.sample import collate
from mmvl.errors import UserError
from mmvl.metrics import build_metrics
from mmvl.metrics.retrieval import RecallAtK, gallery_ranks
from mmvl.registry import METRICS
from tests.distributed.dist_launch import launch
from tests.fixtures.two_tower import CLASSNAMES, CharTokens, PairData, TinyTwoTower

KS = [1, 2, 5]


def brute_force_retrieval(model, data) -> dict:
    """recall@k (the existing full-matrix metric) on the whole [captions, unique images] score matrix."""
    batch = collate([data[i] for i in range(len(data))])
    with torch.no_grad():
        text = model.encode_text(batch["input_ids"], batch["attention_mask"])
        ids = batch["image_id"].tolist()
        unique = sorted(set(ids))
        first = [ids.index(u) for u in unique]
        image = model.encode_image(batch["image"][first])
    targets = torch.tensor([unique.index(i) for i in ids])
    full = RecallAtK(k=KS, i2t=True)({"targets": targets}, {"scores": text @ image.T})
    out = {**{f"t2i_recall@{k}": full[f"recall@{k}"] for k in KS}, **{f"i2t_recall@{k}": full[f"recall@{k}/i2t"]
                                                                      for k in KS}}
    return {**out, "mean_recall": mean_of(out)}


def mean_of(values: dict) -> float:
    return torch.tensor(list(values.values()), dtype=torch.float64).mean().item()


def streamed(metric, model, data, indices, batch_size=4) -> dict:
    metric.reset()
    metric.bind(model, lambda: CharTokens())
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            metric.update(collate([data[i] for i in indices[start:start + batch_size]]), {})
        metric.sync()
        return metric.compute()


@pytest.mark.parametrize("block_size", [1, 3, 1000])
def test_retrieval_in_blocks_equals_the_full_matrix(block_size):
    model, data = TinyTwoTower(), PairData(21, seed=1)
    metric = build_metrics([{"type": "retrieval", "params": {"k": KS, "image_id_key": "image_id",
                                                             "block_size": block_size}}])[0]
    got = streamed(metric, model, data, list(range(len(data))))
    assert got == brute_force_retrieval(model, data)
    assert 0 < got["t2i_recall@1"] < got["t2i_recall@5"] <= 1  # not a trivial score
    assert len(metric.state("image")) == 11  # each image encoded once, not once per caption


def test_gallery_ranks_counts_ties_against_the_match_and_caps_at_depth():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    ranks = gallery_ranks(q, torch.tensor([0, 7]), g, torch.tensor([0, 1, 2, 3]), depth=2, block_size=1)
    assert ranks.tolist() == [1, 2]  # query 0: a tie with a negative; query 1 has no positive (capped)


def test_pairs_without_image_ids_are_their_own_images():
    model, data = TinyTwoTower(), PairData(8, seed=3)
    metric = build_metrics([{"type": "retrieval", "params": {"k": [1, 8]}}])[0]
    got = streamed(metric, model, data, list(range(8)))
    batch = collate([data[i] for i in range(8)])
    with torch.no_grad():
        scores = model.encode_text(batch["input_ids"], batch["attention_mask"]) @ model.encode_image(batch["image"]).T
    full = RecallAtK(k=[1, 8], i2t=True)({"targets": torch.arange(8)}, {"scores": scores})
    expected = {"t2i_recall@1": full["recall@1"], "t2i_recall@8": 1.0, "i2t_recall@1": full["recall@1/i2t"],
                "i2t_recall@8": 1.0}
    assert got == {**expected, "mean_recall": mean_of(expected)}


def hand_zero_shot(model, data, templates, ks) -> dict:
    tok = CharTokens()
    with torch.no_grad():
        rows = []
        for name in CLASSNAMES:
            t = collate([tok(tpl.replace("{}", name)) for tpl in templates])
            e = model.encode_text(t["input_ids"], t["attention_mask"])
            rows.append(torch.nn.functional.normalize(torch.nn.functional.normalize(e, dim=-1).mean(0), dim=0))
        batch = collate([data[i] for i in range(len(data))])
        logits = model.encode_image(batch["image"]) @ torch.stack(rows).T
    top = logits.topk(max(ks), dim=1).indices
    return {f"zero_shot_top{k}": (top[:, :k] == batch["targets"][:, None]).any(1).float().mean().item() for k in ks}


TEMPLATES = ["a photo of a {}.", "{}", "the {} one"]


def zero_shot_metric():
    return build_metrics([{"type": "zero_shot", "params": {"classnames": CLASSNAMES, "templates": TEMPLATES,
                                                           "k": [1, 3]}}])[0]


def test_zero_shot_equals_the_classifier_by_hand(tmp_path):
    model, data = TinyTwoTower(), PairData(21, seed=1)
    assert streamed(zero_shot_metric(), model, data, list(range(21))) == hand_zero_shot(model, data, TEMPLATES, [1, 3])
    names = tmp_path / "classes.txt"
    names.write_text("\n".join(CLASSNAMES) + "\n")
    from_file = build_metrics([{"type": "zero_shot", "params": {"classnames": str(names), "templates": TEMPLATES,
                                                                "k": [1, 3]}}])[0]
    assert streamed(from_file, model, data, list(range(21))) == hand_zero_shot(model, data, TEMPLATES, [1, 3])


def test_zero_shot_user_errors():
    with pytest.raises(UserError, match="exactly one"):
        build_metrics([{"type": "zero_shot", "params": {"classnames": ["a"], "templates": ["no slot"]}}])
    with pytest.raises(UserError, match="neither a list nor a file"):
        build_metrics([{"type": "zero_shot", "params": {"classnames": "/no/such/file.txt"}}])
    with pytest.raises(UserError, match="encode_image"):
        zero_shot_metric().bind(torch.nn.Linear(2, 2), CharTokens)


def _two_ranks(env):
    torch.manual_seed(0)
    model, data = TinyTwoTower(), PairData(21, seed=1)
    rank, world = env.rank, env.world_size
    mine = list(range(rank, len(data), world))  # the evaluation's share: positions r, r + W, ...
    retrieval = build_metrics([{"type": "retrieval", "params": {"k": KS, "image_id_key": "image_id",
                                                                "block_size": 2}}])[0]
    pairs = build_metrics([{"type": "retrieval", "params": {"k": KS, "block_size": 3}}])[0]
    return {"retrieval": streamed(retrieval, model, data, mine, batch_size=3),
            "pairs": streamed(pairs, model, data, mine, batch_size=3),
            "zero_shot": streamed(zero_shot_metric(), model, data, mine, batch_size=3)}


@pytest.mark.proc
def test_two_ranks_equal_one_process():
    model, data = TinyTwoTower(), PairData(21, seed=1)
    pairs = build_metrics([{"type": "retrieval", "params": {"k": KS}}])[0]
    expected = {"retrieval": brute_force_retrieval(model, data),
                "pairs": streamed(pairs, model, data, list(range(21))),
                "zero_shot": hand_zero_shot(model, data, TEMPLATES, [1, 3])}
    for result in launch(_two_ranks, world_size=2):
        assert result == expected


class Oracle(torch.nn.Module):
    """Encodes an image as its class (the first pixel holds it) and a text as the class it names;
    ``wrong``: every text as the next class."""

    def __init__(self, wrong: bool = False):
        super().__init__()
        self.shift = int(wrong)
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def encode_image(self, images):
        return torch.nn.functional.one_hot(images[:, 0, 0, 0].long(), 8).float()

    def encode_text(self, input_ids, attention_mask):
        return torch.nn.functional.one_hot((input_ids[:, 0] - 1 + self.shift) % 8, 8).float()


class ClassTokens:
    def __call__(self, text: str) -> dict:
        ids = torch.tensor([1 + CLASSNAMES.index(text.split()[-1])])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


TWO_TOWER_CASES = {
    "zero_shot": {"classnames": CLASSNAMES, "templates": ["{}"], "k": [1]},
    "retrieval": {"k": [1]},
}


@pytest.mark.parametrize("name", [n for n in METRICS.names() if getattr(METRICS.get(n), "uses_model", False)])
def test_every_registered_two_tower_metric(name):
    """A perfect model scores 1 and a wrong one 0, whole or in two parts; missing inputs are a UserError."""
    assert name in TWO_TOWER_CASES, f"two-tower metric {name!r} has no case in TWO_TOWER_CASES"
    labels = torch.tensor([0, 1, 2, 3, 4])
    images = torch.zeros(5, 3, 2, 2)
    images[:, 0, 0, 0] = labels.float()
    batch = {"image": images, "input_ids": (labels + 1)[:, None], "attention_mask": torch.ones(5, 1, dtype=torch.long),
             "targets": labels}
    for wrong, expected in ((False, 1.0), (True, 0.0)):
        metric, = build_metrics([{"type": name, "params": TWO_TOWER_CASES[name]}])
        metric.bind(Oracle(wrong), ClassTokens)
        whole = metric(batch, {})
        assert all(isinstance(v, float) for v in whole.values()) and set(whole.values()) == {expected}
        metric.reset()
        for part in (slice(0, 2), slice(2, None)):
            metric.update({k: v[part] for k, v in batch.items()}, {})
        assert metric.compute() == whole
    with pytest.raises(UserError, match=name):
        metric({"targets": labels}, {})
