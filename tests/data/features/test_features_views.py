"""Zero-copy reads: large LMDB values come back as copy-on-write views of the data file."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mmvl.data.features import LMDBFeatureReader, LMDBFeatureWriter
from mmvl.data.features import lmdb_store
from mmvl.data.sample import collate

ROWS, DIM = 36, 256  # 18 KiB of fp16 per value: several LMDB pages, so stored in overflow pages


def _write(path, seed=0, rows=ROWS, n=6):
    rng = np.random.default_rng(seed)
    src = {}
    with LMDBFeatureWriter(path, overwrite=True) as writer:
        for i in range(n):
            feats = rng.standard_normal((rows, DIM)).astype(np.float16)
            boxes = np.tile([1.0, 2.0, 30.0, 40.0], (rows, 1)) + i
            writer.put(f"img{i}", feats, boxes, 64, 48)
            src[f"img{i}"] = feats
    return src


def _in_map(path, tensor):
    values = lmdb_store._ENVS[path][2]
    base = np.frombuffer(values.mm, np.uint8, 1).__array_interface__["data"][0]
    return base <= tensor.data_ptr() < base + values.size


@pytest.fixture
def big(tmp_path):
    path = str(tmp_path / "big.lmdb")
    return path, _write(path)


def test_large_values_are_views_of_the_file_and_equal_the_source(big):
    path, src = big
    reader = LMDBFeatureReader(path, max_features=ROWS)
    for key, feats in src.items():
        out = reader[key]
        assert _in_map(reader.path, out["features"])  # no copy
        np.testing.assert_array_equal(out["features"].numpy(), feats)
        assert out["mask"].sum() == ROWS and out["boxes"].shape == (ROWS, 4)
    truncated = LMDBFeatureReader(path, max_features=10)["img1"]["features"]
    assert _in_map(reader.path, truncated) and truncated.shape == (10, DIM)
    np.testing.assert_array_equal(truncated.numpy(), src["img1"][:10])
    padded = LMDBFeatureReader(path, max_features=50)["img1"]["features"]  # padding needs a copy
    assert not _in_map(reader.path, padded) and torch.all(padded[ROWS:] == 0)
    np.testing.assert_array_equal(padded[:ROWS].numpy(), src["img1"])


def test_in_place_edits_stay_private_to_the_read(big):
    path, src = big
    reader = LMDBFeatureReader(path, max_features=ROWS)
    out = reader["img2"]["features"]
    assert _in_map(reader.path, out)
    out.mul_(0).add_(7)  # neither a fault on a read-only map nor a write to the store
    assert torch.all(out == 7)
    again = reader["img2"]["features"]  # while ``out`` lives: a copy, never an alias of it
    assert not _in_map(reader.path, again)
    np.testing.assert_array_equal(again.numpy(), src["img2"])
    again.add_(1)
    assert torch.all(out == 7)
    del out, again
    later = reader["img2"]["features"]  # the edited pages were dropped with ``out``: a clean view
    assert _in_map(reader.path, later)
    np.testing.assert_array_equal(later.numpy(), src["img2"])
    lmdb_store.forget_env(reader.path)
    np.testing.assert_array_equal(LMDBFeatureReader(path, max_features=ROWS)["img2"]["features"].numpy(),
                                  src["img2"])  # the file itself is unchanged


def test_the_same_id_twice_in_a_batch_does_not_alias(big):
    path, src = big
    reader = LMDBFeatureReader(path, max_features=ROWS)
    first, second = reader["img4"]["features"], reader["img4"]["features"]
    first.zero_()
    np.testing.assert_array_equal(second.numpy(), src["img4"])


def test_views_outlive_a_rewrite_of_the_store(big):
    path, src = big
    old = LMDBFeatureReader(path, max_features=ROWS)["img3"]["features"]
    new_src = _write(path, seed=1)  # replaces the store; the writer closes this process's environment
    np.testing.assert_array_equal(old.numpy(), src["img3"])  # still the old file's bytes, still mapped
    fresh = LMDBFeatureReader(path, max_features=ROWS)["img3"]["features"]
    np.testing.assert_array_equal(fresh.numpy(), new_src["img3"])


def test_an_unrecognised_layout_falls_back_to_a_copy(big, tmp_path):
    path, src = big
    reader = LMDBFeatureReader(path, max_features=ROWS)
    reader["img0"]
    other = str(tmp_path / "other.lmdb")
    _write(other, seed=2, rows=ROWS + 4)  # other shapes: its record headers differ
    pid, env, _ = lmdb_store._ENVS[reader.path]
    fd = os.open(os.path.join(other, "data.mdb"), os.O_RDONLY)
    try:
        wrong = lmdb_store._ValueMap.open(fd, os.path.join(other, "data.mdb"), env)
    finally:
        os.close(fd)
    lmdb_store._ENVS[reader.path] = (pid, env, wrong)  # as if the map were of another file
    out = reader["img0"]["features"]
    assert not _in_map(reader.path, out)
    np.testing.assert_array_equal(out.numpy(), src["img0"])
    lmdb_store.forget_env(reader.path)


class _Features(Dataset):
    def __init__(self, reader):
        self.reader = reader

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        key = self.reader.ids()[i]
        return {"id": key, **self.reader[key]}


@pytest.mark.proc
def test_views_through_dataloader_workers_and_collate(big):
    path, src = big
    reader = LMDBFeatureReader(path, max_features=ROWS)
    reader["img0"]  # opened in the parent before the workers fork
    loader = DataLoader(_Features(reader), batch_size=4, num_workers=2, collate_fn=collate, timeout=60,
                        multiprocessing_context="fork")
    for _ in range(2):
        seen = 0
        for batch in loader:
            for key, feats in zip(batch["id"], batch["features"]):
                np.testing.assert_array_equal(feats.numpy(), src[key])
                seen += 1
        assert seen == len(src)
