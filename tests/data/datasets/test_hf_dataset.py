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
    if source == "parquet_splits":  # load_dataset's way: data_files' keys are split names, splits.val picks one
        where = [H + f"data_files.train={files['parquet']}/train-*.parquet",
                 H + f"data_files.test={files['parquet']}/test-*.parquet", H + "splits.val=test"]
    return [f"config={STAGE1}", "datasets=hf_dataset", H + "task=conversation", *where,
            H + f"processors.text_processor.params.tokenizer_path={files['tok']}", "model_config.vlm.freeze=[image_encoder]",
            "training.early_stop.criteria=total_loss", f"env.save_dir={save}", f"env.data_dir={save.parent / 'data'}",
            *QUIET]


@pytest.mark.parametrize("source", ["disk", "parquet", "parquet_splits"])
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


def _conversation_parquet(folder: Path, texts: list, images: list | None = None, one_image_a_row: bool = False) -> Path:
    """``train.parquet`` of conversation rows with ``texts`` cells as given (any shape) and ``images``
    (empty lists by default: text-only rows), for the checks below."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    data = datasets.Dataset.from_dict({"texts": texts, "images": images if images is not None else [[]] * len(texts)})
    data = data.cast_column("images", datasets.Image() if one_image_a_row else datasets.Sequence(datasets.Image()))
    data.to_parquet(str(folder / "train.parquet"))
    return folder / "train.parquet"


def _opts(files, tmp_path: Path, *data_opts: str) -> list[str]:
    """A tiny conversation train run over ``data_opts`` (where the data is)."""
    return [f"config={STAGE1}", "datasets=hf_dataset", H + "task=conversation", *data_opts,
            H + f"processors.text_processor.params.tokenizer_path={files['tok']}", "model_config.vlm.freeze=[image_encoder]",
            "training.early_stop.criteria=total_loss", f"env.save_dir={tmp_path / 'save'}",
            f"env.data_dir={tmp_path / 'data'}", "run_type=train", "training.batch_size=2",
            "training.max_updates=2", *QUIET]


def _one_line_refusal(files, tmp_path: Path, capsys, *data_opts: str) -> str:
    """A train run over ``data_opts`` exits 2 before any update with one line and no traceback; what it said."""
    assert run(_opts(files, tmp_path, *data_opts)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "save" / "checkpoints").exists(), err
    return err


def test_one_image_a_row_reads_as_that_image(files, tmp_path):
    """An ``images`` column of one image per row (not a list of them) is that row's image."""
    from PIL import Image

    red = Image.new("RGB", (40, 40), (220, 30, 30))
    path = _conversation_parquet(tmp_path / "one", [[{"user": "what color", "assistant": "red"}]] * 2, [red, red],
                                 one_image_a_row=True)
    builder = Trainer(load_config(_opts(files, tmp_path, H + f"data_files.train={path}"))).builders["hf_dataset"]
    item = builder.build("train")[0]
    assert item["input_ids"].eq(builder.text_processor.tokenizer.image_id).sum() == 16 and item["image"].abs().sum() > 0


@pytest.mark.parametrize("cell, needle", [
    (["what color? red", "what shape? square"], r"texts\[0\] is a str \('what color\? red'\), not a \{user, assistant\}"),
    ("what color? red", r"column 'texts' holds a str \('what color\? red'\)"),
    ([{"user": "what color", "assistant": None}], r"texts\[0\] has no assistant text"),
    ([{"user": "what color", "assistant": "  "}], r"texts\[0\] has no assistant text"),
    ([{"user": None, "assistant": "red"}], r"texts\[0\] has no user text"),
])
def test_conversation_rows_of_another_shape_are_one_line(files, tmp_path, capsys, cell, needle):
    import re

    path = _conversation_parquet(tmp_path / "bad", [cell, cell])
    err = _one_line_refusal(files, tmp_path, capsys, H + f"data_files.train={path}")
    assert re.search(needle, err), err


def test_a_parquet_shard_cut_short_is_named(files, tmp_path, capsys):
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(files["parquet"], folder)
    shard = folder / "train-00001.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = _one_line_refusal(files, tmp_path, capsys, H + f"data_files.train={folder}/train-*.parquet")
    assert f"{str(shard)!r} is not a readable parquet file" in err and "magic bytes" in err, err


def test_a_split_naming_an_unset_data_files_key_is_one_line(files, tmp_path, capsys):
    err = _one_line_refusal(files, tmp_path, capsys, H + f"data_files.train={files['parquet']}/train-*.parquet",
                            H + "splits.train=validation")
    assert "splits.train='validation' names data_files.validation, which is not set" in err, err


def test_verify_images_decodes_every_row_before_the_first_update(files, tmp_path, capsys):
    """A cell of bytes that are not an image, deep in the split: named at start with verify_images, not
    only at its batch."""
    import datasets
    from PIL import Image

    red = Image.new("RGB", (40, 40), (220, 30, 30))
    folder = tmp_path / "mixed"
    folder.mkdir()
    texts = [[{"user": "what color", "assistant": "red"}]] * 6
    data = datasets.Dataset.from_dict({"texts": texts, "images": [[red]] * 6})
    data = data.cast_column("images", datasets.Sequence(datasets.Image()))
    broken = data.with_format("arrow")[:].to_pylist()
    broken[4]["images"] = [{"bytes": b"not an image", "path": None}]
    datasets.Dataset.from_list(broken, features=data.features).to_parquet(str(folder / "train.parquet"))
    err = _one_line_refusal(files, tmp_path, capsys, H + f"data_files.train={folder}/train.parquet",
                            H + "verify_images=true")
    assert "hf_dataset train: 1 of 6 images do not decode: row 4" in err, err


@pytest.mark.parametrize("caption, needle", [
    (None, "holds NoneType 'None'"), ("  ", "holds str '"), (["a red square", "red"], "holds list"),
])
def test_a_caption_cell_that_is_not_one_text_is_one_line(files, tmp_path, capsys, caption, needle):
    """``str()`` of a null caption would train on 'None', of a list on its repr: refused, naming the row."""
    import datasets
    from PIL import Image

    red = Image.new("RGB", (40, 40), (220, 30, 30))
    folder = tmp_path / "captions"
    folder.mkdir()
    rows = [{"image": red, "caption": caption}, {"image": red, "caption": "a red square"}]
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Sequence(datasets.Value("string"))
                                  if isinstance(caption, list) else datasets.Value("string")})
    if isinstance(caption, list):
        rows[1]["caption"] = ["a red square"]
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(folder / "train.parquet"))
    err = _one_line_refusal(files, tmp_path, capsys, H + "task=caption", H + f"data_files.train={folder}/train.parquet")
    assert "hf_dataset train row 0: column 'caption' (caption) " + needle in err, err
