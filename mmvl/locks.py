"""A run owns its save dir: an advisory lock held for the life of the process that took it.

Its own module (layer 1, beside ``io``): the lock is about who may write a folder, not how files
are written. The trainer takes it on rank 0 before anything is written there.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from mmvl.errors import UserError

#: the lock file a run holds in its save dir for as long as it runs
LOCK = ".mmvl.lock"
_HELD: dict[str, int] = {}  # the locks this process holds: resolved path -> open descriptor


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, say): close the inherited lock descriptors.

    An ``flock`` belongs to the open file description, which a fork shares; a worker that kept its
    copy would hold the folder after its parent was SIGKILLed, until it noticed the parent was gone
    (seconds), and a restart in between would be refused. Closing the child's copy leaves the
    parent's lock held; only the process that took the lock holds it."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


def _holder(fd: int, wait_s: float = 2.0) -> str:
    """Who holds the lock on ``fd``, as its holder wrote it. The holder writes its name just after
    taking the lock, so a run started at the same moment can find the file empty or half written:
    it reads again for up to ``wait_s`` before it settles for not knowing."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return "a process that has not written its name yet"
            time.sleep(0.02)


def lock_dir(folder: str | os.PathLike[str], key: str = "env.save_dir") -> Path:
    """Own ``folder`` for the rest of this process: an advisory ``flock`` on :data:`LOCK` there,
    which the OS releases when the process ends, however it ends (a SIGKILLed run leaves no stale
    lock; its forked workers drop their copy at fork, so they never hold it, and spawned ones never
    get the descriptor, which is not inheritable). Another process holding it is a UserError naming it (host, pid, start); this process
    may take it again (several runs one after another in one interpreter). On NFS, flock is
    emulated with byte-range locks (Linux since 2.6.12), which NFSv4 servers honour."""
    import fcntl
    import socket

    path = (Path(folder) / LOCK).resolve()
    if str(path) in _HELD:
        return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        who = _holder(fd)
        os.close(fd)
        raise UserError(f"{key}={str(folder)!r} is in use by another run ({who}); wait for it to end or stop "
                        f"it, or choose another {key}.") from None
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode(), 0)
    os.fsync(fd)
    _HELD[str(path)] = fd
    return path
