"""Hostile input to the new workloads (the generative VLM, CLIP, the easy-VQA classifiers with EMA,
layer decay and parameter groups): each ends with exit code 2 and one line naming the key, before
the first update, so the save folder holds nothing but the log (and the run's lock).

Each workload runs its shipped project config at toy size, in process; a control row of each
trains (exit 0), so a refusal is the hostile value's doing and not the fixture's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from mmvl import registry
from mmvl.config import schema
from mmvl.errors import UserError
from mmvl.locks import LOCK
from mmvl.optim import build_optimizer
from mmvl_cli.run import main
from tests.data.datasets.test_easy_vqa_generative import TEST, TRAIN
from tests.fixtures.easy_vqa_files import write_easy_vqa_root
from tests.fixtures.hf_files import write_cauldron
from tests.fixtures.llava_files import write_llava
from tests.fixtures.released_vlms import make_llava, write_llava_set
from tests.fixtures.tiny_vlm import make_chat_lm
from tests.reliability.test_bad_inputs import assert_one_line

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["training.max_updates=2", "training.batch_size=2", "training.evaluation_interval=2",
          "training.checkpoint_interval=2", "training.num_workers=0", "training.progress_bar=false",
          "training.tensorboard=false", "training.curves=false"]


@dataclass
class Workload:
    """A shipped project config at toy size; ``opts(files)`` its command line over the test's files."""
    config: str
    extra: list[str] = field(default_factory=list)

    def opts(self, files: Path, save: Path) -> list[str]:
        return [f"config={ROOT / self.config}", *COMMON, *[e.replace("{files}", str(files)) for e in self.extra],
                f"env.data_dir={files / 'data'}", f"env.save_dir={save}"]


WORKLOADS = {
    "vlm": Workload("projects/vlm/configs/easy_vqa_generative/stage1.yaml", [
        "dataset_config.easy_vqa_generative.data_root={files}/easy_vqa", "dataset_config.easy_vqa_generative.val_images=1",
        "model_config.vlm.image_encoder.params.strides=[1,1,1]"]),  # 8 px images: an 8x8 grid, 16 tokens
    "concat_bert": Workload("projects/concat_bert/configs/easy_vqa/defaults.yaml", [
        "dataset_config.easy_vqa.data_root={files}/easy_vqa", "dataset_config.easy_vqa.val_images=1"]),
    "relation_network": Workload("projects/relation_network/configs/easy_vqa/defaults.yaml", [
        "dataset_config.easy_vqa.data_root={files}/easy_vqa", "dataset_config.easy_vqa.val_images=1"]),
    "clip": Workload("projects/clip/configs/image_text_shards/tiny.yaml", [
        "dataset_config.image_text_shards.splits.train.shards=train-000000.tar",
        "dataset_config.image_text_shards.shuffle_buffer=4",
        "model_config.clip.text_encoder.layers=1"]),
    "llava": Workload("projects/vlm/configs/easy_vqa_generative/stage1.yaml", [
        "datasets=llava", "dataset_config.llava.annotations.train={files}/llava/train.json",
        "dataset_config.llava.annotations.val={files}/llava/val.json", "dataset_config.llava.image_folder={files}/llava/images",
        "dataset_config.llava.processors.text_processor.params.tokenizer_path={files}/llava/tok",
        "training.early_stop.criteria=total_loss"]),
    "hf_dataset": Workload("projects/vlm/configs/easy_vqa_generative/stage1.yaml", [
        "datasets=hf_dataset", "dataset_config.hf_dataset.path={files}/hf/disk", "dataset_config.hf_dataset.splits.val=test",
        "dataset_config.hf_dataset.processors.text_processor.params.tokenizer_path={files}/llava/tok",
        "training.early_stop.criteria=total_loss"]),
    "hf_vlm": Workload("projects/hf_vlm/configs/defaults.yaml", [
        "model_config.hf_vlm.path={files}/hf_vlm/model", "dataset_config.llava.annotations.train={files}/hf_vlm/data/train.json",
        "dataset_config.llava.annotations.val={files}/hf_vlm/data/val.json",
        "dataset_config.llava.image_folder={files}/hf_vlm/data/images"]),
}
#: which workload runs each registered generative model (a model with ``generate``)
GENERATIVE = {"vlm": "vlm", "hf_vlm": "hf_vlm"}

VLM, LM = "model_config.vlm.", "model_config.vlm.language_model."
#: (workload, override, what the line says)
ROWS = [
    ("vlm", LM + "path={files}/lm_not_json", "lm_not_json' does not load: OSError: It looks like the config file"),
    ("vlm", LM + "path={files}/lm_empty", "Should have a `model_type` key"),
    ("vlm", LM + "path={files}/no_such_lm", "language_model.path="),
    ("vlm", LM + "random.num_attention_heads=5", "not a multiple of the number of attention heads (5)"),
    ("vlm", LM + "random.model_type=llamaa", "Unrecognized model identifier: llamaa"),
    ("vlm", LM + "attn_implementation=flash9", '`attn_implementation="flash9"` is not supported'),
    ("vlm", VLM + "pixel_shuffle=0", "model_config.vlm.pixel_shuffle=0 must be an integer of 1 or more"),
    ("vlm", VLM + "projector_layers=0", "projector_layers=0"),
    ("vlm", "dataset_config.easy_vqa_generative.processors.text_processor.params.tokenizer_path={files}/lm_empty",
     "tokenizer_path="),
    ("clip", "model_config.clip.text_encoder.heads=5", "model_config.clip.text_encoder"),
    ("clip", "model_config.clip.image_encoder.params.kwargs.depthh=2", "unexpected keyword argument 'depthh'"),
    ("clip", "model_config.clip.image_encoder.params.kwargs.num_heads=5", "does not build from its kwargs"),
    ("clip", "model_config.clip.image_encoder.params.model_name=vit_tinyy", "unknown model_name 'vit_tinyy'"),
    ("clip", "model_config.clip.text_encoder.type=bert", "text_encoder.type=bert needs text_encoder.pretrained_path"),
    ("clip", ["model_config.clip.text_encoder.type=bert", "model_config.clip.text_encoder.pretrained_path={files}/lm_not_json"],
     "text_encoder.pretrained_path="),
    ("concat_bert", ["dataset_config.easy_vqa.val_images=0", "run_type=train_val"], "val_images is 0, so there is no val split"),
]
for model, workload in GENERATIVE.items():  # decoding settings: used at evaluation and prediction, checked at start
    for key, value in (("max_new_tokens", 0), ("max_new_tokens", -3), ("num_beams", 0), ("num_beams", 1.5)):
        ROWS.append((workload, f"model_config.{model}.generation.{key}={value}", f"generation.{key}"))
# LoRA through peft
ROWS += [("vlm", [VLM + "lora.r=2", VLM + "lora.target_modules=[nope_proj]"],
          "lora: target_modules=['nope_proj'] on part 'language_model'"),
         ("vlm", VLM + "lora.r=0", "model_config.vlm.lora.r=0 must be an integer of 1 or more"),
         ("vlm", [VLM + "lora.r=2", VLM + "lora.parts=[image_encoder]"], "on part 'image_encoder'"),
         ("vlm", [VLM + "lora.r=2", VLM + "lora.parts=[vision]"], "model_config.vlm.lora.parts: vlm has no part 'vision'"),
         ("clip", ["model_config.clip.lora.r=2", "model_config.clip.lora.alpha=0"], "model_config.clip.lora.alpha=0")]
# LLaVA conversations: each bad record of the training file, a template without assistant turns, a missing split
_TRAIN = "dataset_config.llava.annotations.train={files}/llava/"
ROWS += [("llava", _TRAIN + "gpt_first.json", "sample 'a': the first turn is not the user's"),
         ("llava", _TRAIN + "two_humans.json", "sample 'b': turn 1 is the user's after the user's"),
         ("llava", _TRAIN + "placeholder_without_image.json", "sample 'c': <image> appears, but the sample has no image"),
         ("llava", _TRAIN + "image_without_placeholder.json", "sample 'd': it has an image and 0 <image> placeholders"),
         ("llava", _TRAIN + "missing_image.json", "train sample 'e': image '{files}/llava/images/red/999.png' does not exist"),
         ("llava", [_TRAIN + "long.json", "dataset_config.llava.processors.text_processor.params.on_too_long=error",
                    "dataset_config.llava.processors.text_processor.params.max_length=48"],
          "train sample 'f': 103 tokens with the image tokens exceed max_length=48"),
         ("llava", "dataset_config.llava.processors.text_processor.params.tokenizer_path={files}/llava/silent_tok",
          "chat_template renders no assistant turn"),
         ("llava", "dataset_config.llava.annotations.val=null", "annotations.val is not set, and the run uses the val split"),
         ("llava", "dataset_config.llava.on_bad_image=skip", "Unknown config key 'dataset_config.llava.on_bad_image'")]
# released VLMs (hf_vlm): the folder, what it holds, the placeholders, the image tokens against max_length
_HV, _HVP = "model_config.hf_vlm.path={files}/hf_vlm/", "dataset_config.llava.processors.text_processor.params."
ROWS += [("hf_vlm", _HV + "nothing_here", "path='{files}/hf_vlm/nothing_here' is not a folder"),
         ("hf_vlm", _HV + "causal_lm", "holds a llama model, not an image-text-to-text VLM; for a causal LM use model: vlm"),
         ("hf_vlm", _HV + "no_processor", "has no VLM processor"),
         ("hf_vlm", _HV + "no_template", "has no chat template; set processor.chat_template"),
         ("hf_vlm", "dataset_config.llava.annotations.train={files}/hf_vlm/data/two_images_one_placeholder.json",
          "sample 'p': it has 2 images and 1 <image> placeholders"),
         ("hf_vlm", _HVP + "max_length=12", "train sample 'train0': its image tokens end at token 18, after max_length=12"),
         ("hf_vlm", [_HVP + "max_length=24", _HVP + "on_too_long=error"],
          "train sample 'train0': 27 tokens with the image tokens exceed max_length=24")]
# Hugging Face datasets on disk: the folder, the globs, the columns, the images, the split names
_HF = "dataset_config.hf_dataset."
_PARQUET = [_HF + "path=null", _HF + "splits.val=null", _HF + "data_files.train={files}/hf/parquet/train-*.parquet"]
ROWS += [("hf_dataset", _HF + "path={files}/hf/nothing_here", "path='{files}/hf/nothing_here' is not a folder"),
         ("hf_dataset", _HF + "path=HuggingFaceM4/the_cauldron", "it looks like a hub name: download it first"),
         ("hf_dataset", [*_PARQUET, _HF + "data_files.val={files}/hf/parquet/valid-*.parquet"],
          "data_files.val='{files}/hf/parquet/valid-*.parquet' matches no file"),
         ("hf_dataset", _HF + "columns.texts=conversation",
          "task conversation reads column(s) texts -> 'conversation', and the dataset has images, texts"),
         ("hf_dataset", _HF + "columns.captions=texts", "columns ['captions'] are not keys of task conversation"),
         ("hf_dataset", [_HF + "task=vqa", "{image: texts, question: texts, answer: texts}".join(
             [_HF + "columns=", ""])], "an image cell holds list"),
         ("hf_dataset", _HF + "splits.val=validation", "has no split 'validation' (it has train, test)")]
# generation inside evaluation: the cap, the best-checkpoint criteria, a generation metric on a classifier
ROWS += [("vlm", f"evaluation.generate_max_samples={n}", "'evaluation.generate_max_samples' in command line must be "
          "a positive integer or null") for n in (0, -4)]
ROWS.append(("vlm", "training.early_stop.criteria=easy_vqa_generative/bleu4",
             "training.early_stop.criteria='easy_vqa_generative/bleu4': the run does not compute 'bleu4'"))
for workload in sorted(set(WORKLOADS) - {"vlm", "llava", "hf_dataset", "hf_vlm"}):  # the workloads of a model that does not generate
    ROWS.append((workload, "evaluation.metrics=[cider]", "score generated text, and model"))
for workload in WORKLOADS:  # EMA, layer decay and parameter groups: every workload
    ROWS += [(workload, "training.ema.decay=-1", "training.ema.decay=-1.0 must be in (0, 1)"),
             (workload, "training.ema.decay=1.5", "training.ema.decay=1.5 must be in (0, 1)"),
             (workload, "optimizer.layer_decay=0", "optimizer.layer_decay=0.0 must be in (0, 1]"),
             (workload, "optimizer.layer_decay=3", "optimizer.layer_decay=3.0 must be in (0, 1]"),
             (workload, "optimizer.param_groups=[{match: 'nothing_here*', lr_scale: 0.1}]",
              "optimizer.param_groups[0].match='nothing_here*' matches no parameter of the model")]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A tiny easy-VQA, tiny CLIP shards, and model folders that do not load."""
    from PIL import Image

    from mmvl.data.shard_writer import write_shards

    root = tmp_path_factory.mktemp("workloads")
    write_easy_vqa_root(root / "easy_vqa", {"train": (TRAIN, 4), "test": (TEST, 2)})
    write_llava(root / "llava", train=8, val=4)
    write_cauldron(root / "hf", train=8, test=4)
    make_chat_lm(root / "llava" / "silent_tok", template="{% for m in messages %}{% if m['role'] == 'user' %}"
                 "{{ m['content'] }}{% endif %}{% endfor %}")
    human, gpt = (lambda v: {"from": "human", "value": v}), (lambda v: {"from": "gpt", "value": v})
    bad = {"gpt_first": {"id": "a", "conversations": [gpt("red"), human("what color")]},
           "two_humans": {"id": "b", "conversations": [human("what"), human("color"), gpt("red")]},
           "placeholder_without_image": {"id": "c", "conversations": [human("<image> what color"), gpt("red")]},
           "image_without_placeholder": {"id": "d", "image": "red/0.png", "conversations": [human("what"), gpt("red")]},
           "missing_image": {"id": "e", "image": "red/999.png", "conversations": [human("<image> what"), gpt("red")]},
           "long": {"id": "f", "image": "red/0.png", "conversations": [human("<image> " + "what color " * 40), gpt("red")]}}
    for name, record in bad.items():  # each after a good record, as a file someone else wrote would have it
        good = json.loads((root / "llava" / "train.json").read_text())[0]
        (root / "llava" / f"{name}.json").write_text(json.dumps([good, record]))
    _released_vlm_folders(root / "hf_vlm")
    (root / "lm_empty").mkdir()
    (root / "lm_not_json").mkdir()
    (root / "lm_not_json" / "config.json").write_text("{not json")
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for split, n in (("train", 8), ("val", 4)):
        lines = []
        for k in range(n):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3)).astype(np.uint8)).save(root / "images" / f"{split}{k}.png")
            lines.append(json.dumps({"image": f"{split}{k}.png", "caption": f"a red square {k}"}))
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        write_shards(root / "images", root / f"{split}.jsonl", root / "data" / "shards", prefix=split,
                     samples_per_shard=8)
    return root


def _released_vlm_folders(root: Path) -> None:
    """A tiny LLaVA folder and its set, and folders a user might give instead: a causal LM, a model
    without its processor, a processor without a chat template."""
    import shutil

    model = make_llava(root / "model")
    data = write_llava_set(root / "data")
    make_chat_lm(root / "causal_lm")
    (root / "no_processor").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, root / "no_processor" / name)
    shutil.copytree(model, root / "no_template")
    (root / "no_template" / "chat_template.jinja").unlink()
    record = {"id": "p", "image": ["red.png", "blue.png"],
              "conversations": [{"from": "human", "value": "<image>\nwhat color"}, {"from": "gpt", "value": "red"}]}
    good = json.loads((data / "train.json").read_text())[0]
    (data / "two_images_one_placeholder.json").write_text(json.dumps([good, record]))


def _run(files: Path, save: Path, workload: str, extra: list[str], capsys) -> tuple[int, str]:
    code = main(WORKLOADS[workload].opts(files, save) + [e.replace("{files}", str(files)) for e in extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_the_workload_trains_as_configured(workload, files, tmp_path, capsys):
    code, err = _run(files, tmp_path / "save", workload, [], capsys)
    assert code == 0, err
    assert (tmp_path / "save" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("row", ROWS, ids=[f"{w}: {o if isinstance(o, str) else ' '.join(o)}" for w, o, _ in ROWS])
def test_hostile_input_is_one_line_before_the_first_update(row, files, tmp_path, capsys):
    workload, override, needle = row
    save = tmp_path / "save"
    code, err = _run(files, save, workload, [override] if isinstance(override, str) else list(override), capsys)
    assert code == 2, err
    assert_one_line(err, needle.replace("{files}", str(files)), roots=(tmp_path, files))
    written = sorted(str(p.relative_to(save)) for p in save.rglob("*") if p.is_file()) if save.exists() else []
    assert set(written) <= {"train.log", LOCK}, written  # nothing but the log: no update ran


def test_every_generative_model_has_a_workload():
    generative = {n for n in registry.MODELS.names() if callable(getattr(registry.MODELS.get(n), "generate", None))}
    assert generative == set(GENERATIVE)


@pytest.mark.parametrize("name", registry.OPTIMIZERS.names())
def test_a_parameter_group_rule_that_matches_nothing_is_refused_by_every_optimizer(name):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    rules = [{"match": "1", "lr_scale": 0.5}, {"match": "0.weight", "lr_scale": 0.1}]  # a frozen match still counts
    build_optimizer(model, schema.Optimizer(type=name, params={"lr": 0.1}, param_groups=rules))
    typo = rules + [{"match": "2*", "lr_scale": 0.1}]
    with pytest.raises(UserError, match=r"param_groups\[2\].match='2\*' matches no parameter .*top-level parts: 0, 1"):
        build_optimizer(model, schema.Optimizer(type=name, params={"lr": 0.1}, param_groups=typo))
