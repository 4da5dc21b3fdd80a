"""``mmvl_export hf`` of a run of mmvl's own ``vlm`` on an ``hf_vision`` tower: a
``LlavaForConditionalGeneration`` folder that a fresh process loads with the two Auto classes alone and
whose greedy answers on the run's test split are ``mmvl_predict``'s; the processor's pieces (the
image processor from the dataset's transforms, the chat template reading structured content) make
the run's inputs; a vlm that does not map onto LLaVA is refused in one line naming what blocks it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmvl.errors import UserError
from mmvl_cli.export import main as export
from mmvl_cli.predict import main as predict
from mmvl_cli.run import main as run
from tests.export.test_export_hf import FRESH
from tests.fixtures.released_vlms import write_llava_set
from tests.fixtures.tiny_vlm import CHATML, make_chat_lm
from tests.fixtures.vision_towers import IMAGE_SIZE, make_tower

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "projects" / "vlm" / "configs" / "llava" / "clip.yaml"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_llava")
    towers = {kind: make_tower(root / kind, kind) for kind in ("clip", "clip_vision_model", "siglip_vision_model")}
    return {"towers": towers, "lm": make_chat_lm(root / "lm"), "data": write_llava_set(root / "data")}


def _keys(files, save: Path, tower: str = "clip_vision_model", *extra: str) -> list[str]:
    data = files["data"]
    return [f"config={CONFIG}", f"model_config.vlm.image_encoder.params.path={files['towers'][tower]}",
            f"model_config.vlm.language_model.path={files['lm']}", f"dataset_config.llava.annotations.train={data}/train.json",
            f"dataset_config.llava.annotations.val={data}/val.json", f"dataset_config.llava.annotations.test={data}/val.json",
            f"dataset_config.llava.image_folder={data}/images", f"dataset_config.llava.image_size={IMAGE_SIZE}",
            "dataset_config.llava.processors.text_processor.params.image_tokens=16",
            "dataset_config.llava.processors.text_processor.params.max_length=128", "model_config.vlm.freeze=[]",
            "model_config.vlm.generation.max_new_tokens=5", "optimizer.params.lr=3e-3", "training.max_updates=20",
            "training.checkpoint_interval=20", "training.batch_size=4", "training.num_workers=0",
            "training.progress_bar=false", f"env.save_dir={save}", *extra]


@pytest.mark.proc  # a fresh Python process loads the folder (~5 s)
@pytest.mark.parametrize("tower, extra", [
    ("clip_vision_model", []),
    ("clip", ["model_config.vlm.lora.r=4"]),  # a whole CLIP folder's vision half; LoRA on the LM, merged
    ("siglip_vision_model", ["model_config.vlm.image_encoder.params.vision_feature_select_strategy=full",
                             "model_config.vlm.image_encoder.params.vision_feature_layer=[-3,-1]"])])
def test_the_exported_llava_folder_loads_alone_and_answers_as_mmvl_predict(files, tower, extra, tmp_path):
    keys = _keys(files, tmp_path / "save", tower, *extra)
    assert run([*keys, "run_type=train"]) == 0
    assert predict(keys) == 0
    predicted = [r["answer"] for r in json.loads((tmp_path / "save" / "predictions" / "llava_test.json").read_text())]
    assert export(["hf", str(tmp_path / "save"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    proc = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "out"), str(files["data"])], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == predicted
    assert any(predicted)


def test_the_image_processor_makes_the_pipeline_s_pixels():
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessor

    from mmvl.data.processors.image import TorchvisionTransforms, hf_image_processor_kwargs

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8))
    normalize = {"type": "Normalize", "params": {"mean": [0.4, 0.5, 0.6], "std": [0.2, 0.3, 0.25]}}
    scale = {"type": "ToDtype", "params": {"dtype": "float32", "scale": True}}
    for interpolation in ("bilinear", "bicubic"):
        resize = {"type": "Resize", "params": {"size": [32, 48], "interpolation": interpolation}}
        for transforms, within in (([resize, "ToImage", scale, normalize], 2 / 255 / 0.2 + 1e-5),  # PIL resamples
                                   (["ToImage", resize, scale, normalize], 1e-5)):
            ours = TorchvisionTransforms(transforms)(image)
            theirs = CLIPImageProcessor(**hf_image_processor_kwargs(transforms, "t"))(image, return_tensors="pt")
            assert ours.shape == theirs["pixel_values"][0].shape == (3, 32, 48)
            assert (ours - theirs["pixel_values"][0]).abs().max() <= within, (interpolation, transforms[0])


@pytest.mark.parametrize("transforms, needle", [
    (["ToImage", {"type": "Resize", "params": {"size": 32}}], "Resize("),
    (["ToImage", {"type": "CenterCrop", "params": {"size": 32}}], "CenterCrop (transform 1)"),
    (["ToImage", "RandomHorizontalFlip"], "RandomHorizontalFlip"),
    (["ToImage", {"type": "Normalize", "params": {"mean": [0.5] * 3, "std": [0.5] * 3}}], "Normalize (transform 1)"),
])
def test_a_pipeline_without_a_transformers_equivalent_is_one_line(transforms, needle):
    from mmvl.data.processors.image import hf_image_processor_kwargs

    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        hf_image_processor_kwargs(transforms, "dataset_config.llava.processors.image_processor.params.transforms")


def test_the_template_renders_structured_content_as_the_run_rendered_its_text(files):
    """What lmms-eval and vLLM send (image items) renders as the run's samples did (placeholders ahead of
    the text, each on its line), and plain text renders as the tokenizer's own template."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from mmvl.data.processors.chat import image_first
    from mmvl.export.llava import structured_template

    env = ImmutableSandboxedEnvironment()
    ours, theirs = env.from_string(structured_template(CHATML, "<image>")), env.from_string(CHATML)
    turns = [{"role": "user", "content": "what color\n<image>"}, {"role": "assistant", "content": "red"},
             {"role": "user", "content": "<image> <image>\nwhat shape"}]
    items = [{"role": "user", "content": [{"type": "text", "text": "what color"}, {"type": "image"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
             {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what shape"}]}]
    want = theirs.render(messages=image_first(turns, "<image>"), add_generation_prompt=True)
    assert ours.render(messages=items, add_generation_prompt=True) == want
    assert ours.render(messages=image_first(turns, "<image>"), add_generation_prompt=True) == want
    with pytest.raises(UserError, match="cannot be written into a chat template"):
        structured_template(CHATML, "<im'age>")


def _fake_run(folder: Path, model_cfg: dict, text_params: dict, image: dict | None = None) -> Path:
    """A save dir with a vlm run's config.yaml and a checkpoint file (refused before it is read)."""
    import yaml

    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"not read")
    from omegaconf import OmegaConf

    image = image or {"type": "torchvision_transforms", "params": {"transforms": ["ToImage"]}}
    shipped = OmegaConf.load(ROOT / "configs" / "models" / "vlm.yaml").model_config.vlm  # a saved config holds it all
    model_cfg = OmegaConf.to_container(OmegaConf.merge(shipped, model_cfg))
    config = {"model": "vlm", "model_config": {"vlm": model_cfg}, "dataset_config": {"llava": {"processors": {
        "text_processor": {"type": "prompt_answer", "params": text_params}, "image_processor": image}}}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_a_vlm_that_does_not_map_onto_llava_is_one_line(files, tmp_path, capsys):
    tower = {"type": "hf_vision", "params": {"path": str(files["towers"]["clip_vision_model"])}}
    text = {"image_tokens": 16, "tokenizer_path": str(files["lm"])}
    plain = make_chat_lm(tmp_path / "plain_lm", template=CHATML)  # then its template removed
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((plain / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tok_config))
    capsys.readouterr()
    cases = {
        "cnn": ({"image_encoder": {"type": "cnn"}}, text, None, "image_encoder cnn"),
        "shuffle": ({"image_encoder": tower, "pixel_shuffle": 2}, text, None, "pixel_shuffle 2"),
        "summary": ({"image_encoder": tower, "summary_token": True}, text, None, "summary_token true"),
        "projector": ({"image_encoder": tower, "projector_layers": 1}, text, None, "projector_layers 1"),
        "words": ({"image_encoder": tower}, {"image_tokens": 16}, None, "has no tokenizer_path"),
        "no template": ({"image_encoder": tower}, {"image_tokens": 16, "tokenizer_path": str(plain)}, None,
                        "has no chat_template"),
        "tokenizer gone": ({"image_encoder": tower}, {"image_tokens": 16, "tokenizer_path": str(tmp_path / "nowhere")},
                           None, "nowhere' is not a folder"),
        "tower gone": ({"image_encoder": {"type": "hf_vision", "params": {"path": str(tmp_path / "no_tower")}},
                        "language_model": {"path": str(files["lm"])}}, text, None, "no_tower' is not a folder"),
        "random flips": ({"image_encoder": tower}, text, {"type": "torchvision_transforms", "params": {
            "transforms": ["ToImage", "RandomHorizontalFlip"]}}, "RandomHorizontalFlip"),
    }
    for name, (model_cfg, params, image, needle) in cases.items():
        save = _fake_run(tmp_path / name, model_cfg, params, image)
        assert export(["hf", str(save), str(tmp_path / f"{name}_out")]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (name, err)
        assert not (tmp_path / f"{name}_out").exists()
    save = _fake_run(tmp_path / "adapters", {"image_encoder": tower, "lora": {"r": 4}}, text)
    assert export(["hf", str(save), str(tmp_path / "o"), "--adapters"]) == 2
    assert "a vlm run exports as LLaVA" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [False, True])
def test_the_llava_module_maps_the_weights_exactly(files, tmp_path, tied):
    """In memory: the exported LLaVA's logits on a batch with two images and a text-only row equal the vlm's
    (an LM folder; a random LM whose output head is its input embeddings)."""
    from omegaconf import OmegaConf

    from mmvl.export.llava import _llava
    from mmvl.models.vlm import VLM

    cfg = OmegaConf.load(ROOT / "configs" / "models" / "vlm.yaml").model_config.vlm
    cfg.image_encoder = {"type": "hf_vision", "params": {"path": str(files["towers"]["clip"]),
                                                         "vision_feature_layer": [-2, 0]}}
    cfg.language_model.path = None if tied else str(files["lm"])
    cfg.language_model.random.tie_word_embeddings = tied
    cfg.update(vocab_size=40, image_token_id=4, pad_token_id=0, eos_token_id=3, image_tokens=16)
    torch.manual_seed(0)
    vlm = VLM(cfg).eval()
    llava = _llava(vlm)
    assert (llava.lm_head.weight.data_ptr() == llava.get_input_embeddings().weight.data_ptr()) == tied
    ids = torch.tensor([[5, 4] + [4] * 15 + [4] * 16 + [6, 7], [5, 6, 7, 8] + [9] * 31])
    pixels = torch.randn(2, 2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        ours = vlm({"input_ids": ids, "image": pixels, "attention_mask": torch.ones_like(ids)})["scores"]
        theirs = llava(input_ids=ids, pixel_values=pixels[0], attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
