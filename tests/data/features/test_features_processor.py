"""The registered ``features`` processor: picks the reader by path and feeds mmvl's collate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mmvl.data.features  # noqa: F401  (registers the processor)
from mmvl.data.features import LMDBFeatureReader, NpyFeatureReader, LMDBFeatureWriter
from mmvl.data.sample import collate
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS


@pytest.fixture
def stores(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "npy").mkdir()
    with LMDBFeatureWriter(str(tmp_path / "f.lmdb")) as writer:
        for key, rows in (("1", 3), ("2", 7)):
            feats = rng.standard_normal((rows, 6)).astype(np.float16)
            writer.put(key, feats, np.tile([0, 0, 10, 10], (rows, 1)), 20, 40)
            np.save(tmp_path / "npy" / f"{key}.npy", feats)
    return tmp_path


def test_registered_and_chooses_reader_by_path(stores):
    cls = PROCESSORS.get("features")
    lmdb_proc = cls(path=str(stores / "f.lmdb"), max_features=5)
    npy_proc = cls(path="npy", max_features=5, data_dir=str(stores))
    assert isinstance(lmdb_proc.reader, LMDBFeatureReader) and isinstance(npy_proc.reader, NpyFeatureReader)
    a, b = lmdb_proc(2), npy_proc("2")  # int ids work: keys are str(id)
    torch.testing.assert_close(a["features"], b["features"])
    assert a["features"].dtype == torch.float16 and a["boxes"][0].tolist() == [0.0, 0.0, 0.5, 0.25]
    assert len(lmdb_proc) == 2 and lmdb_proc.ids() == ["1", "2"]


def test_batches_through_mmvl_collate(stores):
    proc = PROCESSORS.get("features")(path=str(stores / "f.lmdb"), max_features=4, prefix="image_")
    batch = collate([proc("1"), proc("2")])
    assert batch["image_features"].shape == (2, 4, 6) and batch["image_boxes"].shape == (2, 4, 4)
    assert batch["image_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["image_num_boxes"].tolist() == [3, 4]


def test_unpadded_samples_pad_in_collate(stores):
    proc = PROCESSORS.get("features")(path=str(stores / "f.lmdb"), max_features=None)
    batch = collate([proc("1"), proc("2")])
    assert batch["features"].shape == (2, 7, 6) and batch["mask"].tolist()[0] == [1, 1, 1, 0, 0, 0, 0]


def test_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="missing.lmdb does not exist"):
        PROCESSORS.get("features")(path=str(tmp_path / "missing.lmdb"))
