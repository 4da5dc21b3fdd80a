"""Accumulation that keeps a contrastive loss's batch global: equal to one step on the whole batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.losses import build_losses
from mmvl.trainers.contrastive_step import cached_contrastive_update, uses_cached_contrast


class TwoTowers(torch.nn.Module):
    """The smallest model with the clip outputs: two linear towers, a log scale and a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image, self.text = torch.nn.Linear(6, 4), torch.nn.Linear(5, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-1.0))

    def forward(self, batch):
        return {"image_features": F.normalize(self.image(batch["image"]), dim=-1),
                "text_features": F.normalize(self.text(batch["text"]), dim=-1),
                "logit_scale": self.logit_scale.exp(), "logit_bias": self.logit_bias}


def _grads(loss_type: str, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    whole = {"image": torch.randn(12, 6, generator=g), "text": torch.randn(12, 5, generator=g)}
    model, losses = TwoTowers(), build_losses([{"type": loss_type}])
    engine = Engine(device="cpu", gradient_accumulation=k)
    if k == 1:
        loss = losses[0][1]({}, model(whole))
        engine.backward(loss)
        micro = [{"total_loss": loss}]
    else:
        batches = [{n: t.chunk(k)[i] for n, t in whole.items()} for i in range(k)]
        micro = cached_contrastive_update(engine, model, losses, batches)
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["loss"] = torch.stack([m["total_loss"].detach() for m in micro])
    return out


@pytest.mark.parametrize("loss_type", ["clip", "siglip"])
@pytest.mark.parametrize("k", [2, 3])
def test_accumulated_gradient_equals_one_step_on_the_whole_batch(loss_type, k):
    one, acc = _grads(loss_type, 1), _grads(loss_type, k)
    for name in one:
        if name != "loss":
            torch.testing.assert_close(acc[name], one[name], rtol=0, atol=1e-5, msg=name)
    assert acc["logit_scale"].abs() > 0 and ("logit_bias" in acc) == (loss_type == "siglip")
    # every micro-batch reports the whole batch's loss
    torch.testing.assert_close(acc["loss"], one["loss"].expand(k), rtol=0, atol=1e-5)


def test_caching_off_with_accumulation_is_refused_and_mixing_losses_too():
    assert not uses_cached_contrast(build_losses(["clip"]), 1)
    assert uses_cached_contrast(build_losses(["clip"]), 2)
    assert not uses_cached_contrast(build_losses(["cross_entropy"]), 2)  # the plain path
    with pytest.raises(UserError, match="cache_features=false"):
        uses_cached_contrast(build_losses([{"type": "clip", "params": {"cache_features": False}}]), 2)
    with pytest.raises(UserError, match="cross_entropy"):
        uses_cached_contrast(build_losses(["siglip", "cross_entropy"]), 2)


class _UpdateWide:
    """A loss that sees the whole update's micro-batches before any forward (e.g. to count tokens)."""

    calls: list[tuple[int, list[int]]] = []

    def __init__(self):
        self.seen = None

    def begin_update(self, batches):
        self.seen = [len(b["targets"]) for b in batches]

    def __call__(self, batch, output):
        _UpdateWide.calls.append((len(batch["targets"]), self.seen))
        return torch.nn.functional.cross_entropy(output["scores"], batch["targets"])


def test_every_loss_with_begin_update_sees_the_updates_micro_batches_first(tmp_path):
    from mmvl.config import load_config
    from mmvl.registry import LOSSES, register_loss
    from mmvl.trainers import Trainer
    from tests.fixtures.toy import register, toy_opts

    register()
    if "update_wide_probe" not in LOSSES.names():
        register_loss("update_wide_probe")(_UpdateWide)
    _UpdateWide.calls.clear()
    trainer = Trainer(load_config(toy_opts(tmp_path, "training.gradient_accumulation=2", "training.max_updates=2",
                                           "model_config.toy_mlp.losses=[update_wide_probe]")))
    trainer.fit()
    # 2 updates of 2 micro-batches of 8: each loss call knew both of its update's batches (evaluation follows)
    assert _UpdateWide.calls[:4] == [(8, [8, 8])] * 4
