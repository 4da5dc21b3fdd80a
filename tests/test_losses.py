"""Losses against values computed by hand from their definitions."""
import math

import pytest
import torch

from mmvl.errors import UserError
from mmvl.losses import build_losses, compute_losses
from mmvl.losses import ContrastiveLoss
from mmvl.registry import LOSSES
from tests.fixtures.copies import CopyCounter
from tests.fixtures.syncs import SyncCounter


def _loss(name, **params):
    return LOSSES.get(name)(**params)


def test_cross_entropy_matches_hand_value():
    scores = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]])
    targets = torch.tensor([0, 1])
    # -log softmax: row0 class0, row1 class1
    row0 = -(2.0 - math.log(math.exp(2) + 2))
    row1 = -(1.0 - math.log(1 + math.e + math.exp(3)))
    got = _loss("cross_entropy")({"targets": targets}, {"scores": scores})
    assert got.dim() == 0
    assert got.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)


def test_cross_entropy_ignore_index_and_float_targets():
    scores = torch.tensor([[2.0, 0.0], [0.0, 5.0]])
    got = _loss("cross_entropy", ignore_index=-1)({"targets": torch.tensor([0, -1])}, {"scores": scores})
    assert got.item() == pytest.approx(-(2.0 - math.log(math.exp(2) + 1)), rel=1e-6)
    with pytest.raises(UserError, match="soft_label_cross_entropy"):
        _loss("cross_entropy")({"targets": torch.rand(2, 2)}, {"scores": scores})


def test_logit_bce_is_mean_times_num_classes():
    scores = torch.tensor([[0.0, 2.0, -1.0]])
    targets = torch.tensor([[1.0, 0.3, 0.0]])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    per_elem = [
        -(1.0 * math.log(sig(0.0))),
        -(0.3 * math.log(sig(2.0)) + 0.7 * math.log(1 - sig(2.0))),
        -(math.log(1 - sig(-1.0))),
    ]
    got = _loss("logit_bce")({"targets": targets}, {"scores": scores})
    assert got.item() == pytest.approx(sum(per_elem), rel=1e-6)  # mean * 3 == per-sample sum


def test_logit_bce_shape_mismatch_is_user_error():
    with pytest.raises(UserError, match="logit_bce"):
        _loss("logit_bce")({"targets": torch.tensor([1, 0])}, {"scores": torch.zeros(2, 3)})


def test_soft_label_cross_entropy_normalises_and_skips_empty_rows():
    scores = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 1.0, 2.0]])
    targets = torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    lse0 = math.log(math.e + 2)
    row0 = -(0.5 * (1.0 - lse0) + 0.5 * (0.0 - lse0))
    lse2 = math.log(math.exp(3) + math.e + math.exp(2))
    row2 = -(2.0 - lse2)
    got = _loss("soft_label_cross_entropy")({"targets": targets}, {"scores": scores})
    assert got.item() == pytest.approx((row0 + row2) / 2, rel=1e-6)  # zero row neither adds nor counts


def test_soft_label_cross_entropy_index_targets_equal_cross_entropy():
    scores = torch.randn(4, 5)
    targets = torch.tensor([0, 3, -100, 2])
    soft = _loss("soft_label_cross_entropy")({"targets": targets}, {"scores": scores})
    hard = _loss("cross_entropy")({"targets": targets}, {"scores": scores})
    assert soft.item() == pytest.approx(hard.item(), rel=1e-5)


def test_cross_entropy_class_weight_is_copied_once_per_device_and_dtype():
    """The weight reaches the scores' device and dtype once, not on every update (a blocking copy)."""
    loss = _loss("cross_entropy", weight=[1.0, 3.0, 0.5])
    targets = torch.tensor([0, 1, 2, 1])
    scores = torch.randn(4, 3)
    with CopyCounter() as copies:
        values = [loss({"targets": targets}, {"scores": scores}) for _ in range(3)]
    assert len(copies.calls) == 1, copies.calls  # the first call only
    want = torch.nn.functional.cross_entropy(scores, targets, weight=torch.tensor([1.0, 3.0, 0.5]))
    assert all(torch.equal(v, want) for v in values)
    with CopyCounter() as copies:
        half = loss({"targets": targets}, {"scores": scores.double()})
        loss({"targets": targets}, {"scores": scores.double()})
    assert len(copies.calls) == 1 and half.dtype == torch.float64  # a new dtype: one more copy, kept
    assert half.item() == pytest.approx(want.item(), rel=1e-6)


def test_soft_label_cross_entropy_index_targets_read_nothing_back():
    """1-D targets with ignored rows: no boolean-mask indexing (it sizes its output by the values)."""
    scores = torch.randn(5, 4, requires_grad=True)
    targets = torch.tensor([1, -100, 3, 0, -100])
    with SyncCounter() as syncs:
        value = _loss("soft_label_cross_entropy")({"targets": targets}, {"scores": scores})
        value.backward()
    assert syncs.calls == []
    assert value.item() == pytest.approx(torch.nn.functional.cross_entropy(scores, targets).item(), rel=1e-6)


def test_build_losses_names_deduplicated_and_bad_params():
    built = build_losses([{"type": "cross_entropy"}, "logit_bce",
                          {"type": "cross_entropy", "params": {"label_smoothing": 0.1}}])
    assert [n for n, _ in built] == ["cross_entropy", "logit_bce", "cross_entropy_1"]
    assert built[2][1].label_smoothing == 0.1
    with pytest.raises(UserError, match="label_smothing"):
        build_losses([{"type": "cross_entropy", "params": {"label_smothing": 0.1}}])
    with pytest.raises(UserError, match="cross_entropy"):
        build_losses([{"type": "cross_entropyy"}])


def test_build_losses_accepts_omegaconf():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"losses": [{"type": "cross_entropy", "params": {"weight": [1.0, 2.0]}}]})
    (name, loss), = build_losses(cfg.losses)
    assert name == "cross_entropy" and loss.weight.tolist() == [1.0, 2.0]


def test_compute_losses_merges_model_losses():
    losses = build_losses(["cross_entropy"])
    batch = {"targets": torch.tensor([1])}
    output = {"scores": torch.tensor([[0.0, 0.0]]), "losses": {"contrastive": torch.tensor([0.5])}}
    got = compute_losses(losses, batch, output)
    assert set(got) == {"contrastive", "cross_entropy"}
    assert got["contrastive"].dim() == 0 and got["contrastive"].item() == 0.5
    assert got["cross_entropy"].item() == pytest.approx(math.log(2))
    output["losses"] = {"cross_entropy": torch.tensor(1.0)}
    with pytest.raises(UserError, match="both"):
        compute_losses(losses, batch, output)
    assert set(compute_losses([], batch, {"scores": output["scores"], "losses": {"x": torch.tensor(1.0)}})) == {"x"}


def test_missing_keys_are_user_errors():
    with pytest.raises(UserError, match="targets"):
        _loss("cross_entropy")({}, {"scores": torch.zeros(1, 2)})
    with pytest.raises(UserError, match="scores"):
        _loss("cross_entropy")({"targets": torch.tensor([0])}, {})


# -- every registered loss ---------------------------------------------------------------------------
# One case per registered loss: (params, targets, scores that predict the targets, scores that do not).
# A loss registered without a case fails test_every_registered_loss: add one here.
_T = torch.tensor
LOSS_CASES = {
    "cross_entropy": ({}, _T([0, 2, 1]), 4.0 * torch.eye(3)[[0, 2, 1]], 4.0 * torch.eye(3)[[1, 0, 2]]),
    "logit_bce": ({}, _T([[1.0, 0.0, 0.3], [0.0, 1.0, 0.0]]), _T([[4.0, -4.0, -1.0], [-4.0, 4.0, -4.0]]),
                  _T([[-4.0, 4.0, 1.0], [4.0, -4.0, 4.0]])),
    "soft_label_cross_entropy": ({}, _T([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), _T([[3.0, -3.0, 3.0], [-3.0, 3.0, -3.0]]),
                                 _T([[-3.0, 3.0, -3.0], [3.0, -3.0, 3.0]])),
    # token targets (B x L, -100 not labelled) and next-token logits (B x L x V): position t predicts t + 1
    "answer_tokens": ({}, _T([[-100, 2, 0], [-100, -100, 1]]), 4.0 * torch.eye(3)[_T([[2, 0, 1], [0, 1, 2]])],
                      4.0 * torch.eye(3)[_T([[0, 1, 1], [0, 2, 2]])]),
}


@pytest.mark.parametrize("name", [n for n in LOSSES.names() if LOSSES.get(n).__module__.startswith("mmvl.")
                                  and not issubclass(LOSSES.get(n), ContrastiveLoss)])  # those: test_contrastive_losses
def test_every_registered_loss(name):
    assert name in LOSS_CASES, f"loss {name!r} is registered but has no case in tests/test_losses.py LOSS_CASES"
    params, targets, good, bad = LOSS_CASES[name]
    (built_name, loss), = build_losses([{"type": name, "params": params}])
    assert built_name == name
    batch = {"targets": targets}
    low, high = loss(batch, {"scores": good}), loss(batch, {"scores": bad})
    assert low.dim() == 0 and torch.isfinite(low) and torch.isfinite(high)
    assert 0 <= low < high, (float(low), float(high))
    # averaged over the batch: the same samples twice give the same value
    twice = loss({"targets": torch.cat([targets, targets])}, {"scores": torch.cat([good, good])})
    assert float(twice) == pytest.approx(float(low), rel=1e-5)
    # differentiable, and a small step against the gradient lowers it
    scores = bad.clone().requires_grad_(True)
    value = loss(batch, {"scores": scores})
    value.backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0
    assert loss(batch, {"scores": (scores - 0.1 * scores.grad).detach()}) < value
    with pytest.raises(UserError, match=name):
        loss({}, {"scores": good})
    with pytest.raises(UserError, match=name):
        loss(batch, {})


def test_every_loss_case_is_registered():
    assert set(LOSS_CASES) <= set(LOSSES.names()), sorted(set(LOSS_CASES) - set(LOSSES.names()))
