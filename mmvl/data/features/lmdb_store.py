"""Region/grid features in one LMDB: a writer and a fork-safe, zero-pickle reader.

Values use :mod:`mmvl.data.features.format`; the id list lives as JSON under
:data:`META_KEY`. The reader opens the environment lazily in each process
(DataLoader workers included). Large feature arrays are not copied at all: the
sample's tensor is a view of a private, copy-on-write map of the store's data
file (see :class:`_ValueMap`), so the only copy a DataLoader makes is collate's,
from the page cache straight into the batch.
"""
from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import pickle
import shutil
import struct
import sys
import threading
import weakref
from typing import Any

import numpy as np

from mmvl import io
from mmvl.data.features import format as fmt
from mmvl.data.features.assemble import check_max_features, key_of, to_sample
from mmvl.errors import UserError

META_KEY = b"__mmvl_features__"
MMF_KEYS = b"keys"
RERUN = "re-run mmvl_features convert"


def _lmdb():
    import lmdb

    return lmdb


class LMDBFeatureWriter:
    """Write ``id -> features (+ boxes)`` records to ``<path>.partial`` and move it to ``path`` on close.

    An interrupted run leaves no half-written store at ``path``. The map grows on demand,
    so ``map_size`` is only a starting point.
    """

    def __init__(self, path: str | os.PathLike, map_size: int | None = None, overwrite: bool = False,
                 commit_bytes: int = 256 << 20):
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        if os.path.exists(self.path) and not overwrite:
            raise UserError(f"{self.path} already exists; delete it, choose another --out, or pass --overwrite.")
        self.tmp = self.path + ".partial"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.env = _lmdb().open(self.tmp, map_size=int(map_size or 1 << 30), subdir=True, meminit=False,
                                map_async=True, sync=False, mode=0o666)  # files as open() makes them
        self.commit_bytes = commit_bytes
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._ids: list[str] = []
        self._seen: set[str] = set()
        self._meta: dict[str, Any] = {}

    def put(self, sample_id: Any, features: np.ndarray, boxes: np.ndarray | None = None, image_width: int = 0,
            image_height: int = 0, num_boxes: int | None = None, fp16: bool = False,
            boxes_normalised: bool = False) -> None:
        key = key_of(sample_id)
        if key in self._seen or key.encode() in (META_KEY, MMF_KEYS):
            raise UserError(f"feature id {key!r} appears twice (or is reserved) while writing {self.path}; "
                            "ids must be unique.")
        value = fmt.encode(features, boxes, image_width, image_height, num_boxes, fp16, boxes_normalised)
        if not self._meta:
            rec = fmt.decode(value)
            self._meta = {"dim": int(rec.features.shape[1]), "dtype": str(rec.features.dtype)}
        self._seen.add(key)
        self._ids.append(key)
        self._pending.append((key.encode(), value))
        self._pending_bytes += len(value)
        if self._pending_bytes >= self.commit_bytes:
            self._flush()

    def _flush(self) -> None:
        lmdb = _lmdb()
        while self._pending:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value)
                self._pending, self._pending_bytes = [], 0
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                self.env.set_mapsize(max(2 * size, size + 4 * self._pending_bytes))

    def close(self) -> str:
        """Write the id list, sync and move the store into place; returns its path."""
        meta = {"format": "mmvl-features", "version": fmt.VERSION, "count": len(self._ids), **self._meta,
                "ids": self._ids}
        self._pending.append((META_KEY, json.dumps(meta).encode()))
        self._flush()
        self.env.sync(True)
        self.env.close()
        if os.path.exists(self.path):
            forget_env(self.path)
            shutil.rmtree(self.path) if os.path.isdir(self.path) else os.remove(self.path)
        io.publish(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        self.env.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "LMDBFeatureWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type is not None else self.close()


#: one read-only environment per path and process (py-lmdb refuses to open a path twice),
#: with the :class:`_ValueMap` of the same file (or None)
_ENVS: dict[str, tuple[int, Any, "_ValueMap | None"]] = {}


def open_env(path: str) -> Any:
    """The process's shared read-only environment for ``path``; re-opened after a fork."""
    return _handles(path)[0]


def _handles(path: str) -> tuple[Any, "_ValueMap | None"]:
    pid = os.getpid()
    cached = _ENVS.get(path)
    if cached is not None:
        if cached[0] == pid:
            return cached[1], cached[2]
        cached[1].close()  # inherited through fork: never use a parent's environment
    lmdb = _lmdb()
    subdir = os.path.isdir(path)
    data_file = os.path.join(path, "data.mdb") if subdir else path
    try:
        fd = os.open(data_file, os.O_RDONLY)
    except OSError:
        fd = -1  # lmdb.open below names the problem
    try:
        try:
            env = lmdb.open(path, subdir=subdir, readonly=True, lock=False, readahead=False,
                            meminit=False, max_readers=512)
        except lmdb.Error as e:
            _ENVS.pop(path, None)
            raise UserError(f"{path} is not a readable LMDB ({str(e).strip()}); {RERUN}.") from None
        values = _ValueMap.open(fd, data_file, env) if fd >= 0 else None
    finally:
        if fd >= 0:
            os.close(fd)
    _ENVS[path] = (pid, env, values)
    return env, values


def forget_env(path: str) -> None:
    """Close this process's environment for ``path`` (before the store is replaced on disk).

    Tensors already read keep their own map of the old file, so they stay valid."""
    cached = _ENVS.pop(path, None)
    if cached is not None and cached[0] == os.getpid():
        cached[1].close()


#: LMDB's 16-byte page header (``MDB_page``): page number, pad, flags, overflow page count
_PAGE_HEAD = struct.Struct("=QHHI")
_P_OVERFLOW = 0x04
#: /proc/self/pagemap, top byte of an entry: 1 where the page is present (0x80) or swapped (0x40)
#: but not a file page (0x20), i.e. a private copy made by a write
_WRITTEN = bytes(int(bool(v & 0xC0) and not v & 0x20) for v in range(256))


class _ValueMap:
    """Large values as views of a private (``MAP_PRIVATE``), writable map of the store's data file.

    A view shares the page cache (no copy) yet behaves like a copy of its own: an in-place
    edit makes private copies of the pages it touches (it neither faults on LMDB's read-only
    map nor changes the store); while a view of a value lives, other reads of that value get
    real copies, so two samples never alias; and when the view dies, pages it wrote to are
    dropped (``MADV_DONTNEED``, found through ``/proc/self/pagemap``), so the next view of
    that value sees the file again. The view also keeps this map alive on its own, whatever
    happens to the environment. Linux only; elsewhere every read copies.

    LMDB keeps a value larger than a page in consecutive overflow pages, right after a page
    header that holds the page's own number; :meth:`share` reads that header just before the
    value, and uses a view only when this file holds the same header and record header at
    that page (the file is the environment's: :func:`_handles` checks the inode).
    """

    def __init__(self, mm: mmap.mmap, size: int, psize: int, pagemap: int):
        self.mm, self.size, self.psize, self.pagemap = mm, size, psize, pagemap
        self.base = np.frombuffer(mm, np.uint8, 1).__array_interface__["data"][0]
        self.pid = os.getpid()
        self.live: dict[int, Any] = {}  # first page (file offset) of each value with a live view -> its weakref
        self.lock = threading.RLock()  # reentrant: a finaliser may run inside share() on this thread

    @classmethod
    def open(cls, fd: int, data_file: str, env: Any) -> "_ValueMap | None":
        if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_size_t) != 8:
            return None  # pagemap and MADV_DONTNEED's private-map semantics; pgno_t is size_t
        try:
            st, now = os.fstat(fd), os.stat(data_file)
            psize = int(env.stat()["psize"])
            if (st.st_ino, st.st_dev) != (now.st_ino, now.st_dev) or st.st_size == 0 or psize % mmap.PAGESIZE:
                return None  # replaced while the environment opened (it may map another file), or odd pages
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError):
            return None
        try:
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
            mm.madvise(mmap.MADV_RANDOM)  # like the environment's readahead=False
            values = cls(mm, st.st_size, psize, pagemap)
            values._written(0, 1)  # pagemap readable here?
        except (OSError, ValueError):
            os.close(pagemap)
            return None
        weakref.finalize(values, os.close, pagemap)
        return values

    def share(self, buf: memoryview, features: np.ndarray) -> np.ndarray:
        """``features`` (decoded from ``buf``) as a view of this map; a copy where another view of
        the value lives; unchanged (a view of LMDB's buffer) where the layout is not certain."""
        n = len(buf)
        if n < self.psize:
            return features  # small values live inside leaf pages: copied
        addr = features.__array_interface__["data"][0] - fmt.HEADER_SIZE
        head = ctypes.string_at(addr - _PAGE_HEAD.size, _PAGE_HEAD.size)
        pgno, _, flags, pages = _PAGE_HEAD.unpack(head)
        start = pgno * self.psize
        off = start + _PAGE_HEAD.size
        if not flags & _P_OVERFLOW or pages * self.psize < _PAGE_HEAD.size + n or off + n > self.size:
            return features
        if self.mm[start:off + fmt.HEADER_SIZE] != head + bytes(buf[:fmt.HEADER_SIZE]):
            return features
        with self.lock:
            if start in self.live:
                return np.array(features)  # its own memory, never an alias of the live view
            view = np.ndarray(features.shape, features.dtype, self.mm, off + fmt.HEADER_SIZE)
            self.live[start] = weakref.ref(view, functools.partial(self._release, start, pages * self.psize))
        return view

    def _release(self, start: int, length: int, _ref: Any = None) -> None:
        if os.getpid() != self.pid:
            return  # a copy inherited through fork: this process reads through its own map
        with self.lock:
            self.live.pop(start, None)
            try:
                if self._written(start, length):
                    self.mm.madvise(mmap.MADV_DONTNEED, start, length)  # back to the file's pages
            except (OSError, ValueError):
                pass  # interpreter exit: the pagemap fd or the map is already closed, nothing to restore

    def _written(self, start: int, length: int) -> bool:
        first, pages = (self.base + start) // mmap.PAGESIZE, -(-length // mmap.PAGESIZE)
        entries = os.pread(self.pagemap, 8 * pages, 8 * first)
        return b"\x01" in entries[7::8].translate(_WRITTEN)


class LMDBFeatureReader:
    """``reader[id]`` -> padded feature tensors (see :func:`~mmvl.data.features.assemble.to_sample`).

    Holds no environment itself (so it pickles to spawned workers as a path): every
    read asks :func:`open_env` for this process's one, opened on first use after a fork.

    ``allow_pickle`` also reads MMF's pickled-dict LMDBs; only for trusted files.
    """

    def __init__(self, path: str | os.PathLike, max_features: int | None = None, allow_pickle: bool = False):
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.exists(self.path):
            raise UserError(f"feature LMDB {self.path} does not exist; create it with `mmvl_features convert` "
                            "or `mmvl_features extract`, or fix the features path.")
        self.max_features = check_max_features(max_features)
        self.allow_pickle = bool(allow_pickle)
        self._ids: list[str] | None = None

    # -- reading ---------------------------------------------------------------------
    def __getitem__(self, sample_id: Any) -> dict[str, Any]:
        env, values = _handles(self.path)
        key = key_of(sample_id)
        with env.begin(buffers=True) as txn:
            buf = txn.get(key.encode())
            if buf is None:
                raise UserError(self._missing(key))
            try:
                if fmt.is_record(buf):
                    rec = fmt.decode(buf)
                    features = rec.features if values is None else values.share(buf, rec.features)
                    return to_sample(features, rec.boxes, rec.image_width, rec.image_height,
                                     rec.num_boxes, rec.boxes_normalised, self.max_features)
                return self._legacy(key, buf)
            except fmt.FeatureFormatError as e:
                raise UserError(f"feature value for id {key!r} in {self.path} is corrupt ({e}); {RERUN}.") from None

    def _legacy(self, key: str, buf: memoryview) -> dict[str, Any]:
        """MMF's pickled dict per value (``features``, ``bbox``, ``image_width``, ...), behind allow_pickle."""
        if not self.allow_pickle:
            raise UserError(
                f"feature value for id {key!r} in {self.path} is not an mmvl record: a pickled MMF LMDB or a "
                f"corrupt value. Convert it with `mmvl_features convert --mmf-lmdb {self.path} --out NEW.lmdb "
                "--allow-pickle` (or set allow_pickle: true) if the source is trusted; otherwise " + RERUN + ".")
        try:
            item = pickle.loads(buf)
            features = np.asarray(item["features"])
            return to_sample(features, _opt_array(item.get("bbox")), int(item.get("image_width") or 0),
                             int(item.get("image_height") or 0), item.get("num_boxes"), False, self.max_features)
        except fmt.FeatureFormatError:
            raise
        except Exception as e:  # anything unpickling or shaping a damaged value can raise
            raise fmt.FeatureFormatError(f"{type(e).__name__}: {e}") from None

    def ids(self) -> list[str]:
        """Every stored id, in write order (key order for stores written elsewhere)."""
        if self._ids is None:
            env = open_env(self.path)
            with env.begin() as txn:
                meta = txn.get(META_KEY)
                if meta is not None:
                    try:
                        self._ids = [str(i) for i in json.loads(meta)["ids"]]
                    except (ValueError, KeyError, TypeError) as e:
                        raise UserError(f"the id list in {self.path} is corrupt ({e}); {RERUN}.") from None
                else:
                    self._ids = [k.decode("utf-8", "replace") for k in txn.cursor().iternext(values=False)
                                 if k not in (META_KEY, MMF_KEYS)]
        return self._ids

    def _missing(self, key: str) -> str:
        ids = self.ids()
        example = f", e.g. {ids[0]!r}" if ids else ""
        return (f"no features for id {key!r} in {self.path} ({len(ids)} ids{example}); check that the "
                "dataset's image ids match the ids the features were written with.")

    def __contains__(self, sample_id: Any) -> bool:
        env = open_env(self.path)
        with env.begin(buffers=True) as txn:
            return txn.get(key_of(sample_id).encode()) is not None

    def __len__(self) -> int:
        return len(self.ids())

    def __repr__(self) -> str:
        return f"LMDBFeatureReader({self.path!r}, max_features={self.max_features})"


def _opt_array(value: Any) -> np.ndarray | None:
    return None if value is None else np.asarray(value)
