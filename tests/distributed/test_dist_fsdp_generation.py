"""Generation inside evaluation under FSDP at 2 gloo ranks, for ``vlm`` and ``hf_vlm``: the ranks decode
their own samples in lockstep (every forward gathers the shards on every rank; a rank whose rows have
ended, or that has none in a batch, keeps stepping until all are done), and the val scores equal a
single-process run's on the same global batches, within one answer. A cap that leaves the ranks with
different numbers of rows to decode (``generate_max_samples``) does not hang them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch

pytestmark = [pytest.mark.proc, pytest.mark.slow]  # 2 spawned ranks importing transformers, two runs each

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["run_type=train_val", "training.precision=fp32", "training.max_updates=6", "training.evaluation_interval=6",
          "training.checkpoint_interval=6", "training.log_interval=3", "training.num_workers=0",
          "training.progress_bar=false", "training.tensorboard=false", "training.curves=false",
          "training.early_stop.criteria=total_loss"]


def _hf_vlm(save: str, data: str, world: int, *extra: str) -> list[str]:
    return [f"config={ROOT / 'projects/hf_vlm/configs/defaults.yaml'}", f"model_config.hf_vlm.path={data}/llava",
            "datasets=llava", f"dataset_config.llava.annotations.train={data}/set/train.json",
            f"dataset_config.llava.annotations.val={data}/set/val.json", f"dataset_config.llava.image_folder={data}/set/images",
            "model_config.hf_vlm.freeze=[]", "model_config.hf_vlm.generation.max_new_tokens=4", "optimizer.params.lr=3e-3",
            "scheduler.type=null", f"training.batch_size={4 // world}", f"env.save_dir={save}", f"env.data_dir={data}",
            *COMMON, *extra]


def _vlm(save: str, data: str, world: int, *extra: str) -> list[str]:
    d, m = "dataset_config.sort_of_clevr_generative", "model_config.vlm"
    return ["model=vlm", "datasets=sort_of_clevr_generative", f"env.save_dir={save}", f"env.data_dir={data}",
            f"{d}.num_images=16", f"{d}.num_val_images=4", f"{d}.num_test_images=4", f"{d}.questions_per_image=2",
            f"{d}.processors.text_processor.params.image_tokens=25", f"{d}.processors.text_processor.params.max_length=48",
            f"{m}.image_encoder={{type: cnn, params: {{channels: [4, 8, 8], strides: [2, 2, 2]}}}}",
            f"{m}.pixel_shuffle=2", f"{m}.language_model.random.hidden_size=16",
            f"{m}.language_model.random.intermediate_size=32", f"{m}.language_model.random.num_hidden_layers=2",
            f"{m}.language_model.random.num_attention_heads=2", "optimizer.params.lr=0.01",
            "evaluation.metrics=[generated_vqa_accuracy, cider]", f"training.batch_size={8 // world}", *COMMON, *extra]


OPTS = {"vlm": _vlm, "hf_vlm": _hf_vlm}
SHARDED = ["distributed.strategy=fsdp", "training.gradient_checkpointing=true"]


def _val(save: Path) -> list[dict]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "val"]


def _ranks(env, kind: str, root: str, data: str) -> None:
    torch.set_num_threads(1)
    Trainer(load_config(OPTS[kind](f"{root}/sharded", data, 2, *SHARDED)), env=env).fit()
    Trainer(load_config(OPTS[kind](f"{root}/capped", data, 2, *SHARDED, "evaluation.generate_max_samples=3")),
            env=env).fit()


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    from tests.fixtures.released_vlms import make_llava, write_llava_set

    root = tmp_path_factory.mktemp("released")
    make_llava(root / "llava")
    write_llava_set(root / "set")
    return root


@pytest.mark.parametrize("kind", list(OPTS))
def test_sharded_ranks_decode_in_lockstep_and_score_as_one_process(kind, tmp_path, released):
    data = str(released if kind == "hf_vlm" else tmp_path / "data")
    Trainer(load_config(OPTS[kind](str(tmp_path / "one"), data, 1))).fit()
    launch(_ranks, world_size=2, args=(kind, str(tmp_path), data), timeout=600)
    one, sharded = _val(tmp_path / "one")[-1], _val(tmp_path / "sharded")[-1]
    total = 6 if kind == "hf_vlm" else 8  # val samples
    assert "generated_vqa_accuracy" in sharded
    assert abs(sharded["generated_vqa_accuracy"] - one["generated_vqa_accuracy"]) <= 1 / total + 1e-9
    capped = _val(tmp_path / "capped")
    assert capped and "generated_vqa_accuracy" in capped[0]  # the capped evaluation during training ran through

