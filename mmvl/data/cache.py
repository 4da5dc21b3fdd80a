"""Cached preprocessing: a parsed split is written once as ``.npy`` arrays and memory-mapped after.

Parsing VQA v2's 350 MB train annotations takes tens of seconds and gigabytes of Python
objects; mapping the parsed arrays takes milliseconds, and their pages live in the page
cache, shared by every process (DataLoader workers and ranks on one node included).

Layout: ``<root>/<dataset>/<name>-<key>/`` where ``root`` is ``env.cache_dir`` (or
``<env.data_dir>/.mmvl_cache`` when that is null) and ``name`` says what the entry holds
(``train``, ``vocab``...). The ``key`` hashes :data:`VERSION`, the dataset, the name, the
builder's settings for the entry (e.g. processor specs) and a :func:`fingerprint` of every
source file: files up to :data:`SMALL_FILE` bytes by content (sha256), larger ones by their
resolved path, size, modification time and a sha256 of :data:`SAMPLE_BLOCKS` blocks spread
evenly over the file, the first and last included (about 1 MB read, milliseconds: hashing all of
a 350 MB file would cost a good part of what the cache saves on every start). A rewritten large
file is detected when its size or mtime changed (what editors, generators and downloads do) or,
when both were kept (``cp -p``, ``rsync -t``), when any sampled block differs.

An entry is built into a temporary folder beside it (every file fsynced, mode from the
umask) and renamed into place, so a reader sees a whole entry or none, and two processes
building the same entry at once both succeed. Its completion marker (:data:`mmvl.io.MARKER`,
the one every published folder has) lists every file with its size;
an entry whose files do not match it, or whose arrays cannot be mapped or are inconsistent,
is corrupt: it is logged, removed and rebuilt. Entries of the same name with another key are
stale (the sources or settings changed): they are logged and removed once the new entry is
in place. Arrays are read with ``np.load(mmap_mode="r", allow_pickle=False)``: no pickle.
Where the root is not writable the entry is built in a temporary folder for this process
only, with a warning naming ``env.cache_dir``.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import numpy as np

from mmvl import io
from mmvl.data.records import Table

log = logging.getLogger("mmvl")
T = TypeVar("T")

#: bump when the parsed layout of any dataset changes: every old entry becomes stale
#: (2: entries are marked complete by :data:`mmvl.io.MARKER`, no longer by ``meta.json``)
VERSION = 2
#: files up to this size are fingerprinted by content, larger ones by path, size, mtime and sampled blocks
SMALL_FILE = 1 << 20
#: how many blocks of :data:`SAMPLE_BLOCK` bytes of a large file its fingerprint hashes
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK = 64 << 10
META = io.MARKER


class CacheCorrupt(Exception):
    """An entry that exists but cannot be used as it is."""


def sampled_digest(path: Path, size: int) -> str:
    """sha256 of :data:`SAMPLE_BLOCKS` blocks at evenly spaced offsets of a ``size``-byte file (first and last included)."""
    h = hashlib.sha256()
    last = max(0, size - SAMPLE_BLOCK)
    offsets = sorted({round(i * last / (SAMPLE_BLOCKS - 1)) for i in range(SAMPLE_BLOCKS)})
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()


def fingerprint(paths: Iterable[str | os.PathLike]) -> list[list[Any]]:
    """One row per source file: ``[path, "sha256", digest]`` (small files) or ``[path, size, mtime_ns,
    sampled digest]`` (large ones, folders: no digest); missing files too."""
    rows: list[list[Any]] = []
    for p in paths:
        path = Path(os.path.realpath(os.path.expanduser(str(p))))
        try:
            st = path.stat()
        except OSError:
            rows.append([str(path), "missing"])
            continue
        if st.st_size <= SMALL_FILE and path.is_file():
            rows.append([str(path), "sha256", hashlib.sha256(path.read_bytes()).hexdigest()])
        elif path.is_file():
            rows.append([str(path), st.st_size, st.st_mtime_ns, sampled_digest(path, st.st_size)])
        else:
            rows.append([str(path), st.st_size, st.st_mtime_ns])
    return rows


def make_key(*parts: Any) -> str:
    """A short stable hash of JSON-able ``parts`` (dict keys sorted)."""
    text = json.dumps([VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def default_root(cache_dir: str | None, data_dir: str) -> Path:
    """``cache_dir``, or ``<data_dir>/.mmvl_cache`` when it is empty/None."""
    chosen = cache_dir if cache_dir not in (None, "") else os.path.join(str(data_dir), ".mmvl_cache")
    return Path(os.path.expanduser(str(chosen)))


class Cache:
    """The entries of one dataset under ``root``."""

    def __init__(self, root: str | os.PathLike, dataset: str):
        self.root = Path(root)
        self.dataset = dataset
        self.folder = self.root / dataset

    def get(self, name: str, key: str, build: Callable[[Path], None], load: Callable[[Path], T], what: str,
            prune: bool = True) -> T:
        """``load(folder)`` of entry ``name``-``key``; ``build(folder)`` writes it first when missing or corrupt.

        ``load`` raises :class:`CacheCorrupt` for content it cannot use (e.g. :func:`load_table`).
        With ``prune``, entries of the same ``name`` and another key are stale: they are removed
        once the new one is in place (``name`` should then identify the source files, so that two
        datasets sharing a cache never prune each other's entries)."""
        path = self.folder / f"{name}-{key}"
        if path.is_dir():
            try:
                check_entry(path)
                return load(path)
            except CacheCorrupt as e:
                log.warning("%s: the cached %s in %s is corrupt (%s); rebuilding it", self.dataset, what, path, e)
                io.remove_tree(path)
        stale = [p for p in self._named(name) if p != path] if prune else []
        if stale:
            log.info("%s: the cached %s in %s is stale (its source files or settings changed); rebuilding it",
                     self.dataset, what, stale[0])
        else:
            log.info("%s: preparing the %s (cached in %s for the next runs)", self.dataset, what, path)
        built = self._build(path, build, what)
        if built == path:
            for p in stale:
                io.remove_tree(p)
        return load(built)

    def _named(self, name: str) -> list[Path]:
        if not self.folder.is_dir():
            return []
        prefix = f"{name}-"
        return sorted(p for p in self.folder.iterdir()
                      if p.is_dir() and p.name.startswith(prefix) and len(p.name) == len(prefix) + 16)

    def _build(self, path: Path, build: Callable[[Path], None], what: str) -> Path:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = io.make_temp_dir(self.folder, prefix=f".tmp-{path.name}-")
        except OSError as e:
            log.warning("%s: cannot write the preprocessing cache under %s (%s); set env.cache_dir to a writable "
                        "folder. This run keeps the %s in a temporary folder.", self.dataset, self.root,
                        e.strerror or e, what)
            return _private_build(path.name, build)
        try:
            build(tmp)
        except BaseException:
            io.remove_tree(tmp)
            raise
        io.publish_dir(tmp, path, version=VERSION)  # False: another process put the same entry first
        return path


def check_entry(folder: Path) -> None:
    """Raise :class:`CacheCorrupt` unless every file the marker lists is there with its size."""
    problem = io.completeness_problem(folder)
    if problem is not None:
        raise CacheCorrupt(problem)


def save_table(folder: Path, name: str, table: Table) -> None:
    """``<name>.<column part>.npy`` per array and ``<name>.schema.json``."""
    arrays, schema = table.to_arrays()
    for part, array in arrays.items():
        np.save(folder / f"{name}.{part}.npy", np.ascontiguousarray(array), allow_pickle=False)
    (folder / f"{name}.schema.json").write_text(json.dumps({**schema, "arrays": sorted(arrays)}), encoding="utf-8")


def load_table(folder: Path, name: str) -> Table:
    """The table :func:`save_table` wrote, memory-mapped; :class:`CacheCorrupt` when it is not usable."""
    try:
        schema = json.loads((folder / f"{name}.schema.json").read_text(encoding="utf-8"))
        arrays = {part: np.asarray(np.load(folder / f"{name}.{part}.npy", mmap_mode="r", allow_pickle=False))
                  for part in schema["arrays"]}  # plain ndarray views of the maps
        return Table.from_arrays(arrays, schema)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CacheCorrupt(f"{name}: {e}") from None


def save_tables(folder: Path, tables: Mapping[str, Table]) -> None:
    for name, table in tables.items():
        save_table(folder, name, table)


def load_tables(folder: Path) -> dict[str, Table]:
    """Every table :func:`save_tables` wrote into ``folder``, by name."""
    names = sorted(p.name[: -len(".schema.json")] for p in folder.glob("*.schema.json"))
    if not names:
        raise CacheCorrupt("no tables")
    return {name: load_table(folder, name) for name in names}


_PRIVATE: list[tuple[int, str]] = []


def _private_build(name: str, build: Callable[[Path], None]) -> Path:
    """An entry only this process uses (the cache root is not writable), removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix=f"mmvl-cache-{name}-"))
    if not _PRIVATE:
        atexit.register(_cleanup_private)
    _PRIVATE.append((os.getpid(), str(folder)))
    build(folder)
    io.mark_complete(folder, version=VERSION)
    return folder


def _cleanup_private() -> None:
    for pid, folder in _PRIVATE:
        if pid == os.getpid():
            shutil.rmtree(folder, ignore_errors=True)
