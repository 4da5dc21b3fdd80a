"""The ``vlm`` under DDP at 2 gloo ranks with bf16 autocast and gradient accumulation: a run stopped
at update 4 and resumed to 8 ends bitwise where the uninterrupted 8-update run ends (weights and
optimizer state), and training moved the weights."""
from __future__ import annotations

import pytest
import torch

from mmvl.config import load_config
from mmvl.io import safe_load
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.toy import register

pytestmark = [pytest.mark.proc, pytest.mark.slow]  # 2 spawned ranks importing transformers, 3 runs each


def _opts(root: str, data: str, *extra: str) -> list[str]:
    d, m = "dataset_config.sort_of_clevr_generative", "model_config.vlm"
    return ["model=vlm", "datasets=sort_of_clevr_generative", "run_type=train", f"env.save_dir={root}/save",
            f"env.data_dir={data}", f"{d}.num_images=16", f"{d}.num_val_images=4", f"{d}.num_test_images=4",
            f"{d}.questions_per_image=2", f"{d}.processors.text_processor.params.image_tokens=25",
            f"{d}.processors.text_processor.params.max_length=48",
            # 75 px -> 38 -> 19 -> 10x10 cells; pixel_shuffle 2 -> 25 image tokens
            f"{m}.image_encoder={{type: cnn, params: {{channels: [4, 8, 8], strides: [2, 2, 2]}}}}",
            f"{m}.pixel_shuffle=2", f"{m}.freeze=[image_encoder]", f"{m}.language_model.random.hidden_size=16",
            f"{m}.language_model.random.intermediate_size=32", f"{m}.language_model.random.num_hidden_layers=1",
            f"{m}.language_model.random.num_attention_heads=2", "distributed.strategy=ddp",
            "training.precision=bf16", "training.batch_size=4", "training.gradient_accumulation=2",
            "training.max_updates=8", "training.checkpoint_interval=4", "training.log_interval=2",
            "training.num_workers=0", "training.progress_bar=false", "training.tensorboard=false",
            "training.curves=false", "checkpoint.resume=false", "optimizer.params.lr=0.01", *extra]


def _runs(env, root: str, data: str) -> dict[str, bool]:
    """On every rank: an uninterrupted run, and a run stopped at 4 then resumed to 8."""
    from torch.nn.parallel import DistributedDataParallel

    register()
    torch.set_num_threads(1)
    trainer = Trainer(load_config(_opts(f"{root}/full", data)), env=env)
    trainer.fit()
    with trainer.engine.autocast():
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    ddp = isinstance(trainer.model, DistributedDataParallel)
    stop = "training.callbacks=[{type: stop_at, params: {update: 4}}]"
    Trainer(load_config(_opts(f"{root}/part", data, stop)), env=env).fit()
    Trainer(load_config(_opts(f"{root}/part", data, "checkpoint.resume=true")), env=env).fit()
    return {"bf16": bf16, "ddp": ddp}


def _tensors(path) -> dict[str, torch.Tensor]:
    state = safe_load(str(path))
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def test_ddp_bf16_vlm_resumes_bitwise(tmp_path):
    ranks = launch(_runs, world_size=2, args=(str(tmp_path), str(tmp_path / "data")), timeout=400)
    assert ranks == [{"bf16": True, "ddp": True}] * 2
    full = _tensors(tmp_path / "full" / "save" / "checkpoints" / "last.ckpt")
    resumed = _tensors(tmp_path / "part" / "save" / "checkpoints" / "last.ckpt")
    first = _tensors(tmp_path / "part" / "save" / "checkpoints" / "model_4.ckpt")
    assert full.keys() == resumed.keys() and any(k.startswith("optimizer.") for k in full)
    for k, v in full.items():
        assert torch.equal(resumed[k], v), f"resumed != uninterrupted at {k}"
    moved = [k for k in full if k.startswith("model.projector") and not torch.equal(first[k], full[k])]
    assert moved, "updates 5-8 left the projector unchanged"
    assert safe_load(str(tmp_path / "part" / "save" / "checkpoints" / "last.ckpt"))["trainer"]["update"] == 8
    text = (tmp_path / "part" / "save" / "train.log").read_text()
    assert "Resumed from" in text and "at update 4" in text
