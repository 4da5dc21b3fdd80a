"""``training.compile=true``: compiled and eager training give the same losses (tolerance below),
checkpoints keep the eager parameter names and load either way, resume works compiled, and so do
activation checkpointing, ddp and fsdp (2 gloo processes)."""
from __future__ import annotations

import json

import pytest
import torch

from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.e2e.test_sort_of_clevr_run import tiny_opts as demo_opts
from tests.fixtures.toy import register, toy_opts

register()
#: compiled kernels may reorder float sums: losses agree to this (they are O(1))
TOLERANCE = 1e-4


def _losses(save_dir) -> list[float]:
    events = [json.loads(line) for line in open(f"{save_dir}/metrics.jsonl")]
    return [e["total_loss"] for e in events if e["split"] == "train"]


def _fit(opts: list[str]) -> Trainer:
    trainer = Trainer(load_config(opts))
    trainer.fit()
    return trainer


def test_compiled_toy_training_matches_eager_and_resumes(tmp_path):
    """The fast check (``aot_eager``: dynamo's graphs and compiled backward, no code generation)."""
    opts = ("training.log_interval=1", "training.compile_backend=aot_eager")
    eager = _fit(toy_opts(tmp_path / "eager", *opts))
    compiled = _fit(toy_opts(tmp_path / "compiled", *opts, "training.compile=true"))
    assert compiled.model._compiled_call_impl is not None  # the whole model (one process)
    assert _losses(tmp_path / "compiled/save") == pytest.approx(_losses(tmp_path / "eager/save"), abs=TOLERANCE)
    ckpt = tmp_path / "compiled/save/checkpoints/last.ckpt"
    state = safe_load(ckpt)
    assert not any("_orig_mod" in k for k in state["model"]) and set(state["model"]) == \
        set(safe_load(tmp_path / "eager/save/checkpoints/last.ckpt")["model"])
    # stop at 6 compiled, resume to 12 eager: the same weights as the eager run (and the other way round)
    _fit(toy_opts(tmp_path / "mixed", *opts, "training.compile=true",
                  "training.callbacks=[{type: stop_at, params: {update: 6}}]"))
    _fit(toy_opts(tmp_path / "mixed", *opts, "checkpoint.resume=true"))
    mixed = safe_load(tmp_path / "mixed/save/checkpoints/last.ckpt")["model"]
    for k, v in state["model"].items():
        torch.testing.assert_close(mixed[k], v, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_inductor_demo_model_matches_eager(tmp_path, checkpointing):
    """visual_bert (film_cnn, pooled_and_visual) with inductor, optionally with activation checkpointing."""
    torch.set_num_threads(1)
    extra = ["training.log_interval=1", f"training.gradient_checkpointing={str(checkpointing).lower()}"]
    _fit(demo_opts(tmp_path / "eager") + extra)
    _fit(demo_opts(tmp_path / "compiled") + extra + ["training.compile=true"])
    assert _losses(tmp_path / "compiled/save") == pytest.approx(_losses(tmp_path / "eager/save"), abs=TOLERANCE)


def _distributed(env, root: str, strategy: str, backend: str) -> None:
    register()
    torch.set_num_threads(1)
    common = [f"distributed.strategy={strategy}", "training.max_updates=6", "training.log_interval=1",
              "training.checkpoint_interval=3", "checkpoint.resume=false", f"training.compile_backend={backend}",
              "training.gradient_checkpointing=true"]
    for name, extra in (("eager", []), ("compiled", ["training.compile=true"])):
        Trainer(load_config(toy_opts(f"{root}/{name}", *common, *extra)), env=env).fit()
    stop = "training.callbacks=[{type: stop_at, params: {update: 3}}]"
    Trainer(load_config(toy_opts(f"{root}/resumed", *common, "training.compile=true", stop)), env=env).fit()
    Trainer(load_config(toy_opts(f"{root}/resumed", *common, "training.compile=true",
                                 "checkpoint.resume=true")), env=env).fit()


@pytest.mark.parametrize("strategy, backend", [
    pytest.param("ddp", "aot_eager", marks=pytest.mark.slow),  # two processes compiling: ~20 s
    pytest.param("fsdp", "aot_eager", marks=pytest.mark.slow),
    pytest.param("ddp", "inductor", marks=pytest.mark.slow),
    pytest.param("fsdp", "inductor", marks=pytest.mark.slow),
])
def test_compiled_distributed_matches_eager_and_resumes(tmp_path, strategy, backend):
    launch(_distributed, world_size=2, args=(str(tmp_path), strategy, backend), timeout=400)
    assert _losses(tmp_path / "compiled/save") == pytest.approx(_losses(tmp_path / "eager/save"), abs=TOLERANCE)
    want = safe_load(tmp_path / "compiled/save/checkpoints/last.ckpt")["model"]
    got = safe_load(tmp_path / "resumed/save/checkpoints/last.ckpt")["model"]
    assert not any("_orig_mod" in k for k in want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=TOLERANCE, rtol=0)


@pytest.mark.cuda
def test_compiled_bf16_on_cuda_matches_eager(tmp_path):
    extra = ["training.log_interval=1", "training.device=cuda", "training.precision=bf16"]
    _fit(demo_opts(tmp_path / "eager") + extra)
    _fit(demo_opts(tmp_path / "compiled") + extra + ["training.compile=true"])
    # bf16 rounds differently once kernels are fused: a looser bound than fp32 on the CPU
    assert _losses(tmp_path / "compiled/save") == pytest.approx(_losses(tmp_path / "eager/save"), abs=2e-2)
