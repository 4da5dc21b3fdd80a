"""Shared-memory batches: how a DataLoader worker hands a collated batch to the main process.

Torch's default transfer makes a fresh shared-memory segment per tensor per batch and hands
each one over through a socket; fresh shared pages cost the kernel far more than the copy
itself (about 13 ms for a 13 MB batch of region features here, against 1 ms to refill a
reused segment), which capped every feature store at the same rate. Here a worker's
:func:`~mmvl.data.sample.collate` writes every tensor of a batch into one reusable
*arena* (a ``memfd``); the main process maps each arena once and hands it back when the
batch's last tensor dies. Linux only (``ARENAS``); elsewhere collate falls back to torch's
per-tensor shared memory. Holding any tensor of such a batch keeps the whole arena busy,
so code that keeps parts of batches (e.g. evaluation) should clone them.
"""
from __future__ import annotations

import contextlib
import mmap
import multiprocessing.reduction
import multiprocessing.util
import os
import threading
import weakref
from typing import Any, Mapping

import numpy as np
import torch

# -- Shared-memory batches ----------------------------------------------------------------------
# A worker keeps a pool of arenas (memfd segments, mapped once). Each collated batch takes a free
# arena, and its tensors are views into it. The DataLoader's queue pickles the batch with
# ForkingPickler, which for ``_SharedBatch`` sends only the arena's token and each tensor's
# dtype/shape/offset (plus, the first time an arena travels, its fd). The main process maps each
# arena once, builds the tensors on one storage per batch, and when that storage dies (the last
# tensor or view of the batch is gone) marks the arena free in its header, so the worker may
# refill it. The worker writes into an arena only when the main process freed it and no batch of
# its own still uses it. An arena the worker drops (more than _MAX_IDLE idle, or worker exit) is
# marked retired, and the main process then drops its mapping too.
ARENAS = hasattr(os, "memfd_create")
_HEADER = 64          # bytes before the payload: [_STATE] free/busy, [_RETIRED], [_TOKEN] the arena's id
_STATE, _RETIRED = 0, 1
_TOKEN = slice(16, 32)
_BUSY, _FREE = 0, 1
_ALIGN = 64
_MAX_IDLE = 2
_FENCE = threading.Lock()


def _fence() -> None:
    """Order this thread's earlier reads of a batch before its next write to an arena header:
    a lock release followed by an acquire is a full barrier (x86 needs none; weaker CPUs do)."""
    _FENCE.acquire()
    _FENCE.release()
    _FENCE.acquire()
    _FENCE.release()


def _arena_size(nbytes: int) -> int:
    """Room for ``nbytes`` of payload, rounded up (<= 1/8 over) so slightly larger batches fit."""
    need = _HEADER + max(nbytes, 1)
    step = max(mmap.PAGESIZE, 1 << max(0, need.bit_length() - 4))
    return -(-need // step) * step


class _Arena:
    """A worker's shared-memory segment for one batch at a time."""

    def __init__(self, size: int):
        self.size = size
        self.fd = os.memfd_create("mmvl-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = os.urandom(16)
        self.mm[_TOKEN] = self.token
        self.pid = os.getpid()
        self.sent = False   # the main process got its fd
        self.local = False  # a batch in this process still uses it
        self.lent = False   # its current batch went to the main process, which will free it

    def idle(self) -> bool:
        return not self.local and self.mm[_STATE] == _FREE

    def release_local(self) -> None:
        self.local = False
        if not self.lent:
            self.mm[_STATE] = _FREE  # never left this process

    def retire(self, close: bool = True) -> None:
        self.mm[_RETIRED] = 1
        if close:
            os.close(self.fd)
            with contextlib.suppress(BufferError):  # a finaliser on another thread may still export it
                self.mm.close()


class _ArenaPool:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.arenas: list[_Arena] = []
        self.lock = threading.Lock()  # collate may run on several threads of a worker
        multiprocessing.util.Finalize(self, _retire_all, args=(self.arenas,), exitpriority=0)

    def take(self, nbytes: int) -> _Arena:
        with self.lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> _Arena:
        need = _HEADER + nbytes
        best = None
        for a in self.arenas:
            if a.size >= need and (best is None or a.size < best.size) and a.idle():
                best = a
        if best is None:
            best = _Arena(_arena_size(nbytes))
            self.arenas.append(best)
        else:
            _fence()  # the main process's reads of the last batch here come before our writes
        best.mm[_STATE] = _BUSY
        best.local, best.lent = True, False
        idle = [a for a in self.arenas if a is not best and a.idle()]
        if len(idle) > _MAX_IDLE:
            for a in sorted(idle, key=lambda a: a.size)[: len(idle) - _MAX_IDLE]:
                self.arenas.remove(a)
                a.retire()
        return best


def _retire_all(arenas: list[_Arena]) -> None:
    for a in arenas:
        if not a.mm.closed:
            a.retire(close=False)  # batches may still be in flight; the exit unmaps


_POOL: _ArenaPool | None = None


def _pool() -> _ArenaPool:
    global _POOL
    if _POOL is None or _POOL.pid != os.getpid():
        _POOL = _ArenaPool()
    return _POOL


def into_arena(batch: dict[str, Any], slots: list[Any]) -> "_SharedBatch":
    """Lay ``slots`` (``sample``'s collate plan: shape, like, nbytes, fill, parent, key per tensor)
    out in one arena and fill each in place, so the batch crosses to the main process as one mapping."""
    end = 0
    for s in slots:
        s.offset = -(-end // _ALIGN) * _ALIGN
        end = s.offset + s.nbytes
    arena = _pool().take(end)
    storage = _storage(arena.mm, end, arena.release_local)
    for s in slots:
        out = torch.empty(0, dtype=s.like.dtype).set_(storage, s.offset // s.like.element_size(), s.shape)
        s.fill(out)
        s.parent[s.key] = out
    shared = _SharedBatch(batch)
    shared._arena, shared._ptr, shared._nbytes = arena, storage.data_ptr(), end
    return shared


def _storage(mm: mmap.mmap, nbytes: int, on_free: Any) -> torch.UntypedStorage:
    """One storage over an arena's payload; ``on_free`` runs when its last tensor is gone."""
    arr = np.frombuffer(mm, np.uint8, count=max(nbytes, 1), offset=_HEADER)
    storage = torch.from_numpy(arr).untyped_storage()  # holds ``arr`` until the storage dies
    weakref.finalize(arr, on_free).atexit = False
    return storage


class _SharedBatch(dict):
    """A worker's batch whose tensors live in an arena (see above); a plain dict to everything but
    the DataLoader's queue: ordinary pickling (``torch.save``, ``copy``) copies it as a dict."""

    _arena: _Arena | None = None
    _ptr = 0
    _nbytes = 0
    _lent = False

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


class _Ref:
    """A tensor inside an arena, as sent: dtype, shape, stride and offset in elements."""

    __slots__ = ("dtype", "shape", "stride", "offset")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], offset: int):
        self.dtype, self.shape, self.stride, self.offset = dtype, shape, stride, offset

    def __reduce__(self) -> Any:
        return _Ref, (self.dtype, self.shape, self.stride, self.offset)


def _encode(d: Mapping[str, Any], ptr: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.untyped_storage().data_ptr() == ptr:
            out[k] = _Ref(v.dtype, tuple(v.shape), v.stride(), v.storage_offset())
        elif type(v) is dict:
            out[k] = _encode(v, ptr)
        else:
            out[k] = v  # anything else (a tensor made after collate, strings) travels as usual
    return out


def _reduce_shared_batch(batch: _SharedBatch) -> Any:
    """ForkingPickler's reduction: the batch by reference to its arena (once; again it is a dict)."""
    arena = batch._arena
    if arena is None or batch._lent or arena.pid != os.getpid() or arena.mm.closed:
        return dict, (dict(batch),)
    batch._lent = arena.lent = True
    dup = None
    if not arena.sent:
        dup = multiprocessing.reduction.DupFd(arena.fd)
        arena.sent = True
    return _rebuild, (arena.token, arena.pid, arena.fd, arena.size, dup, batch._nbytes,
                      _encode(batch, batch._ptr))


multiprocessing.reduction.ForkingPickler.register(_SharedBatch, _reduce_shared_batch)


class _Mapped:
    __slots__ = ("mm", "pid")

    def __init__(self, mm: mmap.mmap, pid: int):
        self.mm, self.pid = mm, pid


#: the receiving process's mapping of every arena it has seen, by token
_MAPPED: dict[bytes, _Mapped] = {}


def _rebuild(token: bytes, pid: int, fdnum: int, size: int, dup: Any, nbytes: int,
             tree: dict[str, Any]) -> dict[str, Any]:
    """Unpickling side: the batch as a plain dict whose tensors share one storage over the arena."""
    entry = _MAPPED.get(token)
    fd = dup.detach() if dup is not None else None
    try:
        if entry is None:
            if fd is None:  # its first batch never arrived here (e.g. dropped at a shutdown)
                try:
                    fd = os.open(f"/proc/{pid}/fd/{fdnum}", os.O_RDWR)
                except OSError as e:
                    raise RuntimeError(f"mmvl collate: cannot map the shared batch memory of worker {pid} "
                                       f"({e}); was the batch sent to a process other than its loader's?") from None
            mm = mmap.mmap(fd, size)
            if mm[_TOKEN] != token:
                raise RuntimeError(f"mmvl collate: the shared batch memory of worker {pid} is not the arena sent")
            _drop_stale(check_pids=True)
            entry = _MAPPED[token] = _Mapped(mm, pid)
    finally:
        if fd is not None:
            os.close(fd)
    storage = _storage(entry.mm, nbytes, _Release(entry.mm))
    return _decode(tree, storage)


class _Release:
    """Marks an arena free when a batch's storage dies, in the process that received it."""

    __slots__ = ("mm", "pid")

    def __init__(self, mm: mmap.mmap):
        self.mm, self.pid = mm, os.getpid()

    def __call__(self) -> None:
        if os.getpid() != self.pid or self.mm.closed:
            return  # a forked copy of the batch dying: the receiver still holds it
        _fence()  # every read of the batch comes before the worker may write again
        self.mm[_STATE] = _FREE
        if self.mm[_RETIRED]:
            _drop_stale()


def _drop_stale(check_pids: bool = False) -> None:
    """Forget arenas their worker retired (or, with ``check_pids``, whose worker is gone)."""
    for token, entry in list(_MAPPED.items()):
        gone = bool(entry.mm[_RETIRED])
        if not gone and check_pids:
            try:
                os.kill(entry.pid, 0)
            except ProcessLookupError:
                gone = True
            except OSError:
                pass
        if gone:
            _MAPPED.pop(token, None)  # the mapping itself lasts while a batch still uses it


def _decode(tree: dict[str, Any], storage: torch.UntypedStorage) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if type(v) is _Ref:
            out[k] = torch.empty(0, dtype=v.dtype).set_(storage, v.offset, v.shape, v.stride)
        elif type(v) is dict:
            out[k] = _decode(v, storage)
        else:
            out[k] = v
    return out
