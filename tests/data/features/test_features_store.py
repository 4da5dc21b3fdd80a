"""Convert MMF sources to an mmvl feature LMDB and read them back: values, padding, errors, workers."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mmvl.data.features import LMDBFeatureReader, NpyFeatureReader
from mmvl.data.features.convert import convert_mmf_lmdb, convert_npy_dir, parse_size
from mmvl.data.features import lmdb_store
from mmvl.data.features.lmdb_store import LMDBFeatureWriter, open_env
from mmvl.errors import UserError

lmdb = pytest.importorskip("lmdb", reason="lmdb is not installed (the feature store needs it)")

ROWS = {"a": 5, "b": 8, "sub/c": 12}
DIM = 16
SIZE = {"a": (64, 48), "b": (100, 80), "sub/c": (30, 300)}


def make_npy_dir(root, info=True, num_boxes=None):
    """MMF's layout: ``<id>.npy`` float32 features + ``<id>_info.npy`` pickled dicts."""
    rng = np.random.default_rng(1)
    src = {}
    for key, rows in ROWS.items():
        feats = rng.standard_normal((rows, DIM)).astype(np.float32)
        w, h = SIZE[key]
        xy = rng.uniform(0, 0.5, (rows, 2)) * (w, h)
        bbox = np.concatenate([xy, xy + rng.uniform(1, 20, (rows, 2))], axis=1)
        os.makedirs(os.path.dirname(os.path.join(root, key + ".npy")), exist_ok=True)
        np.save(os.path.join(root, key + ".npy"), feats)
        if info:
            d = {"bbox": bbox, "image_width": w, "image_height": h, "num_boxes": num_boxes or rows,
                 "objects": np.arange(rows), "cls_prob": None}
            np.save(os.path.join(root, key + "_info.npy"), d, allow_pickle=True)
        src[key] = (feats, bbox)
    return src


@pytest.fixture
def store(tmp_path):
    src = make_npy_dir(tmp_path / "npy")
    path, count = convert_npy_dir(str(tmp_path / "npy"), str(tmp_path / "f.lmdb"), allow_pickle=True)
    assert count == 3
    return path, src, tmp_path


def test_convert_then_read_equals_source(store):
    path, src, _ = store
    reader = LMDBFeatureReader(path, max_features=None)
    assert reader.ids() == ["a", "b", "sub/c"] and len(reader) == 3
    for key, (feats, bbox) in src.items():
        out = reader[key]
        w, h = SIZE[key]
        assert out["features"].dtype == torch.float32
        np.testing.assert_array_equal(out["features"].numpy(), feats)
        np.testing.assert_allclose(out["boxes"].numpy(), bbox / [w, h, w, h], rtol=1e-6)
        assert (out["image_width"], out["image_height"], out["num_boxes"]) == (w, h, ROWS[key])
        assert out["mask"].tolist() == [1] * ROWS[key]


def test_fp16_option(tmp_path):
    src = make_npy_dir(tmp_path / "npy")
    path, _ = convert_npy_dir(str(tmp_path / "npy"), str(tmp_path / "h.lmdb"), fp16=True, allow_pickle=True)
    out = LMDBFeatureReader(path, max_features=None)["b"]
    assert out["features"].dtype == torch.float16  # stays fp16 on the host
    np.testing.assert_array_equal(out["features"].numpy(), src["b"][0].astype(np.float16))
    full, _ = convert_npy_dir(str(tmp_path / "npy"), str(tmp_path / "f.lmdb"), allow_pickle=True)
    sizes = []
    for p in (path, full):
        with open_env(p).begin() as txn:  # the reader's shared environment (one per path and process)
            sizes.append(len(txn.get(b"sub/c")))
    assert sizes[0] < sizes[1] - 12 * DIM  # half the feature bytes


def test_padding_truncation_and_mask(store):
    path, src, _ = store
    reader = LMDBFeatureReader(path, max_features=8)
    short, exact, long = reader["a"], reader["b"], reader["sub/c"]
    for out in (short, exact, long):
        assert out["features"].shape == (8, DIM) and out["boxes"].shape == (8, 4) and out["mask"].shape == (8,)
    assert short["mask"].tolist() == [1] * 5 + [0] * 3 and short["num_boxes"] == 5
    assert torch.all(short["features"][5:] == 0) and torch.all(short["boxes"][5:] == 0)
    np.testing.assert_array_equal(short["features"][:5].numpy(), src["a"][0])
    assert exact["mask"].sum() == 8
    assert long["mask"].tolist() == [1] * 8 and long["num_boxes"] == 8
    np.testing.assert_array_equal(long["features"].numpy(), src["sub/c"][0][:8])
    assert 0 <= float(long["boxes"].min()) and float(long["boxes"].max()) <= 1


def test_num_boxes_below_rows_masks_the_zero_rows(tmp_path):
    make_npy_dir(tmp_path / "npy", num_boxes=3)
    path, _ = convert_npy_dir(str(tmp_path / "npy"), str(tmp_path / "f.lmdb"), allow_pickle=True)
    out = LMDBFeatureReader(path, max_features=6)["a"]
    assert out["mask"].tolist() == [1, 1, 1, 0, 0, 0] and out["num_boxes"] == 3


def _overwrite(path, key, value):
    env = lmdb.open(path, map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(key.encode(), value)
    env.close()


@pytest.mark.parametrize("damage", [lambda v: v[:-3], lambda v: v[:20], lambda v: b"junk" + v[4:]])
def test_corrupt_value_names_id_and_path(store, damage):
    path, _, _ = store
    env = lmdb.open(path, readonly=True, lock=False)
    value = env.begin().get(b"b")
    env.close()
    _overwrite(path, "b", damage(value))
    reader = LMDBFeatureReader(path, max_features=4)
    with pytest.raises(UserError, match=r"id 'b' in .*f\.lmdb.*(corrupt|convert)") as err:
        reader["b"]
    assert path in str(err.value)
    assert reader["a"]["features"].shape == (4, DIM)  # the other values are untouched


def test_missing_id_and_missing_store(store, tmp_path):
    path, _, _ = store
    with pytest.raises(UserError, match=r"no features for id 'zzz' in .*f\.lmdb"):
        LMDBFeatureReader(path, max_features=4)["zzz"]
    with pytest.raises(UserError, match="nope.lmdb does not exist"):
        LMDBFeatureReader(str(tmp_path / "nope.lmdb"), max_features=4)
    (tmp_path / "garbage.lmdb").write_bytes(b"not an lmdb at all" * 500)
    with pytest.raises(UserError, match="garbage.lmdb is not a readable LMDB"):
        LMDBFeatureReader(str(tmp_path / "garbage.lmdb"), max_features=4)["a"]


def test_max_features_is_validated(store):
    with pytest.raises(UserError, match="max_features"):
        LMDBFeatureReader(store[0], max_features=0)


def test_pickled_info_needs_allow_pickle(tmp_path):
    src = make_npy_dir(tmp_path / "npy")
    with pytest.raises(UserError, match="--allow-pickle"):
        convert_npy_dir(str(tmp_path / "npy"), str(tmp_path / "f.lmdb"))
    assert not os.path.exists(tmp_path / "f.lmdb") and not os.path.exists(str(tmp_path / "f.lmdb") + ".partial")
    with pytest.raises(UserError, match="allow-pickle"):
        NpyFeatureReader(tmp_path / "npy", max_features=4)["a"]
    out = NpyFeatureReader(tmp_path / "npy", max_features=None, allow_pickle=True)["a"]
    np.testing.assert_array_equal(out["features"].numpy(), src["a"][0])


def test_npy_reader_matches_lmdb_reader(store):
    path, _, tmp_path = store
    lm, npy = LMDBFeatureReader(path, 10), NpyFeatureReader(tmp_path / "npy", 10, allow_pickle=True)
    assert npy.ids() == lm.ids()
    for key in lm.ids():
        a, b = lm[key], npy[key]
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype
                torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)
            else:
                assert a[k] == b[k]
    with pytest.raises(UserError, match="no features for id 'zzz'"):
        npy["zzz"]
    with pytest.raises(UserError, match="outside"):
        npy["../npy/a"]


def test_features_only_dir_without_info(tmp_path):
    src = make_npy_dir(tmp_path / "npy", info=False)
    path, _ = convert_npy_dir(str(tmp_path / "npy"), str(tmp_path / "f.lmdb"))  # no pickle involved
    out = LMDBFeatureReader(path, 6)["a"]
    np.testing.assert_array_equal(out["features"][:5].numpy(), src["a"][0])
    assert torch.all(out["boxes"] == 0) and out["mask"].tolist() == [1] * 5 + [0]


def make_mmf_lmdb(path, src):
    """MMF's lmdb_conversion layout: one pickled dict per value plus a pickled b"keys" list."""
    env = lmdb.open(path, map_size=1 << 26)
    with env.begin(write=True) as txn:
        for key, (feats, bbox) in src.items():
            w, h = SIZE[key]
            item = {"feature_path": key, "features": feats, "bbox": bbox, "image_width": w, "image_height": h,
                    "num_boxes": len(feats), "objects": None, "cls_prob": None}
            txn.put(key.encode(), pickle.dumps(item))
        txn.put(b"keys", pickle.dumps([k.encode() for k in src]))
    env.close()


def test_mmf_lmdb_convert_and_direct_read(tmp_path):
    src = make_npy_dir(tmp_path / "npy")
    mmf = str(tmp_path / "mmf.lmdb")
    make_mmf_lmdb(mmf, src)
    with pytest.raises(UserError, match="--allow-pickle"):
        convert_mmf_lmdb(mmf, str(tmp_path / "out.lmdb"))
    with pytest.raises(UserError, match="allow-pickle"):
        LMDBFeatureReader(mmf, 4)["a"]
    direct = LMDBFeatureReader(mmf, 10, allow_pickle=True)
    assert sorted(direct.ids()) == sorted(src)
    path, count = convert_mmf_lmdb(mmf, str(tmp_path / "out.lmdb"), allow_pickle=True)
    converted = LMDBFeatureReader(path, 10)
    assert count == 3 and sorted(converted.ids()) == sorted(src)
    for key in src:
        torch.testing.assert_close(converted[key]["features"], direct[key]["features"])
        torch.testing.assert_close(converted[key]["boxes"], direct[key]["boxes"])


class _Items(Dataset):
    def __init__(self, reader):
        self.reader = reader

    def __len__(self):
        return 6

    def __getitem__(self, i):
        key = self.reader.ids()[i % 3]
        out = self.reader[key]
        return {"features": out["features"], "mask": out["mask"], "pid": os.getpid(),
                "env_pid": lmdb_store._ENVS[self.reader.path][0]}


@pytest.mark.proc
def test_reader_in_dataloader_workers_reopens_after_fork(store):
    path, src, _ = store
    reader = LMDBFeatureReader(path, max_features=8)
    reader["a"]  # opened in the parent before the workers fork
    loader = DataLoader(_Items(reader), batch_size=3, num_workers=2, timeout=60,
                        multiprocessing_context="fork")
    batches = list(loader)
    pids = {int(p) for b in batches for p in b["pid"]}
    assert len(batches) == 2 and os.getpid() not in pids
    assert all(b["pid"].tolist() == b["env_pid"].tolist() for b in batches)  # each worker opened its own env
    np.testing.assert_array_equal(batches[0]["features"][0][:5].numpy(), src["a"][0])
    assert reader["b"]["mask"].sum() == 8  # the parent's environment still works


def test_reader_pickles_without_environment(store):
    reader = LMDBFeatureReader(store[0], max_features=4)
    reader["a"]
    clone = pickle.loads(pickle.dumps(reader))
    assert "env" not in str(vars(clone)) and clone["b"]["features"].shape == (4, DIM)


def test_two_readers_share_one_path(store):
    first, second = LMDBFeatureReader(store[0], 4), LMDBFeatureReader(store[0], 12)
    assert first["a"]["features"].shape == (4, DIM) and second["a"]["features"].shape == (12, DIM)


def test_writer_refuses_overwrite_and_grows_its_map(tmp_path):
    out = str(tmp_path / "w.lmdb")
    with LMDBFeatureWriter(out, map_size=1 << 16, commit_bytes=1 << 30) as writer:
        for i in range(40):
            writer.put(str(i), np.full((50, 128), i, np.float32))
    reader = LMDBFeatureReader(out)
    assert len(reader) == 40 and float(reader["39"]["features"][0, 0]) == 39.0
    with pytest.raises(UserError, match="already exists"):
        LMDBFeatureWriter(out)
    with pytest.raises(UserError, match="twice"):
        with LMDBFeatureWriter(out, overwrite=True) as writer:
            writer.put("x", np.ones((1, 2), np.float32))
            writer.put("x", np.ones((1, 2), np.float32))
    assert len(LMDBFeatureReader(out)) == 40  # the failed rewrite left the old store in place
    with LMDBFeatureWriter(out, overwrite=True) as writer:
        writer.put("only", np.ones((1, 2), np.float32))
    # a reader opened before the rewrite reads the new file, not a stale mapping of the old one
    assert LMDBFeatureReader(out).ids() == ["only"] and float(reader["only"]["features"][0, 0]) == 1.0


def test_parse_size():
    assert parse_size("64G") == 64 << 30 and parse_size("512m") == 512 << 20 and parse_size(1024) == 1024
    with pytest.raises(UserError, match="--map-size"):
        parse_size("lots")


def test_store_files_follow_the_umask(tmp_path, umask):
    from tests.fixtures.modes import tree, wrong_modes

    with LMDBFeatureWriter(tmp_path / "f.lmdb") as writer:
        writer.put("a", np.zeros((2, 4), np.float32))
    assert wrong_modes(tree(tmp_path / "f.lmdb"), umask) == []
