"""Room on the disk, in words: how much a write needs against what the disk and the file-size
limit allow, and which failures mean "out of room" (a full disk, a quota, ``ulimit -f``).

Kept apart from :mod:`mmvl.io` (its only user) so that module stays one job: a torch.save that runs
out of room surfaces as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``,
with the real ``OSError`` only in its context chain; :func:`out_of_room` finds it there.
"""
from __future__ import annotations

import errno
import os
import resource
import shutil
from pathlib import Path

#: the errors that mean the write could not get room (EFBIG: the file-size limit, SIGXFSZ ignored)
ROOM_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_room(exc: BaseException | None) -> int | None:
    """The errno when ``exc`` or an exception it was raised from is a no-room ``OSError``, else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in ROOM_ERRORS:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def size_text(n: int | None) -> str:
    """``n`` bytes for a person: ``512 B``, ``6.2 kB``, ``55.1 MB``."""
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def free_bytes(folder: str | os.PathLike[str]) -> int | None:
    """Bytes free to this user on the disk that holds ``folder`` (its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def file_size_limit() -> int | None:
    """The soft ``RLIMIT_FSIZE`` (``ulimit -f``) in bytes, None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def room_problem(folder: str | os.PathLike[str], needs: int) -> str | None:
    """Why a file of ``needs`` bytes cannot be written in ``folder`` (checked before writing), else None."""
    limit = file_size_limit()
    if limit is not None and needs > limit:
        return f"the file-size limit (ulimit -f: {size_text(limit)}) is below the ~{size_text(needs)} needed"
    free = free_bytes(folder)
    if free is not None and needs > free:
        return f"the disk is full (~{size_text(needs)} needed, {size_text(free)} free)"
    return None


def failure_text(code: int, folder: str | os.PathLike[str], needs: int | None) -> str:
    """What a write that failed with ``code`` (one of :data:`ROOM_ERRORS`) ran into, with the sizes."""
    wanted = f"~{size_text(needs)}" if needs is not None else "more"
    if code == errno.EFBIG:
        return f"the file-size limit (ulimit -f: {size_text(file_size_limit())}) was hit ({wanted} needed)"
    what = "the disk quota is used up" if code == errno.EDQUOT else "the disk is full"
    return f"{what} ({wanted} needed, {size_text(free_bytes(folder))} free)"


def estimate_bytes(obj: object) -> int:
    """About how many bytes ``torch.save(obj)`` writes, from a walk over the containers (nothing
    serialised): each array's ``nbytes`` plus its zip record (~256 B), each string its length, each
    other value a few bytes of pickle. Close rather than safe: an estimate above the truth would
    refuse writes that fit, one below it ends in the write's own error (:func:`out_of_room`)."""
    if isinstance(obj, (bytes, str)):
        return len(obj) + 4
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes) + 256
    if isinstance(obj, dict):
        return 4 + sum(estimate_bytes(k) + estimate_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        return 4 + sum(estimate_bytes(v) for v in obj)
    return 8
