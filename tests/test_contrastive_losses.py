"""The contrastive losses at world size 1: open_clip's values and gradients, and the shared contract."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmvl.errors import UserError
from mmvl.losses import ContrastiveLoss, build_losses
from mmvl.registry import LOSSES

CONTRASTIVE = [n for n in LOSSES.names() if issubclass(LOSSES.get(n), ContrastiveLoss)]


def _features(n: int = 5, d: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    text = F.normalize(image + 0.3 * torch.randn(n, d, generator=g), dim=-1)  # matched pairs are close
    return {"image_features": image, "text_features": text,
            "logit_scale": torch.tensor(10.0), "logit_bias": torch.tensor(-2.0)}


@pytest.mark.parametrize("name", CONTRASTIVE)
def test_every_contrastive_loss_prefers_matched_pairs_and_names_missing_keys(name):
    (built, loss), = build_losses([{"type": name}])
    out = _features()
    shuffled = {**out, "text_features": out["text_features"].roll(1, 0)}
    low, high = loss({}, out), loss({}, shuffled)
    assert low.dim() == 0 and 0 <= low < high
    text = out["text_features"].clone().requires_grad_(True)
    loss({}, {**out, "text_features": text}).backward()
    assert text.grad.abs().sum() > 0
    with pytest.raises(UserError, match=name):
        loss({}, {"logits": torch.zeros(2, 2)})
    # the evaluation loop's view (scores only): the same value from the [texts x images] logits
    scores = out["logit_scale"] * out["text_features"] @ out["image_features"].T
    scores = scores + out["logit_bias"] * (name == "siglip")
    torch.testing.assert_close(loss({}, {"scores": scores}), low, rtol=0, atol=1e-6)


@pytest.mark.parametrize("local_loss", [False, True])
def test_clip_equals_open_clip_at_world_one(local_loss):
    from open_clip.loss import ClipLoss

    from mmvl.losses import ClipLoss as Ours

    def grads(fn):
        leaves = {k: v.clone().requires_grad_(True) for k, v in _features().items()}
        value = fn(leaves)
        value.backward()
        return [value.detach()] + [leaves[k].grad for k in ("image_features", "text_features", "logit_scale")]

    ours = grads(lambda x: Ours(local_loss=local_loss)({}, x))
    theirs = grads(lambda x: ClipLoss(local_loss=local_loss)(x["image_features"], x["text_features"],
                                                               x["logit_scale"]))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_siglip_equals_open_clip_at_world_one_and_needs_a_bias():
    from open_clip.loss import SigLipLoss

    from mmvl.losses import SigLipLoss as Ours

    out = _features()
    torch.testing.assert_close(Ours()({}, out), SigLipLoss()(*out.values()), rtol=0, atol=1e-6)
    with pytest.raises(UserError, match="logit_bias"):
        Ours()({}, {k: v for k, v in out.items() if k != "logit_bias"})
