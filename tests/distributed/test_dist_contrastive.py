"""The contrastive losses at world size 2 on gloo against open_clip's (loss and every gradient)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from dist_launch import launch

B, D = 3, 8  # rows per rank, feature size


def _leaves(rank: int) -> dict[str, torch.Tensor]:
    """This rank's rows of one seeded global batch, and its own copy of the shared scalars."""
    g = torch.Generator().manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(2 * B, D, generator=g), dim=-1)[rank * B:(rank + 1) * B]
    text = torch.nn.functional.normalize(torch.randn(2 * B, D, generator=g), dim=-1)[rank * B:(rank + 1) * B]
    return {"image": image, "text": text, "scale": torch.tensor(7.0), "bias": torch.tensor(-3.0)}


def _run(loss_fn) -> dict[str, torch.Tensor]:
    leaves = {k: v.clone().requires_grad_(True) for k, v in _leaves(torch.distributed.get_rank()).items()}
    value = loss_fn(leaves)
    value.backward()
    return {"loss": value.detach(), **{k: v.grad.clone() for k, v in leaves.items() if v.grad is not None}}


class _NoWrapper:
    """The Engine's step surface for a model no strategy wraps (the gradients stay this rank's own)."""

    accumulate = staticmethod(lambda model: contextlib.nullcontext())
    autocast = staticmethod(contextlib.nullcontext)
    backward = staticmethod(lambda loss, divide=True: loss.backward())


def _accumulated(rank: int, loss_type: str) -> dict[str, dict[str, torch.Tensor]]:
    """Gradients of one step on this rank's whole batch and of the cached accumulation over 2 micro-batches."""
    from mmvl.losses import build_losses
    from mmvl.trainers.contrastive_step import cached_contrastive_update
    from tests.trainers.test_contrastive_step import TwoTowers

    g = torch.Generator().manual_seed(10 + rank)
    whole = {"image": torch.randn(6, 6, generator=g), "text": torch.randn(6, 5, generator=g)}
    out = {}
    for k in (1, 2):
        model, losses = TwoTowers(), build_losses([loss_type])
        if k == 1:
            losses[0][1]({}, model(whole)).backward()
        else:
            cached_contrastive_update(_NoWrapper(), model, losses,
                                      [{n: t.chunk(k)[i] for n, t in whole.items()} for i in range(k)])
        out[k] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def _ranks(env) -> dict[str, dict[str, torch.Tensor]]:
    from open_clip.loss import ClipLoss as OpenClipLoss
    from open_clip.loss import SigLipLoss as OpenSigLipLoss

    from mmvl.losses import ClipLoss, SigLipLoss

    rank, world = env.rank, env.world_size

    def ours(loss):
        return lambda x: loss({}, {"image_features": x["image"], "text_features": x["text"],
                                   "logit_scale": x["scale"], "logit_bias": x["bias"]})

    out = {}
    for local in (False, True):
        theirs = OpenClipLoss(local_loss=local, gather_with_grad=True, rank=rank, world_size=world)
        out[f"clip_{local}"] = _run(ours(ClipLoss(local_loss=local)))
        out[f"open_clip_{local}"] = _run(lambda x: theirs(x["image"], x["text"], x["scale"]))
    out["accumulation"] = {loss: _accumulated(rank, loss) for loss in ("clip", "siglip")}
    out["siglip"] = _run(ours(SigLipLoss()))
    theirs = OpenSigLipLoss(rank=rank, world_size=world)
    out["open_siglip"] = _run(lambda x: theirs(x["image"], x["text"], x["scale"], x["bias"]))
    return out


def _close(a: dict, b: dict, keys=("loss", "image", "text", "scale", "bias")) -> None:
    for k in keys:
        if k in a or k in b:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.proc
@pytest.mark.slow  # ~20 s: two spawned interpreters importing open_clip
def test_clip_and_siglip_equal_open_clip_at_world_two():
    ranks = launch(_ranks, world_size=2, timeout=120)
    for res in ranks:
        _close(res["clip_False"], res["open_clip_False"])
        _close(res["clip_True"], res["open_clip_True"])
        _close(res["siglip"], res["open_siglip"])
        assert set(res["siglip"]) >= {"image", "text", "scale", "bias"}
        # local_loss: the same feature gradients as the global loss
        _close(res["clip_True"], res["clip_False"], keys=("image", "text"))
        for loss, grads in res["accumulation"].items():  # accumulation keeps the global contrast
            for name, grad in grads[1].items():
                torch.testing.assert_close(grads[2][name], grad, rtol=0, atol=1e-5, msg=f"{loss} {name}")
    # ... and the same logit_scale gradient once averaged over the ranks (as DDP does)
    mean = lambda key: (ranks[0][key]["scale"] + ranks[1][key]["scale"]) / 2  # noqa: E731
    torch.testing.assert_close(mean("clip_True"), mean("clip_False"), rtol=0, atol=1e-6)
    # the global loss is the same number on every rank; the two ranks' features differ
    assert torch.equal(ranks[0]["clip_False"]["loss"], ranks[1]["clip_False"]["loss"])
    assert not torch.equal(ranks[0]["siglip"]["image"], ranks[1]["siglip"]["image"])
