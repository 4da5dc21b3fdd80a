"""Files that are whole or absent: the one owner of atomic writes, folder publishing and safe loading.

Every file mmvl writes for others to read (checkpoints, ``config.yaml``, predictions, pictures,
traces, preprocessing caches, generated data, feature stores) goes through this module, so a
crash leaves either the old file or the new one, never half of it:

- :func:`atomic_open` / :func:`atomic_write` / :func:`atomic_save`: a temp file beside the target,
  written, fsynced, renamed over it, the folder fsynced;
- :func:`link_replace`: one path names another's file (hard link, else a copy); :func:`publish_dir`:
  a folder built aside, marked complete, renamed into place;
- :data:`MARKER` (``COMPLETE.json``): the one "this folder is complete" marker, listing every
  file with its size (:func:`mark_complete`, :func:`completeness_problem`);
- :func:`move_aside`, :func:`remove_tree`: take files away without a reader seeing half of them;
- :class:`DiskFull`: a write that found no room, in words (:mod:`mmvl.utils.disk`);
- :func:`safe_load`: ``torch.load(weights_only=True)``, every problem one line naming the file.

``os.replace``/``os.rename`` appear nowhere else in ``mmvl/``. Files are created with the
permissions ``open()`` gives under the umask (``mkstemp``/``mkdtemp`` would make them 0600/0700).
torch is imported only by the functions that need it, so config loading stays light.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from mmvl.errors import UserError
from mmvl.utils import disk

log = logging.getLogger(__name__)

#: the completeness marker of a folder published whole (sharded checkpoints, caches, generated data)
MARKER = "COMPLETE.json"
#: what :func:`temp_path` makes: ``.<name>.<random>.tmp``
TEMP = re.compile(r"^\..+\.tmp$")

def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    with open(path, "rb+") as f:  # flush its data to the disk
        os.fsync(f.fileno())


def temp_path(path: Path) -> Path:
    """A new empty file ``.<name>.<random>.tmp`` beside ``path``, mode 0666 minus the umask."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {path}")


def make_temp_dir(parent: str | os.PathLike[str], prefix: str = ".tmp-") -> Path:
    """A new empty folder under ``parent`` (mode 0777 minus the umask): build a result there, then
    :func:`publish_dir` it."""
    parent = Path(parent)
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary folder name in {parent}")


class DiskFull(UserError):
    """A write found no room (full disk, quota, file-size limit); the old file at ``path`` is intact."""

    def __init__(self, path: Path, reason: str, done: str):
        super().__init__(f"{str(path)!r}: {reason}; {done}")
        self.path, self.reason, self.done = path, reason, done


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], needs: int | None = None) -> Iterator[Path]:
    """A temp file beside ``path`` to fill in the block; renamed over ``path`` on success (the
    folder fsynced), removed otherwise; no room is a :class:`DiskFull` (``needs``: bytes, for its message)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        code = disk.out_of_room(e)
        if code is not None:
            raise DiskFull(path, disk.failure_text(code, path.parent, needs), "temp file removed") from None
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", needs: int | None = None) -> Iterator[IO[Any]]:
    """An open file (``mode`` ``"w"``, UTF-8 text, or ``"wb"``) that becomes ``path`` when the block ends
    without an error (fsynced, renamed over it), removed otherwise: for writers of a file piece by piece."""
    with replacing(path, needs) as tmp:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike[str], mode: str, write: Callable[[Any], Any], needs: int | None = None) -> Path:
    """``write(f)`` into :func:`atomic_open`'s file: ``path`` is the old file or the new one."""
    with atomic_open(path, mode, needs) as f:
        write(f)
    return Path(path)


def atomic_save(obj: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (its folder is created); first a cheap look at the
    room (its arrays' sizes against the free space and ``ulimit -f``): :class:`DiskFull` when short."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    problem = disk.room_problem(path.parent, needs := disk.estimate_bytes(obj))
    if problem:
        raise DiskFull(path, problem, "nothing written")
    return atomic_write(path, "wb", lambda f: torch.save(obj, f), needs)


def link_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Make ``dst`` name the same complete file as ``src`` (hard link, else a copy), atomically."""
    with replacing(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            fsync_file(tmp)
    return Path(dst)


def publish(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Rename a finished file or empty-target folder ``tmp`` over ``path`` and fsync the folder."""
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)
    return Path(path)


def mark_complete(folder: str | os.PathLike[str], **info: Any) -> Path:
    """Fsync ``folder``'s files, then write :data:`MARKER` listing each with its size (plus ``info``):
    call it once every part is written (a folder without it is incomplete)."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MARKER and not TEMP.match(p.name):
            fsync_file(p)
            files[p.name] = p.stat().st_size
    return atomic_write(folder / MARKER, "w", lambda f: json.dump({**info, "files": files}, f))


def read_marker(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker's content (``info`` and ``files``), or None when it is absent or unreadable."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def completeness_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` is not complete (no marker, a file missing or of another size), else None."""
    folder = Path(folder)
    if not (folder / MARKER).is_file():
        return f"no {MARKER} (its writer stopped before every part was written)"
    data = read_marker(folder)
    files = data.get("files") if data else None
    if not isinstance(files, dict):
        return f"unreadable {MARKER}"
    for name, size in files.items():
        part = folder / name
        if not part.is_file():
            return f"part {name} is missing"
        if part.stat().st_size != size:
            return f"part {name} has {part.stat().st_size} bytes, expected {size}"
    return None


def publish_dir(tmp: str | os.PathLike[str], path: str | os.PathLike[str], **info: Any) -> bool:
    """Mark the folder ``tmp`` complete and rename it to ``path``. False when another process
    published ``path`` first (``tmp`` is then removed and theirs is used); raises otherwise."""
    tmp, path = Path(tmp), Path(path)
    try:
        mark_complete(tmp, **info)
        try:
            os.rename(tmp, path)
        except OSError:
            if completeness_problem(path) is not None:
                raise
            remove_tree(tmp)
            return False
        fsync_dir(path.parent)
        return True
    except BaseException:
        remove_tree(tmp)
        raise


def move_aside(paths: Iterable[str | os.PathLike[str]], target: str | os.PathLike[str]) -> Path:
    """Rename each of ``paths`` into the new folder ``target`` (same file system: nothing copied)."""
    target = Path(target)
    target.mkdir(parents=True)
    parents = set()
    for path in map(Path, paths):
        os.rename(path, target / path.name)
        parents.add(path.parent)
    for parent in parents | {target.parent}:
        fsync_dir(parent)
    return target


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a folder; renamed out of the way first, so a reader never sees half of it."""
    path = Path(path)
    trash = path.with_name(f".trash-{path.name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def cut_torn_line(path: str | os.PathLike[str]) -> int:
    """Remove an append-only text file's last line when it has no newline (a writer died in it);
    returns the bytes removed (0: the file ends whole or does not exist)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        keep, block = 0, 1 << 16
        pos = size
        while pos > 0:  # the last newline, read backwards a block at a time
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            found = chunk.rfind(b"\n")
            if found >= 0:
                keep = start + found + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


def remove_stale_temps(folder: str | os.PathLike[str]) -> list[Path]:
    """Delete the temp files a killed writer left in ``folder`` (its one writer calls this)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.is_file() and TEMP.match(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d temp file(s) of an interrupted save from %s", len(stale), folder)
    return stale


def safe_load(path: str | os.PathLike[str], map_location: Any = "cpu",
              expect_keys: Iterable[str] = ("model",), mmap: bool = False) -> dict[str, Any]:
    """Load a ``torch.save`` file with ``weights_only=True``; any problem is a UserError naming ``path``.

    ``mmap=True`` maps tensors instead of reading them: a cheap look at the counters that still
    refuses a truncated file (its zip directory is missing).
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {str(path)!r} does not exist; check the path "
                        "(checkpoint.resume_file / the run's save_dir).")
    not_torch = _not_a_torch_file(path)
    if not_torch:
        raise UserError(f"checkpoint {str(path)!r} is {not_torch}, not a checkpoint written by torch.save; "
                        "point checkpoint.resume_file at a .ckpt file (e.g. <save_dir>/checkpoints/last.ckpt).")
    try:
        try:
            obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if not (mmap and "mmap can only be used" in str(e)):
                raise
            obj = torch.load(path, map_location=map_location, weights_only=True)  # a legacy-format file
    except Exception as e:  # noqa: BLE001 - torch raises many types for bad files
        text = str(e)
        if "Weights only load failed" in text or "Unsupported global" in text:
            culprit = re.search(r"GLOBAL\s+([\w.]+)", text)
            what = f" (e.g. {culprit.group(1)})" if culprit else ""
            raise UserError(
                f"checkpoint {str(path)!r} contains pickled Python objects{what}; mmvl only loads "
                "weights-only checkpoints (tensors and plain containers). Re-save it from trusted code as "
                "plain state dicts."
            ) from None
        raise UserError(f"checkpoint {str(path)!r} is truncated or corrupt ({type(e).__name__}: "
                        f"{text.splitlines()[0].split('. ')[0][:120] if text else 'no detail'}); use another checkpoint.") from None
    if not isinstance(obj, dict):
        raise UserError(f"checkpoint {str(path)!r} is not an mmvl checkpoint: it holds a "
                        f"{type(obj).__name__}, expected a dict of state dicts.")
    missing = [k for k in expect_keys if k not in obj]
    if missing:
        raise UserError(f"checkpoint {str(path)!r} is not an mmvl checkpoint: it lacks {missing} "
                        f"(has {sorted(map(str, obj))[:8]}).")
    return obj


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since 1.6
_PICKLE_PROTO = 0x80  # the legacy format starts with a pickle protocol opcode


def _not_a_torch_file(path: Path) -> str | None:
    """What ``path`` is when its first bytes show it cannot be a ``torch.save`` file (else None).

    Without this, unpickling a text file fails on whatever opcode its first letter happens to
    be, and the message blames pickled objects or corruption.
    """
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "an empty file"
    if head.startswith(_ZIP_MAGIC) or head[0] == _PICKLE_PROTO:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte character cut at 512 bytes is still text
        text = head[:e.start].decode("utf-8") if e.start > len(head) - 4 else ""
    if text and all(c.isprintable() or c in "\t\r\n\f" for c in text):
        first = text.strip().splitlines()[0][:40] if text.strip() else ""
        return f"a text file (it starts with {first!r})"
    return f"a file of another format (it starts with bytes {head[:8].hex(' ')})"
