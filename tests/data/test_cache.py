"""The preprocessing cache: built once and mapped after, keyed by the sources, atomic, and rebuilt
(with a log line) when stale or corrupt."""
import logging
import os

import numpy as np
import pytest

from mmvl.data import cache as cache_mod
from mmvl.data.cache import Cache, fingerprint, load_table, make_key, save_table
from mmvl.data.records import Strings, Table


class Builds:
    """Counts how often the entry is built; the table holds the source file's lines."""

    def __init__(self, source):
        self.source, self.count = source, 0

    def __call__(self, folder):
        self.count += 1
        lines = self.source.read_text().splitlines()
        save_table(folder, "records", Table({"n": np.arange(len(lines)), "line": Strings.build(lines)}))


def _get(cache, source, builds):
    key = make_key(fingerprint([source]))
    return cache.get("train", key, builds, lambda f: load_table(f, "records"), "train split")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "data" / "train.txt"
    path.parent.mkdir()
    path.write_text("a\nbb\nccc\n")
    return path


def test_built_once_then_mapped(tmp_path, source, caplog):
    cache, builds = Cache(tmp_path / "cache", "toy"), Builds(source)
    with caplog.at_level(logging.INFO, logger="mmvl"):
        first = _get(cache, source, builds)
    assert "preparing the train split" in caplog.text
    second = _get(Cache(tmp_path / "cache", "toy"), source, builds)
    assert builds.count == 1
    assert second.column("line").tolist() == ["a", "bb", "ccc"] == first.column("line").tolist()
    data = second.column("line").data
    assert isinstance(data.base, np.memmap) or isinstance(data, np.memmap)  # mapped, not read into memory
    entries = os.listdir(tmp_path / "cache" / "toy")
    assert len(entries) == 1 and not entries[0].startswith(".")  # no temp folder left behind


def test_entry_respects_umask(tmp_path, source):
    old = os.umask(0o022)
    try:
        _get(Cache(tmp_path / "cache", "toy"), source, Builds(source))
    finally:
        os.umask(old)
    entry = next((tmp_path / "cache" / "toy").iterdir())
    assert entry.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in entry.iterdir())


def test_changed_source_is_stale_and_rebuilt(tmp_path, source, caplog):
    cache, builds = Cache(tmp_path / "cache", "toy"), Builds(source)
    _get(cache, source, builds)
    source.write_text("a\nbb\nccc\ndddd\n")
    with caplog.at_level(logging.INFO, logger="mmvl"):
        table = _get(cache, source, builds)
    assert builds.count == 2 and len(table) == 4
    assert "stale" in caplog.text
    assert len(os.listdir(tmp_path / "cache" / "toy")) == 1  # the stale entry is gone


def _rewrite(path, data: bytes, keep_mtime: bool = True) -> None:
    """Write ``data`` into ``path``; with ``keep_mtime`` restore its modification time (as ``cp -p`` does)."""
    st = path.stat()
    path.write_bytes(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_fingerprint_small_files_by_content(tmp_path, monkeypatch):
    small = tmp_path / "small.json"
    small.write_text("x" * 10)
    monkeypatch.setattr(cache_mod, "SMALL_FILE", 50)
    before = fingerprint([small])[0]
    assert before[1] == "sha256"
    _rewrite(small, b"z" * 10)  # same size, same mtime: only the content changed
    assert fingerprint([small])[0] != before
    assert fingerprint([tmp_path / "missing"])[0][1] == "missing"


def test_fingerprint_of_a_large_file_detects_changes(tmp_path, monkeypatch):
    """Large files are not read in full, yet a change of size, of mtime, or of a sampled block
    (here the first, the last and one in the middle) with size and mtime kept, is a new fingerprint."""
    monkeypatch.setattr(cache_mod, "SMALL_FILE", 1000)
    monkeypatch.setattr(cache_mod, "SAMPLE_BLOCK", 100)
    monkeypatch.setattr(cache_mod, "SAMPLE_BLOCKS", 5)  # blocks at 0, 1225, 2450, 3675, 4900 of 5000 bytes
    large = tmp_path / "large.json"
    data = bytes(range(256)) * 19 + bytes(136)  # 5000 bytes
    large.write_bytes(data)
    before = fingerprint([large])[0]
    assert before[1:3] == [5000, large.stat().st_mtime_ns] and len(before) == 4
    assert fingerprint([large])[0] == before  # stable
    seen = {tuple(before)}
    for offset in (0, 2450 + 50, 4999):  # inside a sampled block, size and mtime kept
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        _rewrite(large, bytes(changed))
        seen.add(tuple(fingerprint([large])[0]))
    _rewrite(large, data + b"x")  # another size
    seen.add(tuple(fingerprint([large])[0]))
    _rewrite(large, data, keep_mtime=False)  # the same bytes, a new mtime
    os.utime(large, ns=(before[2] + 10**9, before[2] + 10**9))
    seen.add(tuple(fingerprint([large])[0]))
    assert len(seen) == 6


@pytest.mark.parametrize("damage", ["truncate_array", "drop_meta", "garble_schema"])
def test_corrupt_entry_is_rebuilt_with_a_warning(tmp_path, source, caplog, damage):
    cache, builds = Cache(tmp_path / "cache", "toy"), Builds(source)
    _get(cache, source, builds)
    entry = next((tmp_path / "cache" / "toy").iterdir())
    if damage == "truncate_array":
        target = entry / "records.line.data.npy"
        target.write_bytes(target.read_bytes()[:-2])
    elif damage == "drop_meta":
        (entry / cache_mod.META).unlink()
    else:  # same size, unusable content: caught when loading
        schema = entry / "records.schema.json"
        schema.write_text("#" * len(schema.read_text()))
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        table = _get(cache, source, builds)
    assert builds.count == 2 and table.column("line").tolist() == ["a", "bb", "ccc"]
    assert "corrupt" in caplog.text


def test_failed_build_leaves_nothing(tmp_path, source):
    cache = Cache(tmp_path / "cache", "toy")

    def fails(folder):
        save_table(folder, "records", Table({"n": np.arange(3)}))
        raise RuntimeError("parse error")

    with pytest.raises(RuntimeError, match="parse error"):
        cache.get("train", "0" * 16, fails, lambda f: load_table(f, "records"), "train split")
    assert os.listdir(tmp_path / "cache" / "toy") == []


def test_concurrent_builders_both_succeed(tmp_path, source):
    """Another process finishing the same entry first: its copy is used, ours dropped."""
    cache = Cache(tmp_path / "cache", "toy")
    inner = Builds(source)

    def slow_build(folder):
        _get(Cache(tmp_path / "cache", "toy"), source, inner)  # "the other process" completes first
        Builds(source)(folder)

    key = make_key(fingerprint([source]))
    table = cache.get("train", key, slow_build, lambda f: load_table(f, "records"), "train split")
    assert len(table) == 3 and inner.count == 1
    assert len(os.listdir(tmp_path / "cache" / "toy")) == 1


def test_unwritable_root_builds_privately_with_a_warning(tmp_path, source, caplog):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    builds = Builds(source)
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        table = _get(Cache(blocker, "toy"), source, builds)
    assert len(table) == 3 and builds.count == 1
    assert "env.cache_dir" in caplog.text
