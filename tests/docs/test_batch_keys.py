"""The batch-key table of docs/research_project.md against real batches of every registered dataset."""
from __future__ import annotations

import re

import numpy as np
from torch.utils.data import IterableDataset
import pytest
import torch

import mmvl  # noqa: F401  (registers the built-in datasets)
from mmvl.build import build_datasets
from mmvl.config import load_config
from mmvl.data.sample import PADDED
from mmvl.registry import DATASETS
from tests.fixtures.hf_files import write_cauldron
from tests.fixtures.llava_files import write_llava
from tests.fixtures.vl_data import write_all

from tests.docs.test_docs import DOCS

PAGE = DOCS / "research_project.md"
_KEY = re.compile(r"`(\w+)`(?: \[([^\]]+)\])?")
_SOC = ["dataset_config.sort_of_clevr.num_images=4", "dataset_config.sort_of_clevr.num_val_images=2",
        "dataset_config.sort_of_clevr.num_test_images=2"]


def table() -> dict[str, list[str]]:
    """dataset -> its row's cells after the name."""
    rows = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def keys_and_shapes(cell: str) -> dict[str, list[str] | None]:
    return {k: [d.strip() for d in dims.split(",")] if dims else None for k, dims in _KEY.findall(cell)}


def builtin_datasets() -> list[str]:
    return sorted(n for n in DATASETS.names() if DATASETS.get(n).__module__.startswith("mmvl."))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_all(root)
    write_llava(root / "llava", train=4, val=4)
    write_cauldron(root / "hf", train=4, test=4)
    return root


def _llava(data_dir) -> list[str]:
    """llava's files: LLaVA JSON (val's file serves test too), images, a tokenizer with a chat template."""
    d = "dataset_config.llava"
    return [f"{d}.annotations.train={data_dir}/llava/train.json", f"{d}.annotations.val={data_dir}/llava/val.json",
            f"{d}.annotations.test={data_dir}/llava/val.json", f"{d}.image_folder={data_dir}/llava/images",
            f"{d}.processors.text_processor.params.tokenizer_path={data_dir}/llava/tok"]


def _features_lmdb(root, builder, splits) -> str:
    """An mmvl feature LMDB (3 regions of size 8, with boxes) for every image the splits name."""
    from mmvl.data.features.lmdb_store import LMDBFeatureWriter

    path = str(root / f"features_{builder}.lmdb")
    with LMDBFeatureWriter(path, overwrite=True) as writer:
        for image in sorted(p for p in root.rglob("*") if p.suffix in (".jpg", ".png")):
            writer.put(image.stem, np.ones((3, 8), np.float32), boxes=np.array([[0, 0, 4, 4]] * 3, np.float32),
                       image_width=8, image_height=8)
    return path


def _batch(name, data_dir, split, *extra):
    config = load_config(["model=visual_bert", f"datasets={name}", f"env.data_dir={data_dir}", *(_SOC if name == "sort_of_clevr" else [k.replace("sort_of_clevr.", f"{name}.") for k in _SOC]
                                                                 if name == "sort_of_clevr_generative" else []),
                          *(_llava(data_dir) if name == "llava" else []),
                          *([f"dataset_config.hf_dataset.path={data_dir}/hf/disk", "dataset_config.hf_dataset.splits.val=test",
                             f"dataset_config.hf_dataset.processors.text_processor.params.tokenizer_path={data_dir}/llava/tok"]
                            if name == "hf_dataset" else []), *extra])
    builder = build_datasets(config)[name]
    builder.prepare()
    dataset = builder.build(split)
    if isinstance(dataset, IterableDataset):  # shards: the first batch of the training stream
        from mmvl.data.shard_stream import train_stream

        return next(train_stream(dataset, batch_size=2, collate_fn=builder.collate, seed=0, rank=0, world_size=1))
    return builder.collate([dataset[0], dataset[1]])


def check(batch: dict, expected: dict[str, list[str] | None], where: str) -> None:
    assert isinstance(batch.get(PADDED), bool), f"{where}: no {PADDED!r} flag (the text under the table says so)"
    keys = set(batch) - {PADDED}
    assert keys == set(expected), f"{where}: the batch has {sorted(keys)}, the table says {sorted(expected)}"
    for key, dims in expected.items():
        if dims is None:
            continue
        shape = tuple(batch[key].shape)
        assert len(shape) == len(dims), f"{where}: {key} has shape {shape}, the table says {dims}"
        for got, want in zip(shape, dims):
            assert not want.isdigit() or got == int(want), f"{where}: {key} has shape {shape}, the table says {dims}"
        if dims[0] == "B":
            assert shape[0] == 2, f"{where}: {key} is not batched"


def test_the_table_lists_every_registered_dataset():
    assert sorted(table()) == builtin_datasets()


@pytest.mark.parametrize("name", builtin_datasets())
def test_table_row_matches_real_batches(name, data_dir):
    keys, test_cell, features_cell = table()[name]
    expected = keys_and_shapes(keys)
    for split in ("train", "val"):
        check(_batch(name, data_dir, split), expected, f"{name} {split}")
    if test_cell == "same keys":
        check(_batch(name, data_dir, "test"), expected, f"{name} test")
    elif test_cell == "same keys without `targets`":
        check(_batch(name, data_dir, "test"), {k: v for k, v in expected.items() if k != "targets"}, f"{name} test")
    else:
        assert test_cell == "not configured"
        with pytest.raises(mmvl.UserError, match="split 'test' is not configured"):
            _batch(name, data_dir, "test")
    if features_cell == "not available":
        return
    added, _, replaced = features_cell.partition(" instead of ")
    variant = {k: v for k, v in expected.items() if k not in keys_and_shapes(replaced)}
    variant.update(keys_and_shapes(added))
    path = _features_lmdb(data_dir, name, ("train",))
    batch = _batch(name, data_dir, "train", f"dataset_config.{name}.processors.features="
                                              f"{{type: features, params: {{path: {path}, max_features: 4}}}}")
    check(batch, variant, f"{name} with features")
    assert batch["features"].shape[1:] == (4, 8) and batch["feature_mask"].sum().item() == 6  # 3 real regions each
    assert batch[PADDED] is True  # the fourth region of each sample is padding
    assert torch.is_floating_point(batch["boxes"])
