"""``answer_tokens`` at 2 gloo ranks under DDP with 2 micro-batches each: the loss and gradients of
one big batch at world 1 (the normaliser counts answer tokens over micro-batches and ranks)."""
from __future__ import annotations

import pytest
import torch

from tests.fixtures import tiny_vlm

pytestmark = [pytest.mark.proc, pytest.mark.slow]  # 2 spawned ranks importing transformers: ~25 s


def _micro(proc, rank: int, world: int):
    items = tiny_vlm.items(proc)
    share = items[rank * len(items) // world:(rank + 1) * len(items) // world]
    return [tiny_vlm.collate(proc, share[i:i + 2]) for i in range(0, len(share), 2)]


def _rank(env, folder: str) -> dict:
    """The normalised loss and, on a fresh model, the per-micro-batch mean it replaces."""
    return {"right": _update(env, folder, naive=False), "naive": _update(env, folder, naive=True)}


def _update(env, folder: str, naive: bool) -> dict:
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    from mmvl.token_losses import AnswerTokensLoss

    torch.set_num_threads(1)
    proc = tiny_vlm.processor(folder)
    model = tiny_vlm.build_model(folder, proc)
    ddp = DistributedDataParallel(model)
    micro = _micro(proc, env.rank, env.world_size)
    loss = AnswerTokensLoss()
    if not naive:
        loss.begin_update(micro)
    total = torch.zeros(())
    for i, batch in enumerate(micro):
        sync = contextlib.nullcontext() if i == len(micro) - 1 else ddp.no_sync()
        with sync:
            value = loss(batch, ddp(batch)) / len(micro)  # what Engine.backward does
            value.backward()
        total += value.detach()
    torch.distributed.all_reduce(total)
    return {"loss": total / env.world_size,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def test_world_two_equals_one_big_batch(launch, tmp_path):
    from mmvl.token_losses import AnswerTokensLoss

    folder = tiny_vlm.make_tiny_lm(tmp_path / "lm")
    proc = tiny_vlm.processor(folder)
    model = tiny_vlm.build_model(folder, proc)
    big = tiny_vlm.collate(proc, tiny_vlm.items(proc))
    loss = AnswerTokensLoss()
    loss.begin_update([big])
    whole = loss(big, model(big))
    whole.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}

    ranks = launch(_rank, world_size=2, args=(str(folder),), timeout=240)
    for got in (r["right"] for r in ranks):
        torch.testing.assert_close(got["loss"], whole.detach(), atol=1e-5, rtol=1e-5)
        assert set(got["grads"]) == set(ref)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref[name], atol=1e-5, rtol=1e-5, msg=name)
    naive = ranks[0]["naive"]  # per-micro-batch means: measurably another gradient
    assert max((naive["grads"][n] - ref[n]).abs().max() for n in ref) > 1e-3
