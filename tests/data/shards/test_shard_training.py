"""Generated shards train visual_bert pretraining (masked LM + image-text matching) through mmvl_run,
and a run SIGKILLed mid-epoch resumes bitwise equal to the uninterrupted run."""
from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from mmvl.io import safe_load
from tests.fixtures.faults import run_faulty
from tests.fixtures.shard_data import write_pair_shards, write_vocab
from tests.reliability.test_crash_resume import _tensors  # model + optimizer tensors of a checkpoint

pytest.importorskip("webdataset")
ROOT = Path(__file__).resolve().parents[3]
TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 32}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard_train")
    info = write_pair_shards(root, n_samples=40, per_shard=5, corrupt=(11,))
    write_pair_shards(root, n_samples=8, per_shard=8, prefix="val", first=100)
    return root, info["pattern"], write_vocab(root)


def opts(data, save: Path, updates: int, *extra: str) -> list[str]:
    root, pattern, vocab = data
    d, m = "dataset_config.image_text_shards", "model_config.visual_bert"
    out = [f"config={ROOT / 'projects/visual_bert/configs/image_text_shards/pretrain.yaml'}",
           f"env.data_dir={root}", f"env.save_dir={save}", f"training.max_updates={updates}",
           "training.batch_size=4", "training.num_workers=2", "training.progress_bar=false",
           "training.log_interval=1", f"training.evaluation_interval={updates}", "scheduler.params.num_warmup_steps=1",
           f"{m}.text_encoder.pretrained_path=null", f"{d}.image_size=24", f"{d}.shuffle_buffer=6",
           f"{d}.splits.train.shards={pattern}", f"{d}.processors.text_processor.params.tokenizer_path={vocab}",
           f"{d}.processors.text_processor.params.max_seq_length=12", f"{m}.image_size=24",
           f"{m}.image_encoder={{type: cnn, params: {{channels: [4, 8], strides: [4, 4]}}}}"]
    return out + [f"{m}.{k}={v}" for k, v in TINY.items()] + list(extra)


@pytest.mark.proc
def test_visual_bert_pretrains_on_shards(data, tmp_path):
    from mmvl.config import load_config
    from mmvl.trainers import run

    torch.manual_seed(0)
    results = run(load_config(opts(data, tmp_path, 4)))
    assert results["updates"] == 4
    train = [e for e in map(json.loads, open(tmp_path / "metrics.jsonl")) if e["split"] == "train"]
    assert [e["update"] for e in train] == [1, 2, 3, 4]
    assert all(math.isfinite(e["mlm"]) and math.isfinite(e["itm"]) for e in train)
    val = results["val"]["image_text_shards"]
    assert {"accuracy", "roc_auc"} <= set(val) and val["itm"] > 0
    log = (tmp_path / "train.log").read_text()
    assert "10 batches per rank from 8 shards" in log and "0 of 40 samples dropped" in log


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_the_uninterrupted_run(data, tmp_path):
    updates = 14  # 10 batches an epoch: the kill (update 7) is mid-epoch 0, the end in epoch 1
    common = ["training.checkpoint_interval=3", "checkpoint.resume=auto", "training.evaluation_interval=100"]
    ref = run_faulty(opts(data, tmp_path / "ref", updates, *common), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = opts(data, tmp_path / "run", updates, *common)
    killed = run_faulty(run, [{"update": 7, "action": "sigkill", "when": "after"}], timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    state = safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert state["data"]["epoch"] == 0 and state["data"]["batch"] == 6  # resumes mid-epoch, mid-shard
    done = run_faulty(run, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Resumed from" in (tmp_path / "run" / "train.log").read_text()
    want, got = (_tensors(safe_load(tmp_path / r / "checkpoints" / "last.ckpt")) for r in ("ref", "run"))
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} differs from the uninterrupted run"
