"""``hf_vlm`` trains as a hand-written transformers loop: the same folder loaded by
``AutoModelForImageTextToText``, the same samples (the ids each of mmvl's updates read, its batch
concatenated over the ranks), ``model(**inputs, labels=...)``, ``backward``, AdamW. The loss of every
one of 20 updates agrees within 1e-6 relative, in one process and at 2 gloo ranks under DDP (the
global batch in one process). Then a DDP run with bf16 autocast, gradient accumulation and length
grouping, stopped mid-epoch, resumes bitwise (weights and optimizer state).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.io import safe_load
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.released_vlms import ARCHITECTURES, write_llava_set
from tests.fixtures.toy import register

UPDATES, BATCH, LR = 20, 4, 3e-3


def _opts(model: str, data: str, save: str, world: int, *extra: str) -> list[str]:
    return ["config=projects/hf_vlm/configs/defaults.yaml", f"model_config.hf_vlm.path={model}", "datasets=llava",
            f"dataset_config.llava.annotations.train={data}/train.json", f"dataset_config.llava.image_folder={data}/images",
            "dataset_config.llava.max_samples=24", "model_config.hf_vlm.freeze=[]", "run_type=train",
            f"training.batch_size={BATCH // world}", f"training.max_updates={UPDATES}", "training.log_interval=1",
            "training.evaluation_interval=0", "training.checkpoint_interval=10", "training.num_workers=0",
            "training.progress_bar=false", "training.tensorboard=false", "training.curves=false",
            "scheduler.type=null", f"optimizer.params.lr={LR}", "optimizer.params.weight_decay=0.0",
            "distributed.strategy=ddp" if world > 1 else "distributed.strategy=single",
            f"env.save_dir={save}", f"env.data_dir={data}", *extra]


def _mmvl(env, model: str, data: str, save: str, world: int) -> list[list[int]]:
    """mmvl's run; returns the dataset rows each update read on this rank (``env`` None: one process)."""
    torch.set_num_threads(1)
    config = load_config(_opts(model, data, save, world))
    trainer = Trainer(config) if env is None else Trainer(config, env=env)
    seen: list[list[int]] = []
    trainer.engine.unwrap_model(trainer.model).register_forward_pre_hook(
        lambda module, args: seen.append(args[0]["id"].tolist()))
    trainer.fit()
    assert seen[1] == seen[0]  # the first update's batch runs again after it, once, to count its FLOPs
    return seen[:1] + seen[2:]


def _losses(save: Path) -> list[float]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["answer_tokens"] for r in rows if r.get("split") == "train"]


def _hand_loop(model_dir: Path, data: Path, save: Path, batches: list[list[int]]) -> list[float]:
    """transformers alone on mmvl's samples: the processor's tensors, targets as labels, AdamW."""
    from transformers import AutoModelForImageTextToText

    from mmvl.build import build_datasets

    builders = build_datasets(load_config(_opts(str(model_dir), str(data), str(save), 1)))
    (builder,) = builders.values()
    builder.prepare()
    dataset = builder.build("train")
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8, fused=True)
    losses = []
    for ids in batches:
        batch = builder.collate([dataset[i] for i in ids])
        images = {k: v for k, v in batch.get("images", {}).items() if k != "rows"}
        extra = {k: batch[k] for k in ("token_type_ids", "mm_token_type_ids") if k in batch}
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["targets"],
                    **images, **extra)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    return losses


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_vlm_parity")
    data = write_llava_set(root / "data")
    return {arch: ARCHITECTURES[arch][0](root / arch) for arch in ("llava", "qwen2_vl")}, data


def _close(mmvl: list[float], hand: list[float]) -> None:
    assert len(mmvl) == len(hand) == UPDATES
    worst = max(abs(a - b) / abs(b) for a, b in zip(mmvl, hand))
    assert worst <= 1e-6, (worst, mmvl, hand)
    assert hand[-1] < 0.5 * hand[0]  # it trained


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_one_process_updates_equal_a_hand_written_transformers_loop(arch, folders, tmp_path):
    models, data = folders
    seen = _mmvl(None, str(models[arch]), str(data), str(tmp_path / "save"), 1)
    _close(_losses(tmp_path / "save"), _hand_loop(models[arch], data, tmp_path / "hand", seen))


#: the resumed runs: bf16 autocast, 2 micro-batches an update, batches of similar length
RESUMED = ["training.precision=bf16", "training.gradient_accumulation=2", "training.group_by_length=true"]


def _ranks(env, model: str, data: str, root: str) -> list[list[int]]:
    """The parity run (fp32), then an uninterrupted run and one stopped mid-epoch and resumed."""
    register()
    seen = _mmvl(env, model, data, f"{root}/parity", 2)
    stop = "training.callbacks=[{type: stop_at, params: {update: 7}}]"
    torch.set_num_threads(1)
    for save, extra in (("full", []), ("part", [stop]), ("part", ["checkpoint.resume=true"])):
        Trainer(load_config(_opts(model, data, f"{root}/{save}", 2, *RESUMED, *extra)), env=env).fit()
    return seen


@pytest.mark.proc
@pytest.mark.slow  # 2 spawned ranks importing transformers, three runs each
def test_two_ranks_under_ddp_equal_the_loop_on_the_global_batch_and_resume_bitwise(folders, tmp_path):
    models, data = folders
    ranks = launch(_ranks, world_size=2, args=(str(models["llava"]), str(data), str(tmp_path)), timeout=500)
    batches = [a + b for a, b in zip(*ranks)]  # each update's global batch: rank 0's rows, then rank 1's
    _close(_losses(tmp_path / "parity"), _hand_loop(models["llava"], data, tmp_path / "hand", batches))
    full = safe_load(str(tmp_path / "full" / "checkpoints" / "last.ckpt"))
    resumed = safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt"))
    assert resumed["trainer"]["update"] == UPDATES and "Resumed from" in (tmp_path / "part" / "train.log").read_text()
    for key, value in full["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    for pid, state in full["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][pid][key], value), (pid, key)


def test_ddp_without_looking_for_unused_parameters_is_refused_for_a_model_that_leaves_some():
    """Without find_unused_parameters DDP would wait for gradients that never come and fail at the next
    update with a message naming no setting; hf_vlm declares it leaves some, so the wrap refuses."""
    from types import SimpleNamespace

    from mmvl.distributed.strategies.ddp import wrap_ddp
    from mmvl.errors import UserError
    from mmvl.models.hf_vlm import HFVLM

    assert HFVLM.leaves_parameters_unused
    model = torch.nn.Linear(2, 2)
    model.leaves_parameters_unused = True
    with pytest.raises(UserError, match="set distributed.find_unused_parameters=true"):
        wrap_ddp(model, SimpleNamespace(find_unused_parameters=False), SimpleNamespace())
