"""Compact records: a dataset's Python objects do not grow with its samples (DataLoader workers then
copy nothing as they read), the parsed split is cached and mapped, and items are what they were."""
from __future__ import annotations

import gc
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import mmvl.data.datasets  # noqa: F401  (registers every dataset)
from mmvl import registry
from mmvl.data.records import Table
from tests.fixtures.vl_data import write_image

ROOT = Path(__file__).resolve().parents[3]


def _owned(obj, skip) -> int:
    """How many Python objects ``obj`` reaches, not counting classes, modules, functions or ``skip``."""
    seen, stack = set(), [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue
        if any(o is s for s in skip):
            continue
        seen.add(id(o))
        stack.extend(gc.get_referents(o))
    return len(seen)


def _vqa(root: Path, n: int) -> None:
    base = root / "vqa2"
    base.mkdir(parents=True)
    questions = [{"image_id": 1 + i % 3, "question": f"what is thing {i}?", "question_id": 100 + i} for i in range(n)]
    annotations = [{"question_id": 100 + i, "answers": [{"answer": f"a{i % 7}"}] * 6 + [{"answer": "Yes."}] * 4}
                   for i in range(n)]
    (base / "q.json").write_text(json.dumps({"questions": questions}))
    (base / "a.json").write_text(json.dumps({"annotations": annotations}))
    for k in range(3):
        write_image(base / "img" / f"{1 + k}.jpg", "red", (8, 8))


def _hateful(root: Path, n: int) -> None:
    base = root / "hateful_memes"
    base.mkdir(parents=True)
    (base / "train.jsonl").write_text("".join(json.dumps({"id": i, "img": "img/1.png", "text": f"meme {i}",
                                                          "label": i % 2}) + "\n" for i in range(n)))
    write_image(base / "img" / "1.png", "blue", (8, 8), fmt="PNG")


def _coco(root: Path, n: int) -> None:
    base = root / "coco"
    images = [{"id": k, "file_name": f"{k}.jpg"} for k in range(3)]
    anns = [{"id": i, "image_id": i % 3, "caption": f"caption {i}"} for i in range(n)]
    (base / "annotations").mkdir(parents=True)
    (base / "annotations" / "captions_train2014.json").write_text(json.dumps({"images": images, "annotations": anns}))
    for k in range(3):
        write_image(base / "images" / "train2014" / f"{k}.jpg", "green", (8, 8))


CONFIGS = {
    "vqa2": {"splits": {"train": {"questions": "q.json", "annotations": "a.json", "images": "img",
                                  "image_pattern": "{image_id}.jpg"}}, "image_size": 8},
    "hateful_memes": {"image_size": 8},
    "coco_captions": {"image_size": 8},
}
WRITERS = {"vqa2": _vqa, "hateful_memes": _hateful, "coco_captions": _coco}


def _builder(name: str, root: Path, **extra):
    cfg = OmegaConf.load(ROOT / "configs" / "datasets" / f"{name}.yaml").dataset_config[name]
    cfg = OmegaConf.merge(cfg, OmegaConf.create({**CONFIGS[name], **extra}))
    if name == "vqa2":
        cfg.splits.val = None
    return registry.DATASETS.get(name)(cfg, str(root))


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_python_objects_do_not_grow_with_the_samples(tmp_path, name):
    counts = []
    for n in (20, 600):
        WRITERS[name](tmp_path / str(n), n)
        builder = _builder(name, tmp_path / str(n))
        ds = builder.build("train")
        assert len(ds) == n
        ds[n - 1]  # noqa: B018  (reading does not create lasting objects either)
        counts.append(_owned(ds, [ds.text_processor, ds.image_processor, ds.features_processor,
                                  getattr(ds, "answer_processor", None)]))
    assert counts[0] == counts[1], counts


def test_sort_of_clevr_objects_do_not_grow(tmp_path):
    counts = []
    for images in (2, 12):
        b = registry.DATASETS.get("sort_of_clevr")(OmegaConf.create({"num_images": images, "num_val_images": 1,
                                                                       "num_test_images": 1}), str(tmp_path))
        b.prepare()
        ds = b.build("train")
        counts.append(_owned(ds, [ds.text_processor]))
    assert counts[0] == counts[1], counts


def test_vqa2_second_builder_maps_the_cache_and_gives_the_same_items(tmp_path, monkeypatch):
    _vqa(tmp_path, 30)
    first = _builder("vqa2", tmp_path)
    items = [first.build("train")[i] for i in range(30)]
    calls = []
    monkeypatch.setattr(type(first), "load_records", lambda self, split: calls.append(split))
    second = _builder("vqa2", tmp_path)
    again = second.build("train")
    assert calls == []  # nothing parsed: the split and both vocabularies come from the cache
    assert isinstance(again.questions.data.base, np.memmap) or isinstance(again.questions.data, np.memmap)
    assert second.answer_processor.vocab == first.answer_processor.vocab
    assert second.text_processor.itos == first.text_processor.itos
    for i, item in enumerate(items):
        other = again[i]
        assert other.keys() == item.keys()
        for k, v in item.items():
            assert torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k], k
    # the targets are exactly what the answer processor makes of the raw human answers
    raw = [["a0"] * 6 + ["Yes."] * 4]
    assert torch.equal(items[0]["targets"], first.answer_processor(raw[0])["targets"])


def test_cache_dir_setting_and_stale_source(tmp_path):
    _hateful(tmp_path / "data", 5)
    b = _builder("hateful_memes", tmp_path / "data")
    b.cache_dir = str(tmp_path / "cache")
    assert len(b.build("train")) == 5
    assert any((tmp_path / "cache" / "hateful_memes").iterdir())
    assert not (tmp_path / "data" / ".mmvl_cache").exists()
    _hateful(tmp_path / "data2", 5)
    (tmp_path / "data2" / "hateful_memes" / "train.jsonl").write_text(
        (tmp_path / "data2" / "hateful_memes" / "train.jsonl").read_text().replace("meme 0", "changed"))
    b2 = _builder("hateful_memes", tmp_path / "data2")  # default: next to the data
    assert b2.build("train")[0]["id"] == 0 and (tmp_path / "data2" / ".mmvl_cache" / "hateful_memes").is_dir()
    assert isinstance(b2.records("train"), Table)
