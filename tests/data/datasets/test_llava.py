"""llava: LLaVA's JSON conversations through a tokenizer's chat template; the shipped VLM stage
config trains on them with ``datasets=llava``, scores val by generation, and mmvl_predict writes
predictions under LLaVA's ids."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mmvl import registry
from mmvl.labels import IGNORE_INDEX
from mmvl.models.modules.vlm_parts import splice_image_tokens
from mmvl_cli.predict import main as predict
from mmvl_cli.run import main as run
from tests.fixtures.llava_files import records, write_llava

ROOT = Path(__file__).resolve().parents[3]
STAGE1 = ROOT / "projects" / "vlm" / "configs" / "easy_vqa_generative" / "stage1.yaml"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_llava(tmp_path_factory.mktemp("llava") / "data")


def builder(files, tmp_path, train=None):
    cfg = OmegaConf.load(ROOT / "configs" / "datasets" / "llava.yaml").dataset_config.llava
    cfg = OmegaConf.merge(cfg, {"annotations": {"train": str(train or files["train"]), "val": str(files["val"])},
                                "image_folder": str(files["images"]),
                                "processors": {"text_processor": {"params": {"tokenizer_path": str(files["tok"])}}}})
    b = registry.DATASETS.get("llava")(cfg, str(tmp_path))
    b.prepare_split("train")
    return b


def _labelled(item, tok) -> list[str]:
    return tok.convert_ids_to_tokens(item["targets"][item["targets"].ne(IGNORE_INDEX)].tolist())


def test_items_label_every_assistant_turn_in_train_and_the_last_in_val(files, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(files["tok"]))
    b = builder(files, tmp_path)
    train, val = b.build("train"), b.build("val")
    assert len(train) == 40 and len(val) == 8
    two_turns = train[0]  # img-0: red, then "a square"
    assert two_turns["sample_id"] == "img-0" and two_turns["answer"] == "a square"
    assert _labelled(two_turns, tok) == ["red", "<|im_end|>", "a", "square", "<|im_end|>"]
    image = b.text_processor.tokenizer.image_id
    ids = two_turns["input_ids"].tolist()
    assert ids.count(image) == 16 and tok.convert_ids_to_tokens(ids[:2]) == ["<|im_start|>", "user"]
    assert ids[2] == image  # "what color\n<image>": the placeholder moved to the start of its turn
    text = train[3]  # text-3: no image
    assert image not in text["input_ids"].tolist() and torch.equal(text["image"], torch.zeros(3, 64, 64))
    last = next(val[i] for i in range(len(val)) if val[i]["sample_id"] == "img-42")  # two turns
    assert _labelled(last, tok) == ["a", "square", "<|im_end|>"]
    assert b.model_info()["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    batch = b.collate([train[0], train[3]])
    assert batch["image"].shape == (2, 3, 64, 64) and batch["sample_id"] == ["img-0", "text-3"]
    # the shorter sample's padding is not a label (it was 0, a token the loss then taught the model to write)
    pad = batch["attention_mask"].eq(0)
    assert pad.any() and batch["targets"][pad].eq(IGNORE_INDEX).all()


def test_a_text_only_sample_takes_no_image_tokens_in_a_mixed_batch():
    embeds = torch.zeros(2, 5, 3)
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 9, 9, 4, 5]])  # sample 0 text-only; sample 1 has 2 placeholders
    image = torch.arange(2 * 2 * 3, dtype=torch.float).reshape(2, 2, 3)
    out = splice_image_tokens(embeds, ids, image, 9)
    assert torch.equal(out[0], embeds[0])
    assert torch.equal(out[1, 1:3], image[1]) and out[1, [0, 3, 4]].eq(0).all()


def test_the_stage_config_trains_on_llava_scores_val_and_predicts(files, tmp_path):
    keys = [f"config={STAGE1}", "datasets=llava", f"dataset_config.llava.annotations.train={files['train']}",
            f"dataset_config.llava.annotations.val={files['val']}", f"dataset_config.llava.annotations.test={files['val']}",
            f"dataset_config.llava.image_folder={files['images']}",
            f"dataset_config.llava.processors.text_processor.params.tokenizer_path={files['tok']}",
            "model_config.vlm.freeze=[image_encoder]", "training.early_stop.criteria=total_loss",
            f"env.save_dir={tmp_path / 'save'}", f"env.data_dir={tmp_path / 'data'}", "training.progress_bar=false",
            "training.tensorboard=false", "training.curves=false"]
    assert run([*keys, "training.max_updates=30", "training.evaluation_interval=30", "run_type=train_val"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r.get("split") == "val"]
    assert val and all(k in val[-1] for k in ("cider", "generated_vqa_accuracy", "answer_tokens"))
    assert predict([*keys, f"checkpoint.resume_file={tmp_path / 'save' / 'checkpoints' / 'last.ckpt'}"]) == 0
    written = json.loads((tmp_path / "save" / "predictions" / "llava_test.json").read_text())
    expected = records(8, offset=40)
    assert [r["id"] for r in written] == [r["id"] for r in expected]
    assert [r["reference"] for r in written] == [r["conversations"][-1]["value"] for r in expected]
    assert all(isinstance(r["answer"], str) for r in written)


def _broken_copy(files, tmp_path: Path, broken: list[str]) -> Path:
    """A copy of the images folder with the files ``broken`` (relative paths) cut short."""
    import shutil

    folder = tmp_path / "images"
    shutil.copytree(files["images"], folder)
    for name in broken:
        path = folder / name
        path.write_bytes(path.read_bytes()[:40])  # the PNG header, no pixels
    return folder


def _run_keys(files, tmp_path: Path, images: Path, *extra: str) -> list[str]:
    return [f"config={STAGE1}", "datasets=llava", f"dataset_config.llava.annotations.train={files['train']}",
            f"dataset_config.llava.image_folder={images}",
            f"dataset_config.llava.processors.text_processor.params.tokenizer_path={files['tok']}",
            "model_config.vlm.freeze=[image_encoder]", "training.early_stop.criteria=total_loss", "run_type=train",
            f"env.save_dir={tmp_path / 'save'}", f"env.data_dir={tmp_path / 'data'}", "training.progress_bar=false",
            "training.tensorboard=false", "training.curves=false", "training.batch_size=4", "training.num_workers=0",
            *extra]


def test_verify_images_names_every_broken_image_before_the_first_update(files, tmp_path, capsys):
    images = _broken_copy(files, tmp_path, ["red/36.png", "green/37.png"])  # deep in the split, not its first sample
    assert run(_run_keys(files, tmp_path, images, "training.max_updates=2", "dataset_config.llava.verify_images=true")) == 2
    err = capsys.readouterr().err
    assert "llava train: 2 of " in err and "sample 'img-36'" in err and "sample 'img-37'" in err, err
    assert "Traceback" not in err and not (tmp_path / "save" / "checkpoints").exists()


def test_without_verify_images_a_broken_image_stops_its_batch_in_one_line(files, tmp_path, capsys):
    images = _broken_copy(files, tmp_path, ["red/36.png"])
    assert run(_run_keys(files, tmp_path, images, "training.max_updates=40")) == 2
    err = capsys.readouterr().err
    assert "sample 'img-36': image" in err and "cannot be decoded" in err and "Traceback" not in err, err


def test_verify_images_must_be_a_bool(files, tmp_path, capsys):
    assert run(_run_keys(files, tmp_path, files["images"], "dataset_config.llava.verify_images=often")) == 2
    err = capsys.readouterr().err
    assert "verify_images" in err and "true or false" in err, err


def _two_image_file(files, tmp_path: Path) -> Path:
    """The training file with every third record showing a second image (and a second placeholder)."""
    rows = json.loads(Path(files["train"]).read_text())
    for k, row in enumerate(rows):
        if "image" in row and k % 3 == 0:
            row["image"] = [row["image"], rows[1]["image"]]
            row["conversations"][0]["value"] = "<image> <image>\nwhat color is the first"
    path = tmp_path / "two_images.json"
    path.write_text(json.dumps(rows))
    return path


def test_a_two_image_sample_places_each_image_at_its_placeholders_and_trains_the_vlm(files, tmp_path):
    """model: vlm with several images a sample: the sample's pixels are images x C x H x W, its
    placeholders one image_tokens group per image, and image k's tokens land at group k."""
    from mmvl.models.modules.vlm_parts import splice_image_tokens

    b = builder(files, tmp_path, train=_two_image_file(files, tmp_path))
    train = b.build("train")
    two = train[0]
    image = b.text_processor.tokenizer.image_id
    assert two["image"].shape == (2, 3, 64, 64) and two["input_ids"].eq(image).sum() == 2 * 16
    batch = b.collate([train[0], train[1], train[3]])  # two images, one image, text-only
    assert batch["image"].shape == (3, 2, 3, 64, 64)
    tokens = torch.arange(3 * 32 * 2, dtype=torch.float).reshape(3, 32, 2)  # stand-ins for 2 images x 16 tokens
    out = splice_image_tokens(torch.zeros(3, batch["input_ids"].size(1), 2), batch["input_ids"], tokens, image)
    placed = batch["input_ids"][0].eq(image)
    assert torch.equal(out[0][placed], tokens[0])  # image 0's 16 tokens, then image 1's, in placeholder order
    assert torch.equal(out[1][batch["input_ids"][1].eq(image)], tokens[1, :16])
    keys = [f"config={STAGE1}", "datasets=llava", f"dataset_config.llava.annotations.train={tmp_path / 'two_images.json'}",
            f"dataset_config.llava.annotations.val={files['val']}", f"dataset_config.llava.image_folder={files['images']}",
            f"dataset_config.llava.processors.text_processor.params.tokenizer_path={files['tok']}",
            "model_config.vlm.freeze=[]", "training.early_stop.criteria=total_loss", "run_type=train",
            f"env.save_dir={tmp_path / 'save'}", f"env.data_dir={tmp_path / 'data'}", "training.progress_bar=false",
            "training.tensorboard=false", "training.curves=false", "training.max_updates=6",
            "training.log_interval=1", "training.num_workers=0"]
    assert run(keys) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["answer_tokens"] for r in rows if r.get("split") == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_the_start_of_run_length_check_counts_every_image_of_a_sample(files, tmp_path):
    """on_too_long: error checks every sample at start: a two-image sample is two images there too
    (it was counted as one, and refused for its second placeholder)."""
    cfg = OmegaConf.load(ROOT / "configs" / "datasets" / "llava.yaml").dataset_config.llava
    cfg = OmegaConf.merge(cfg, {"annotations": {"train": str(_two_image_file(files, tmp_path))},
                                "image_folder": str(files["images"]),
                                "processors": {"text_processor": {"params": {"tokenizer_path": str(files["tok"]),
                                                                             "on_too_long": "error"}}}})
    b = registry.DATASETS.get("llava")(cfg, str(tmp_path))
    b.prepare_split("train")  # no error: every sample fits max_length 512
    assert b.build("train")[0]["image"].shape[0] == 2
