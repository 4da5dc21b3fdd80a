"""The Trainer on 2 real gloo processes, per strategy: equals a single-process run with the
same global batch, and stop-at-10 + resume-to-20 equals an uninterrupted 20 (also at world 1)."""
from __future__ import annotations

import pytest
import torch

from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.toy import register, toy_opts

register()
STRATEGIES = ["ddp", "zero_torch", "zero_fairscale", "fsdp"]
CI_STRATEGIES = ["ddp", "fsdp"]  # the ZeRO paths run under `pytest -m slow` (strategy-level tests cover them in CI)


def _opts(root: str, strategy: str, *extra: str) -> list[str]:
    return toy_opts(root, f"distributed.strategy={strategy}", "training.max_updates=20",
                    "training.gradient_accumulation=2", "training.clip_grad_norm=0.5",
                    "training.checkpoint_interval=10", "training.evaluation_interval=10",
                    "checkpoint.resume=false", "optimizer.params.lr=0.02",
                    "training.tensorboard=true", "training.curves=true", *extra)


def _runs(env, root: str, strategies: list[str]) -> None:
    """On every rank: an uninterrupted run, and a run stopped at 10 then resumed to 20."""
    register()
    torch.set_num_threads(1)
    for s in strategies:
        Trainer(load_config(_opts(f"{root}/{s}/full", s)), env=env).fit()
        stop = "training.callbacks=[{type: stop_at, params: {update: 10}}]"
        Trainer(load_config(_opts(f"{root}/{s}/part", s, stop)), env=env).fit()
        Trainer(load_config(_opts(f"{root}/{s}/part", s, "checkpoint.resume=true")), env=env).fit()


def _model(path) -> dict[str, torch.Tensor]:
    return safe_load(str(path))["model"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("single")
    trainer = Trainer(load_config(_opts(str(root), "single")))
    trainer.fit()
    return root


def _check(tmp_path, single, strategies):
    launch(_runs, world_size=2, args=(str(tmp_path), strategies), timeout=400)
    reference = _model(single / "save" / "checkpoints" / "last.ckpt")
    for s in strategies:
        full = _model(tmp_path / s / "full" / "save" / "checkpoints" / "last.ckpt")
        resumed = _model(tmp_path / s / "part" / "save" / "checkpoints" / "last.ckpt")
        for k, v in reference.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=f"{s} vs single: {k}")
            assert torch.equal(resumed[k], full[k]), f"{s}: resumed != uninterrupted at {k}"
        full_dir = tmp_path / s / "full" / "save"
        assert len(list((full_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 writes
        assert (full_dir / "curves.png").is_file()
        # a world-2 checkpoint resumes at world 1 and reaches the single-process result
        mid = tmp_path / s / "part" / "save" / "checkpoints" / "model_10.ckpt"
        t1 = Trainer(load_config(_opts(str(tmp_path / s / "w1"), "single",
                                       f"checkpoint.resume_file={mid}")))
        assert t1.update == 10
        t1.fit()
        for k, v in t1.engine.unwrap_model(t1.model).state_dict().items():
            torch.testing.assert_close(v, reference[k], atol=1e-5, rtol=0, msg=f"{s} world 2->1: {k}")


@pytest.mark.proc
def test_strategies_equal_single_and_resume(tmp_path, single):
    _check(tmp_path, single, CI_STRATEGIES)


@pytest.mark.slow
def test_zero_strategies_equal_single_and_resume(tmp_path, single):
    _check(tmp_path, single, [s for s in STRATEGIES if s not in CI_STRATEGIES])
