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

    from mmvl.losses import AnswerTokensLoss

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
    from mmvl.losses import AnswerTokensLoss

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


PREDICT = ["dataset_config.sort_of_clevr_generative.num_images=6",
           "dataset_config.sort_of_clevr_generative.num_val_images=2",
           "dataset_config.sort_of_clevr_generative.num_test_images=3",
           "dataset_config.sort_of_clevr_generative.questions_per_image=3",
           "model_config.vlm.image_encoder.params.channels=[8,8,8]",
           "model_config.vlm.language_model.random.hidden_size=32",
           "model_config.vlm.language_model.random.intermediate_size=64",
           "model_config.vlm.language_model.random.num_hidden_layers=1",
           "model_config.vlm.generation.num_beams=2",
           "run_type=test", "evaluation.predict=true", "training.batch_size=4", "training.progress_bar=false"]


def _predict(env, root: str, name: str) -> int:
    from pathlib import Path

    from mmvl.config import load_config
    from mmvl.trainers import Trainer

    project = Path(__file__).resolve().parents[2] / "projects" / "vlm" / "configs" / "sort_of_clevr_generative"
    config = load_config([f"config={project / 'stage1.yaml'}", f"env.data_dir={root}/data",
                          f"env.save_dir={root}/{name}", *PREDICT])
    Trainer(config, env=env).evaluate("test")
    return env.rank


def test_predictions_at_two_ranks_are_world_ones_once_each(launch, tmp_path):
    """9 test questions over 2 ranks (the sampler pads one): every rank decodes its share (beam
    search), rank 0 writes each question once, in dataset order, as one process writes them."""
    import json

    from mmvl.distributed.env import DistEnv

    _predict(DistEnv(), str(tmp_path), "one")
    launch(_predict, world_size=2, args=(str(tmp_path), "two"), timeout=240)
    read = lambda name: json.loads((tmp_path / name / "predictions" / "sort_of_clevr_generative_test.json")
                                   .read_text())  # noqa: E731
    one, two = read("one"), read("two")
    assert [r["id"] for r in one] == list(range(9))
    assert two == one
