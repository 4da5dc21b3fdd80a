"""``mmvl_export hf``: an hf_vlm run (LLaVA, Idefics3, Qwen2-VL; with and without LoRA) as a transformers
folder that a fresh process loads with ``AutoModelForImageTextToText`` and ``AutoProcessor`` alone, and
whose greedy answers on the run's test split, from the folder's own chat template and processor, are
``mmvl_predict``'s; and the refusals, one line each."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmvl_cli.export import main as export
from mmvl_cli.predict import main as predict
from mmvl_cli.run import main as run
from tests.fixtures.released_vlms import folder_maker

ROOT = Path(__file__).resolve().parents[2]

#: what a user runs in another process: transformers alone, the folder's template and processor
FRESH = r"""
import json, sys
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

folder, data = sys.argv[1], sys.argv[2]
model = AutoModelForImageTextToText.from_pretrained(folder).eval()
if len(sys.argv) > 3:  # the adapters beside the source weights, unmerged
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, sys.argv[3]).eval()
processor = AutoProcessor.from_pretrained(folder)
answers = []
for record in json.load(open(f"{data}/val.json")):
    turns = record["conversations"][:-1]
    messages = []
    for turn in turns:
        role = "user" if turn["from"] == "human" else "assistant"
        items = []
        for k, text in enumerate(turn["value"].split("<image>")):
            if k:
                items.append({"type": "image"})
            if text.strip():
                items.append({"type": "text", "text": text.strip()})
        messages.append({"role": role, "content": items})
    paths = record["image"] if isinstance(record.get("image"), list) else [record["image"]]
    images = [Image.open(f"{data}/images/{p}").convert("RGB") for p in paths]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    end = model.generation_config.eos_token_id
    new = new[: new.index(end)] if end in new else new
    answers.append(processor.tokenizer.decode(new, skip_special_tokens=True).strip())
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(arch) -> (model folder, data folder)``, each written once."""
    return folder_maker(tmp_path_factory.mktemp("export_hf"))


def _keys(model: Path, data: Path, save: Path, *extra: str) -> list[str]:
    return ["config=projects/hf_vlm/configs/defaults.yaml", f"model_config.hf_vlm.path={model}", "datasets=llava",
            f"dataset_config.llava.annotations.train={data}/train.json", f"dataset_config.llava.annotations.val={data}/val.json",
            f"dataset_config.llava.annotations.test={data}/val.json", f"dataset_config.llava.image_folder={data}/images",
            "model_config.hf_vlm.freeze=[]", "model_config.hf_vlm.generation.max_new_tokens=5", "optimizer.params.lr=3e-3",
            "scheduler.type=null", "training.max_updates=20", "training.checkpoint_interval=20",
            "training.batch_size=4", "training.num_workers=0", f"env.save_dir={save}", *extra]


@pytest.mark.proc  # a fresh Python process loads the folder (~5 s each)
@pytest.mark.parametrize("arch, lora", [("llava", False), ("llava", True), ("idefics3", False), ("qwen2_vl", False),
                                        ("qwen2_vl", True)])
def test_the_exported_folder_loads_alone_and_answers_as_mmvl_predict(arch, lora, folders, tmp_path):
    model, data = folders(arch)
    extra = ["model_config.hf_vlm.lora.r=4", "model_config.hf_vlm.lora.parts=[language_model,vision]"] if lora else []
    keys = _keys(model, data, tmp_path / "save", *extra)
    assert run([*keys, "run_type=train"]) == 0
    assert predict(keys) == 0
    predicted = [r["answer"] for r in json.loads((tmp_path / "save" / "predictions" / "llava_test.json").read_text())]
    assert export(["hf", str(tmp_path / "save"), str(tmp_path / "out")]) == 0
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "generation_config.json", "chat_template.jinja", "model.safetensors"} <= written
    proc = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "out"), str(data)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == predicted
    assert any(predicted)  # the trained model says something
    if lora:  # unmerged: the source weights and the adapters beside them
        assert export(["hf", str(tmp_path / "save"), str(tmp_path / "kept"), "--adapters"]) == 0
        proc = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "kept"), str(data),
                               str(tmp_path / "kept" / "adapters")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == predicted


def test_refusals_are_one_line(folders, tmp_path, capsys):
    model, data = folders("llava")
    assert run(_keys(model, data, tmp_path / "save", "training.max_updates=2", "training.checkpoint_interval=2",
                     "run_type=train")) == 0
    capsys.readouterr()
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes((tmp_path / "save" / "checkpoints" / "last.ckpt").read_bytes()[:200])
    other = tmp_path / "other"  # a run of a model that cannot be written as a transformers folder
    other.mkdir()
    (other / "config.yaml").write_text("model: relation_network\n")
    gone = tmp_path / "gone"  # a run whose processor folder is gone
    gone.mkdir()
    config = (tmp_path / "save" / "config.yaml").read_text()
    (gone / "config.yaml").write_text(config.replace(str(model), str(tmp_path / "nowhere")))
    cases = {
        "not a run": (["hf", str(tmp_path), str(tmp_path / "o1")], "has no config.yaml"),
        "existing OUT": (["hf", str(tmp_path / "save"), str(tmp_path / "save")], "exists; give a new folder"),
        "missing checkpoint": (["hf", str(tmp_path / "save"), str(tmp_path / "o2"), "--best"], "is not a checkpoint"),
        "corrupt checkpoint": (["hf", str(tmp_path / "save"), str(tmp_path / "o3"), "--checkpoint", str(torn)], "torn.ckpt"),
        "a model that cannot be": (["hf", str(other), str(tmp_path / "o4")], "relation_network' cannot be written"),
        "processor gone": (["hf", str(gone), str(tmp_path / "o5"), "--checkpoint",
                            str(tmp_path / "save" / "checkpoints" / "last.ckpt")], "nowhere' is not a folder"),
        "adapters of no LoRA": (["hf", str(tmp_path / "save"), str(tmp_path / "o6"), "--adapters"], "trained no LoRA"),
    }
    for name, (args, needle) in cases.items():
        assert export(args) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (name, err)
        assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir()), name  # nothing left behind
