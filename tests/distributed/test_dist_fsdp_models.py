"""The VLM, CLIP and released VLMs (hf_vlm: LLaVA, Qwen2-VL, LLaVA with LoRA) sharded: ``distributed.strategy=fsdp`` with ``training.gradient_checkpointing`` at 2
gloo ranks. Each update's loss equals one process's on the same global batches; a run stopped and
resumed ends bitwise where the uninterrupted one ends; every shard unit is its own FSDP group of
DTensor parameters and is checkpointed; the start-of-run line shows what sharding saved per rank; and
in one process checkpointing leaves the losses as they were."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.io import safe_load
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.toy import register

pytestmark = [pytest.mark.proc, pytest.mark.slow]  # 2 spawned ranks, three runs each per model

ROOT = Path(__file__).resolve().parents[2]
UPDATES, STOP = 4, 2
COMMON = ["run_type=train", "training.precision=fp32", "training.batch_size=4", f"training.max_updates={UPDATES}",
          f"training.checkpoint_interval={STOP}", "training.log_interval=1", "training.num_workers=0",
          "training.progress_bar=false", "training.tensorboard=false", "training.curves=false",
          "training.evaluation_interval=100", "checkpoint.resume=false", "training.early_stop.criteria=null"]


def _vlm(save: str, data: str) -> list[str]:
    d, m = "dataset_config.sort_of_clevr_generative", "model_config.vlm"
    return ["model=vlm", "datasets=sort_of_clevr_generative", f"env.save_dir={save}", f"env.data_dir={data}",
            f"{d}.num_images=16", f"{d}.num_val_images=4", f"{d}.num_test_images=4", f"{d}.questions_per_image=2",
            f"{d}.processors.text_processor.params.image_tokens=25", f"{d}.processors.text_processor.params.max_length=48",
            f"{m}.image_encoder={{type: cnn, params: {{channels: [4, 8, 8], strides: [2, 2, 2]}}}}",
            f"{m}.pixel_shuffle=2", f"{m}.freeze=[image_encoder]", f"{m}.language_model.random.hidden_size=16",
            f"{m}.language_model.random.intermediate_size=32", f"{m}.language_model.random.num_hidden_layers=2",
            f"{m}.language_model.random.num_attention_heads=2", "optimizer.params.lr=0.01", *COMMON]


def _clip(save: str, data: str) -> list[str]:
    h = "dataset_config.hf_dataset."
    return [f"config={ROOT / 'projects/clip/configs/image_text_shards/tiny.yaml'}", "datasets=hf_dataset",
            h + "task=contrastive", h + f"data_files.train={data}/pairs/train.parquet",
            h + f"data_files.val={data}/pairs/test.parquet",
            h + "processors.text_processor={type: bert_tokenizer, params: {tokenizer_path: minilm, max_seq_length: 16}}",
            h + "image_size=32", h + "metrics=[{type: retrieval, params: {k: [1]}}]",
            f"env.save_dir={save}", f"env.data_dir={data}/cache", "model_config.clip.text_encoder.layers=2",
            "optimizer.type=sgd", "optimizer.params={lr: 0.01, momentum: 0.9}", "scheduler.type=null", *COMMON]


def _hf_vlm(arch: str, *extra: str):
    """A released VLM (a tiny random folder of ``arch`` under ``data``) through the hf_vlm project config."""
    def opts(save: str, data: str) -> list[str]:
        return [f"config={ROOT / 'projects/hf_vlm/configs/defaults.yaml'}", f"model_config.hf_vlm.path={data}/{arch}",
                "datasets=llava", f"dataset_config.llava.annotations.train={data}/set/train.json",
                f"dataset_config.llava.image_folder={data}/set/images", "dataset_config.llava.max_samples=16",
                "model_config.hf_vlm.freeze=[]", f"env.save_dir={save}", f"env.data_dir={data}", "scheduler.type=null",
                "optimizer.params.lr=0.01", "evaluation.metrics=[]", *extra, *COMMON]
    return opts


OPTS = {"vlm": _vlm, "clip": _clip, "hf_vlm_llava": _hf_vlm("llava"), "hf_vlm_qwen2_vl": _hf_vlm("qwen2_vl"),
        "hf_vlm_llava_lora": _hf_vlm("llava", "model_config.hf_vlm.lora.r=4", "model_config.hf_vlm.lora.alpha=8",
                                     "model_config.hf_vlm.lora.parts=[language_model,vision]")}
SHARDED = ["distributed.strategy=fsdp", "training.gradient_checkpointing=true"]


def _units(trainer: Trainer) -> list[dict[str, bool]]:
    """Each shard unit: an FSDP module of its own, whose group holds exactly its DTensor parameters,
    and under activation checkpointing."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from mmvl.utils.activation_checkpointing import is_checkpointed

    out = []
    for unit in trainer.engine.unwrap_model(trainer.model).shard_units():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        grouped = {id(p.sharded_param) for p in group.fsdp_params} if group is not None else set()
        params = list(unit.parameters())
        out.append({"fsdp": group is not None, "own_group": grouped == {id(p) for p in params},
                    "dtensor": all(isinstance(p, DTensor) for p in params), "checkpointed": is_checkpointed(unit)})
    return out


def _ranks(env, kind: str, root: str, data: str) -> list[dict[str, bool]]:
    """On every rank: the uninterrupted sharded run, and one stopped at STOP then resumed."""
    register()  # stop_at
    torch.set_num_threads(1)
    full = Trainer(load_config([*OPTS[kind](f"{root}/full", data), *SHARDED]), env=env)
    units = _units(full)
    full.fit()
    stop = f"training.callbacks=[{{type: stop_at, params: {{update: {STOP}}}}}]"
    Trainer(load_config([*OPTS[kind](f"{root}/part", data), *SHARDED, stop]), env=env).fit()
    Trainer(load_config([*OPTS[kind](f"{root}/part", data), *SHARDED, "checkpoint.resume=true"]), env=env).fit()
    return units


def _losses(save: Path) -> list[float]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["total_loss"] for r in rows if r.get("split") == "train"]


def _footprint(save: Path) -> float:
    found = re.search(r"parameters \+ optimizer state per rank: ([\d.]+) MB", (save / "train.log").read_text())
    assert found, save
    return float(found.group(1))


def _state(path: Path) -> dict[str, torch.Tensor]:
    state = safe_load(str(path))
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    from tests.fixtures.hf_files import write_pairs_parquet

    root = tmp_path_factory.mktemp("clip_data")
    write_pairs_parquet(root, train=24, test=8)
    return root


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """Tiny random LLaVA and Qwen2-VL folders and a LLaVA JSON set beside them."""
    from tests.fixtures.released_vlms import make_llava, make_qwen2_vl, write_llava_set

    root = tmp_path_factory.mktemp("released")
    make_llava(root / "llava")
    make_qwen2_vl(root / "qwen2_vl")
    write_llava_set(root / "set")
    return root


@pytest.mark.parametrize("kind", list(OPTS))
def test_fsdp_with_activation_checkpointing_matches_one_process_and_resumes_bitwise(kind, tmp_path, pairs, released):
    data = str(pairs if kind == "clip" else released if kind.startswith("hf_vlm") else tmp_path / "data")
    one = {}
    for name, extra in (("plain", []), ("checkpointed", ["training.gradient_checkpointing=true"])):
        Trainer(load_config([*OPTS[kind](str(tmp_path / name), data), *extra])).fit()
        one[name] = _losses(tmp_path / name)
    assert len(one["plain"]) == UPDATES
    # one process: checkpointing recomputes, it does not change what is computed
    assert one["checkpointed"] == pytest.approx(one["plain"], abs=1e-6)

    units = launch(_ranks, world_size=2, args=(kind, str(tmp_path / "two"), data), timeout=600)
    assert units[0] and units[0] == units[1]
    assert all(u == {"fsdp": True, "own_group": True, "dtensor": True, "checkpointed": True} for u in units[0])
    sharded = _losses(tmp_path / "two" / "full")
    assert sharded == pytest.approx(one["plain"], abs=1e-4)  # the same global batches, update by update
    assert len(set(sharded)) == UPDATES  # it trained

    full, part = (tmp_path / "two" / f / "checkpoints" / "last.ckpt" for f in ("full", "part"))
    full, resumed = _state(full), _state(part)
    assert full.keys() == resumed.keys() and any(k.startswith("optimizer.") for k in full)
    for key, value in full.items():
        assert torch.equal(resumed[key], value), f"resumed != uninterrupted at {key}"
    assert "at update 2" in (tmp_path / "two" / "part" / "train.log").read_text()

    # what each rank holds: sharded in two, up to the padding of uneven shards
    assert _footprint(tmp_path / "two" / "full") <= 0.525 * _footprint(tmp_path / "checkpointed")
    if kind.endswith("_lora"):
        _exported_adapters_generate_as_the_sharded_run(tmp_path / "two" / "full", Path(data), tmp_path / "adapters")


def _exported_adapters_generate_as_the_sharded_run(save: Path, data: Path, out: Path) -> None:
    """The sharded LoRA run's adapters, exported, loaded by peft onto the released folder: the same greedy
    tokens as the run's own model (its last checkpoint) on a batch of its data."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mmvl.build import build_datasets, build_model
    from mmvl.checkpoint import load_checkpoint, schema
    from mmvl_cli.export import main as export

    assert export(["adapters", str(save), str(out)]) == 0
    config = load_config([*OPTS["hf_vlm_llava_lora"](str(save), str(data))])
    builders = build_datasets(config)
    (builder,) = builders.values()
    builder.prepare()
    model = build_model(config, builders).eval()
    model.load_state_dict(load_checkpoint(save / "checkpoints" / "last.ckpt")[schema.MODEL])
    train = builder.build("train")
    batch = builder.collate([train[i] for i in range(4)])
    ours = model.generate(batch, max_new_tokens=4)
    model.model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(str(data / "llava")), str(out))
    assert torch.equal(model.eval().generate(batch, max_new_tokens=4), ours)
