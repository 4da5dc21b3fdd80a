"""hf_dataset: a save_to_disk folder and parquet shards in the_cauldron's layout train the shipped VLM
stage config and log a generation metric on val; a VQA parquet trains a classifier; splits are
memory-mapped Arrow; a run killed mid-epoch resumes bitwise."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.io import safe_load
from mmvl.trainers import Trainer
from mmvl_cli.run import main as run
from tests.fixtures.hf_files import write_cauldron, write_pairs_parquet, write_vqa_parquet
from tests.fixtures.tiny_vlm import make_chat_lm
from tests.fixtures.toy import register

ROOT = Path(__file__).resolve().parents[3]
STAGE1 = ROOT / "projects" / "vlm" / "configs" / "easy_vqa_generative" / "stage1.yaml"
CONCAT_BERT = ROOT / "projects" / "concat_bert" / "configs" / "easy_vqa" / "defaults.yaml"
CLIP = ROOT / "projects" / "clip" / "configs" / "image_text_shards" / "tiny.yaml"
H = "dataset_config.hf_dataset."
QUIET = ["training.progress_bar=false", "training.tensorboard=false", "training.curves=false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {**write_cauldron(root), "vqa": write_vqa_parquet(root), "pairs": write_pairs_parquet(root),
            "tok": make_chat_lm(root / "tok")}


def _vlm(files, save: Path, source: str) -> list[str]:
    where = [H + f"path={files['disk']}", H + "splits.val=test"] if source == "disk" else [
        H + f"data_files.train={files['parquet']}/train-*.parquet", H + f"data_files.val={files['parquet']}/test-*.parquet"]
    return [f"config={STAGE1}", "datasets=hf_dataset", H + "task=conversation", *where,
            H + f"processors.text_processor.params.tokenizer_path={files['tok']}", "model_config.vlm.freeze=[image_encoder]",
            "training.early_stop.criteria=total_loss", f"env.save_dir={save}", f"env.data_dir={save.parent / 'data'}",
            *QUIET]


@pytest.mark.parametrize("source", ["disk", "parquet"])
def test_the_cauldron_layout_trains_the_vlm_and_scores_val_by_generation(files, tmp_path, source):
    assert run([*_vlm(files, tmp_path / "save", source), "training.max_updates=20", "training.evaluation_interval=20",
                "run_type=train_val"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r.get("split") == "val"]
    assert val and all(k in val[-1] for k in ("generated_vqa_accuracy", "cider", "answer_tokens"))


def test_splits_are_memory_mapped_and_rows_are_conversations(files, tmp_path):
    from datasets.table import MemoryMappedTable

    trainer = Trainer(load_config([*_vlm(files, tmp_path / "save", "parquet"), "run_type=train"]))
    builder = trainer.builders["hf_dataset"]
    assert isinstance(builder.split_data("train").data, MemoryMappedTable)
    train, val = builder.build("train"), builder.build("val")
    assert len(train) == 40 and len(val) == 8
    proc = builder.text_processor
    image = proc.tokenizer.image_id
    assert train[1]["input_ids"].eq(image).sum() == 16 and train[4]["input_ids"].eq(image).sum() == 0  # 4: text-only
    assert train[1]["targets"].ne(-100).sum() > val[1]["targets"].ne(-100).sum() > 0  # all turns vs the last
    assert val[1]["answer"] == "a square" and train[4]["image"].abs().sum() == 0
    capped = Trainer(load_config([*_vlm(files, tmp_path / "capped", "parquet"), "run_type=train", H + "max_samples=5",
                                  "training.batch_size=4"]))
    assert len(capped.builders["hf_dataset"].build("train")) == 5  # max_samples: the first rows


def test_a_vqa_parquet_trains_a_classifier(files, tmp_path):
    opts = [f"config={CONCAT_BERT}", "datasets=hf_dataset", H + "task=vqa", H + "columns={image: img, question: q, answer: a}",
            H + f"data_files.train={files['vqa']}/train.parquet", H + f"data_files.val={files['vqa']}/test.parquet",
            H + f"data_files.test={files['vqa']}/test.parquet",
            H + "processors.text_processor={type: vocab, params: {max_seq_length: 16}}", H + "metrics=[accuracy]",
            "training.early_stop.criteria=hf_dataset/accuracy", "training.max_updates=60", "training.batch_size=16",
            "training.log_interval=10", "training.evaluation_interval=60", "training.num_workers=0",
            f"env.save_dir={tmp_path / 'save'}", f"env.data_dir={tmp_path / 'data'}", *QUIET]
    assert run(opts) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["total_loss"] for r in rows if r.get("split") == "train"]
    assert losses[-1] < losses[0]  # it learns
    assert [r for r in rows if r.get("split") == "test" and "accuracy" in r]


def _parquet(folder: Path, *splits: str) -> list[str]:
    return [H + f"data_files.{s}={folder}/{'train' if s == 'train' else 'test'}.parquet" for s in splits]


def test_a_classification_parquet_trains_a_classifier_on_its_class_labels(files, tmp_path):
    opts = [f"config={CONCAT_BERT}", "datasets=hf_dataset", H + "task=classification",
            *_parquet(files["pairs"], "train", "val", "test"),
            H + "processors.text_processor={type: vocab, params: {max_seq_length: 8}}", H + "metrics=[accuracy]",
            "training.early_stop.criteria=hf_dataset/accuracy", "training.max_updates=40", "training.batch_size=16",
            "training.evaluation_interval=40", "training.num_workers=0", "evaluation.predict=true",
            f"env.save_dir={tmp_path / 'save'}", f"env.data_dir={tmp_path / 'data'}", *QUIET]
    assert run(opts) == 0
    test = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()
            if '"test"' in line][-1]
    assert test["accuracy"] > 0.9  # the colour is the whole image: learnt in 40 updates
    rows = json.loads((tmp_path / "save" / "predictions" / "hf_dataset_test.json").read_text())
    assert [r["id"] for r in rows] == list(range(12)) and {r["label"] for r in rows} <= {0, 1, 2}


def test_a_contrastive_parquet_trains_clip(files, tmp_path):
    opts = [f"config={CLIP}", "datasets=hf_dataset", H + "task=contrastive", *_parquet(files["pairs"], "train", "val"),
            H + "processors.text_processor={type: bert_tokenizer, params: {tokenizer_path: minilm, max_seq_length: 16}}",
            H + "image_size=32", H + "metrics=[{type: retrieval, params: {k: [1]}}]", "training.early_stop.criteria=null",
            "training.max_updates=4",
            "training.batch_size=8", "training.evaluation_interval=4", "model_config.clip.text_encoder.layers=1",
            f"env.save_dir={tmp_path / 'save'}", f"env.data_dir={tmp_path / 'data'}", *QUIET]
    assert run(opts) == 0
    val = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()
           if '"val"' in line]
    assert val and "mean_recall" in val[-1]  # image-text retrieval over val's pairs


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return safe_load(str(path))["model"]


def test_killed_mid_epoch_and_resumed_ends_where_the_uninterrupted_run_ends(files, tmp_path):
    """40 rows at batch 8: 5 updates an epoch; stopped at 3, resumed to 8 (into the second epoch)."""
    register()  # the stop_at callback
    common = ["training.batch_size=8", "training.max_updates=8", "training.checkpoint_interval=1", "run_type=train",
              "checkpoint.max_to_keep=2"]
    assert run([*_vlm(files, tmp_path / "full", "disk"), *common]) == 0
    part = _vlm(files, tmp_path / "part", "disk")
    assert run([*part, *common, "training.callbacks=[{type: stop_at, params: {update: 3}}]"]) == 0
    assert safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt"))["trainer"]["update"] == 3
    assert run([*part, *common, "checkpoint.resume=true"]) == 0
    full, resumed = _weights(tmp_path / "full" / "checkpoints" / "last.ckpt"), _weights(
        tmp_path / "part" / "checkpoints" / "last.ckpt")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.proc
@pytest.mark.slow  # three real runs with DataLoader workers (~30 s)
def test_sigkilled_mid_epoch_with_workers_resumes_bitwise(files, tmp_path):
    """SIGKILL during update 4 of 5 in the first epoch, 2 DataLoader workers reading their own rows of
    the memory-mapped split; the restart (resume=auto) ends at 8 where the uninterrupted run ends."""
    from tests.fixtures.faults import run_faulty

    common = ["training.batch_size=8", "training.max_updates=8", "training.checkpoint_interval=1", "run_type=train",
              "checkpoint.max_to_keep=2", "training.num_workers=2", "checkpoint.resume=auto"]
    assert run_faulty([*_vlm(files, tmp_path / "full", "disk"), *common], timeout=300).returncode == 0
    part = [*_vlm(files, tmp_path / "part", "disk"), *common]
    killed = run_faulty(part, [{"update": 4, "action": "sigkill", "when": "after"}], timeout=300)
    assert killed.returncode < 0, killed.stderr
    assert safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt"))["trainer"]["update"] == 3
    resumed = run_faulty(part, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    full, again = _weights(tmp_path / "full" / "checkpoints" / "last.ckpt"), _weights(
        tmp_path / "part" / "checkpoints" / "last.ckpt")
    assert full.keys() == again.keys() and all(torch.equal(full[k], again[k]) for k in full)


def test_an_image_cell_may_be_an_image_bytes_or_a_path(tmp_path):
    import io

    from PIL import Image

    from mmvl.data.datasets.hf_dataset import decode_cell
    from mmvl.errors import UserError

    buffer = io.BytesIO()
    Image.new("RGB", (5, 4), (200, 10, 10)).save(buffer, format="PNG")
    data = buffer.getvalue()
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(data)
    for cell in ({"bytes": data, "path": None}, data, "img/a.png", {"bytes": None, "path": "img/a.png"}):
        image = decode_cell(cell, tmp_path, "row 0")
        assert image.size == (5, 4) and image.getpixel((0, 0)) == (200, 10, 10)
    with pytest.raises(UserError, match="row 3: the image .*img/b.png.* does not decode"):
        decode_cell("img/b.png", tmp_path, "row 3")
    with pytest.raises(UserError, match="row 4: the image \\(3 bytes\\) does not decode"):
        decode_cell(b"abc", tmp_path, "row 4")
