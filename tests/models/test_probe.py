"""The linear probe's arithmetic: ridge regression, R^2, the per-object read-out and the hook."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mmvl.errors import UserError
from mmvl.models.probe import collect_outputs, probe_objects, r2_score, ridge_fit, ridge_predict, scene_targets


def test_ridge_recovers_an_exact_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    w, b = torch.randn(5, 3, generator=g), torch.tensor([1.0, -2.0, 0.5])
    weight, bias = ridge_fit(x, x @ w + b, l2=1e-9)
    torch.testing.assert_close(weight.float(), w, atol=1e-5, rtol=0)
    torch.testing.assert_close(bias.float(), b, atol=1e-5, rtol=0)
    torch.testing.assert_close(r2_score(ridge_predict(x, weight, bias), x @ w + b), torch.ones(3, dtype=torch.float64))


def test_ridge_penalty_shrinks_the_weights():
    # one feature, y = 2x with mean-zero unit-variance x: the closed form is 2 / (1 + l2)
    x = torch.tensor([[-1.0], [1.0], [-1.0], [1.0]])
    weight, bias = ridge_fit(x, 2 * x, l2=1.0)
    assert weight.item() == pytest.approx(1.0) and bias.item() == pytest.approx(0.0)


def test_r2_by_hand():
    target = torch.tensor([[1.0], [2.0], [3.0]])
    assert r2_score(target, target).item() == 1.0
    assert r2_score(torch.full((3, 1), 2.0), target).item() == 0.0  # the mean's own error
    # residuals 0.5, 0, -0.5 -> SS_res 0.5, SS_tot 2 -> 0.75
    assert r2_score(torch.tensor([[1.5], [2.0], [2.5]]), target).item() == pytest.approx(0.75)


def test_scene_targets_layout():
    centers = torch.tensor([[[10, 20], [30, 40]]])
    targets = scene_targets(centers, torch.tensor([[0, 1]]), size=100)
    assert targets.tolist() == [[0.1, 0.2, 0.3, 0.4, -1.0, 1.0]]


def _scenes(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"centers": torch.randint(5, 70, (n, 6, 2), generator=g), "shapes": torch.randint(0, 2, (n, 6), generator=g),
            "queried": torch.randint(0, 6, (n,), generator=g)}


def test_probe_reads_what_the_tokens_encode_and_nothing_else():
    train, test = _scenes(600, 0), _scenes(300, 1)
    mix = torch.randn(18, 40, generator=torch.Generator().manual_seed(2))
    encode = lambda s: scene_targets(s["centers"], s["shapes"], 75).float() @ mix  # noqa: E731  (all objects, linearly)
    full = probe_objects(encode(train), train, encode(test), test, size=75, l2=1e-8)
    assert full["position/r2"] > 0.999 and full["position/rmse_px"] < 0.1
    assert full["shape/accuracy"] == 1.0 and full["shape/accuracy/others"] == 1.0

    noise = lambda s: torch.randn(len(s["shapes"]), 40, generator=torch.Generator().manual_seed(len(s["shapes"])))  # noqa: E731
    blind = probe_objects(noise(train), train, noise(test), test, size=75)
    assert blind["position/r2"] < 0.05 and 0.4 < blind["shape/accuracy"] < 0.6

    def queried_only(s):  # the queried object's shape and nothing about the others (a question-gated encoder)
        shape = s["shapes"].gather(1, s["queried"].view(-1, 1)).float() * 2 - 1
        return torch.cat([shape, nn.functional.one_hot(s["queried"], 6).float()], dim=1)

    gated = probe_objects(queried_only(train), train, queried_only(test), test, size=75)
    assert gated["shape/accuracy/queried"] > 0.9 and gated["shape/accuracy/others"] < 0.6
    assert gated["position/r2"] < 0.05


def test_collect_outputs_hooks_a_sub_module_and_keeps_the_last_tokens():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).train()
    batches = [torch.randn(2, 5, 3), torch.randn(3, 5, 3)]
    rows = collect_outputs(model, batches, "0", last_tokens=2)
    assert rows.shape == (5, 2 * 4)
    torch.testing.assert_close(rows[:2], model[0](batches[0])[:, -2:].flatten(1))
    assert model.training  # put back as it was
    assert collect_outputs(model, batches, "2").shape == (5, 10)
    with pytest.raises(UserError, match="no sub-module 'nope'"):
        collect_outputs(model, batches, "nope")
    with pytest.raises(UserError, match="ridge_fit"):
        ridge_fit(torch.zeros(3, 2), torch.zeros(4, 1))
