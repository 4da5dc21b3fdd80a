"""Checkpoint files: atomic writes, keep-N pruning, best/last links, safe loading.

A checkpoint is a plain dict of state dicts (``model``, ``optimizer``,
``scaler``, ``scheduler``, ``trainer``, ``data``, ``rng``, ``config``) holding
only tensors and Python builtins, so it loads with ``weights_only=True`` and a
downloaded file can never run code. (numpy RNG state must be stored as a
tensor or list, and the config as a plain container.)

Layout under ``<save_dir>/checkpoints/``: ``model_<update>.ckpt`` (periodic,
pruned to the newest ``max_to_keep``), ``last.ckpt`` and ``best.ckpt``. The
state is serialised once; ``last``/``best`` are hard links (a copy where the
filesystem has none) switched in by ``os.replace``, so they always name a
complete file, even if the process dies mid-save. Temp files a killed process
left behind are removed by the next run's first save.

Sharded checkpoints (one part per rank, e.g. FSDP through DCP) are a directory
that counts as complete only once every rank's part is written and rank 0 has
added :data:`SHARDED_MARKER` (listing each file and its size);
:func:`check_sharded_complete` refuses any other directory, and
:meth:`CheckpointManager.latest_sharded` skips it. A trainer's sharded
checkpoint also holds :data:`SHARDED_STATE` (everything but model and
optimizer, written by rank 0 before the marker). :func:`save_sharded` and
:func:`load_sharded` own that layout; a strategy only writes and reads its parts
of the state dicts. :meth:`CheckpointManager.find_latest` picks the newest complete
checkpoint of either form, :meth:`CheckpointManager.choose_resume` the one a run
resumes from. Files are created with the permissions ``open()`` gives under the
umask (temp files from ``mkstemp`` would stay 0600).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

import torch

from mmvl.errors import UserError

log = logging.getLogger(__name__)

_PERIODIC = re.compile(r"^model_(\d+)\.ckpt$")
_SHARDED = re.compile(r"^sharded_(\d+)$")
_TEMP = re.compile(r"^\..+\.tmp$")  # what _temp_path makes
SHARDED_MARKER = "COMPLETE.json"
SHARDED_STATE = "state.ckpt"  # the rest of a trainer's checkpoint inside a sharded directory
_PREFIXES = ("module.", "_orig_mod.")


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    """A new empty file ``.<name>.<random>.tmp`` beside ``path``, created with mode 0666 minus the
    umask (as a plain ``open()`` would; ``tempfile.mkstemp`` would make it 0600 for good)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {path}")


def make_temp_dir(parent: str | os.PathLike, prefix: str = ".tmp-") -> Path:
    """A new empty folder under ``parent`` (mode 0777 minus the umask, unlike ``tempfile.mkdtemp``'s
    0700): build a result there, then rename it into place."""
    parent = Path(parent)
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary folder name in {parent}")


def atomic_save(obj: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """``torch.save`` to a temp file beside ``path``, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, "wb", lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike, mode: str, write: Callable[[Any], Any]) -> Path:
    """``write(f)`` into a temp file beside ``path``, fsync, rename over ``path``, fsync the folder.

    The one atomic writer: checkpoints, markers, ``config.yaml`` and predictions all
    go through it, so a crash leaves either the old file or the new one, never half.
    ``mode`` is ``"wb"`` or ``"w"`` (text is UTF-8). The file gets the permissions a plain
    ``open(path, "w")`` would (0666 minus the umask).
    """
    with atomic_open(path, mode) as f:
        write(f)
    return Path(path)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """:func:`atomic_write` for writers that produce a file piece by piece (e.g. predictions
    during evaluation): the file of the block is fsynced and renamed over ``path`` when the
    block ends without an error, and removed otherwise."""
    with _replacing(Path(path)) as tmp:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def _link_replace(src: Path, dst: Path) -> None:
    """Make ``dst`` name the same complete file as ``src`` (hard link, else copy), atomically."""
    def fill(tmp: Path) -> None:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())

    _replace(dst, fill)


def _replace(path: Path, fill: Any) -> Path:
    """``fill(tmp)`` a temp file beside ``path``, rename it over ``path``, fsync the folder; no temp left."""
    with _replacing(path) as tmp:
        fill(tmp)
    return path


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temp file beside ``path`` to fill in the block; renamed over ``path`` on success, else removed."""
    tmp = _temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def safe_load(path: str | os.PathLike, map_location: Any = "cpu",
              expect_keys: Iterable[str] = ("model",), mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; any problem is a UserError naming ``path``.

    ``mmap=True`` maps tensors instead of reading them: a cheap look at the counters
    that still refuses a truncated file (its zip directory is missing).
    """
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
                        f"{text.splitlines()[0][:200] if text else 'no detail'}); use another checkpoint.") from None
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


class CheckpointManager:
    """Owns ``<save_dir>/checkpoints/``; call from one process (rank 0) only."""

    def __init__(self, save_dir: str | os.PathLike, max_to_keep: int = 5):
        self.dir = Path(save_dir) / "checkpoints"
        self.max_to_keep = int(max_to_keep)
        self._cleaned = False

    @property
    def directory(self) -> Path:
        return self.dir

    @property
    def last_path(self) -> Path:
        return self.dir / "last.ckpt"

    @property
    def best_path(self) -> Path:
        return self.dir / "best.ckpt"

    def periodic_paths(self) -> list[Path]:
        """``model_<update>.ckpt`` files, oldest update first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _PERIODIC.match(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, state: Mapping[str, Any], update: int, is_best: bool = False, periodic: bool = True) -> Path:
        """Write ``state`` once, then switch ``last`` (and ``best``) to it; returns the written file."""
        if not self._cleaned:
            self.remove_stale_temps()
            self._cleaned = True
        if periodic:
            written = atomic_save(state, self.dir / f"model_{int(update)}.ckpt")
            _link_replace(written, self.last_path)
        else:
            written = atomic_save(state, self.last_path)
        if is_best:
            _link_replace(written, self.best_path)
        if periodic:
            self._prune()
        return written

    def save_best(self, state: Mapping[str, Any]) -> Path:
        """Write ``best.ckpt`` alone (a sharded run's periodic saves are directories)."""
        return atomic_save(state, self.best_path)

    def remove_stale_temps(self) -> list[Path]:
        """Delete temp files a killed save left behind (this manager is the only writer)."""
        if not self.dir.is_dir():
            return []
        stale = [p for p in self.dir.iterdir() if p.is_file() and _TEMP.match(p.name)]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            log.info("removed %d temp file(s) of an interrupted save from %s", len(stale), self.dir)
        return stale

    def sharded_path(self, update: int) -> Path:
        """The directory a sharded checkpoint of ``update`` goes to."""
        return self.dir / f"sharded_{int(update)}"

    def sharded_paths(self) -> list[Path]:
        """``sharded_<update>`` directories (complete or not), oldest update first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir()
                 if p.is_dir() and (m := _SHARDED.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest_sharded(self, require: str | None = None) -> Path | None:
        """The newest sharded checkpoint directory that is complete; incomplete ones are skipped.

        ``require``: a file the directory must also hold (e.g. :data:`SHARDED_STATE`).
        """
        for path in self.sharded_paths()[::-1]:
            problem = sharded_problem(path)
            if problem is None and require and not (path / require).is_file():
                problem = f"it has no {require} (a strategy-level save, not a trainer checkpoint)"
            if problem is None:
                return path
            log.warning("skipping incomplete sharded checkpoint %s: %s", path, problem)
        return None

    def prune_sharded(self) -> list[Path]:
        """Keep the newest ``max_to_keep`` complete sharded directories; remove older ones and
        incomplete leftovers of crashed saves. Rank 0 only, right after a save; best effort: a
        directory that cannot be removed is only reported."""
        if self.max_to_keep <= 0:
            return []
        paths = self.sharded_paths()
        complete = [p for p in paths if sharded_problem(p) is None]
        keep = set(complete[-self.max_to_keep:])
        removed = [p for p in paths if p not in keep]
        for path in removed:
            try:
                (path / SHARDED_MARKER).unlink(missing_ok=True)  # incomplete first, then gone
                shutil.rmtree(path)
                log.info("removed sharded checkpoint %s (checkpoint.max_to_keep=%d)", path, self.max_to_keep)
            except OSError as e:
                log.warning("could not prune sharded checkpoint %s: %s", path, e)
        return removed

    def move_aside(self) -> Path | None:
        """Start over without losing anything: move ``checkpoints/`` and ``metrics.jsonl`` into
        ``<save_dir>/previous/<date-time>/``. Returns that folder (None when there was nothing)."""
        save_dir = self.dir.parent
        moving = [p for p in (self.dir, save_dir / "metrics.jsonl")
                  if p.is_file() or (p.is_dir() and any(p.iterdir()))]
        if not moving:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = save_dir / "previous" / stamp
        suffix = 1
        while target.exists():
            suffix += 1
            target = save_dir / "previous" / f"{stamp}-{suffix}"
        target.mkdir(parents=True)
        for path in moving:
            os.rename(path, target / path.name)
        fsync_dir(save_dir)
        return target

    def choose_resume(self, resume: Any, resume_file: str | None = None, resume_best: bool = False,
                      pretrained: bool = False, can_load_sharded: bool = True) -> Path | None:
        """The checkpoint a run resumes from in full, or None to start fresh (rank 0 decides).

        ``resume`` is ``checkpoint.resume`` (true | false | auto). An explicit ``resume_file``
        wins, unless it only provides pretrained weights (``pretrained``): then the run's own
        checkpoints are resumed when there are any, so a restarted fine-tuning run continues
        instead of starting over. ``resume=true`` with nothing to resume is a UserError.
        """
        if resume_file and not pretrained:
            return Path(resume_file)
        mode = str(resume).lower()
        if mode not in ("true", "auto"):
            return None
        found = self.find_latest(best=resume_best, sharded=can_load_sharded)
        if found is None and mode == "true" and not pretrained:
            raise UserError(
                f"checkpoint.resume=true but there is no checkpoint in {self.dir}; run without "
                "checkpoint.resume, or point checkpoint.resume_file at a checkpoint.")
        return found

    def find_latest(self, best: bool = False, sharded: bool = True) -> Path | None:
        """The newest complete checkpoint, a full file or a sharded directory (rank 0 decides).

        ``best``: ``best.ckpt`` when it exists and is readable. Otherwise the first
        readable of ``last.ckpt`` and the periodic files (newest first) is compared
        with the newest complete sharded directory by update; on a tie the sharded one
        wins when ``sharded`` (the caller can read it). Unusable candidates are skipped
        with a warning. None when there is no checkpoint at all; UserError when there
        are some but none is usable, or when the newest is sharded and ``sharded`` is False.
        """
        problems: list[str] = []
        found_full = self._first_loadable(best, problems, mmap=True)
        if found_full is not None and found_full[1] == self.best_path:
            return self.best_path
        full = None if found_full is None else \
            (int((found_full[0].get("trainer") or {}).get("update", -1)), found_full[1])
        found = self.latest_sharded(require=SHARDED_STATE)
        if found is not None:
            update = int(_SHARDED.match(found.name).group(1))
            if full is None or update > full[0] or (update == full[0] and sharded):
                if not sharded:
                    raise UserError(
                        f"the newest checkpoint {str(found)!r} is sharded and this strategy cannot read "
                        "it; resume with distributed.strategy=fsdp (any world size), ddp or single, or "
                        "set checkpoint.resume_file to a full .ckpt file.")
                return found
        if full is not None:
            return full[1]
        self._raise_if_unusable(problems)
        return None

    def _prune(self) -> None:
        if self.max_to_keep <= 0:
            return
        for old in self.periodic_paths()[:-self.max_to_keep]:
            old.unlink(missing_ok=True)  # last/best are separate links and stay valid

    def load_latest(self, best: bool = False, map_location: Any = "cpu") -> tuple[dict[str, Any], Path] | None:
        """Load ``last.ckpt`` (``best.ckpt`` first with ``best``), else the newest periodic file that loads.

        Unusable files are reported with ``logging.warning`` and skipped. Returns
        None when the directory holds no checkpoint at all; raises UserError when
        there are checkpoints but none loads (never silently start over).
        """
        problems: list[str] = []
        found = self._first_loadable(best, problems, map_location=map_location)
        if found is None:
            self._raise_if_unusable(problems)
        return found

    def _first_loadable(self, best: bool, problems: list[str], **load: Any) -> tuple[dict[str, Any], Path] | None:
        """(state, path) of the first full file that loads: best (if asked), last, periodic newest first."""
        if best and not self.best_path.is_file():
            log.warning("checkpoint.resume_best is set but %s does not exist; resuming from the latest.",
                        self.best_path)
        candidates = ([self.best_path] if best else []) + [self.last_path] + self.periodic_paths()[::-1]
        for path in candidates:
            if not path.is_file():
                continue
            try:
                return safe_load(path, **load), path
            except UserError as e:
                log.warning("skipping unusable checkpoint: %s", e)
                problems.append(str(e))
        return None

    def _raise_if_unusable(self, problems: list[str]) -> None:
        if problems:  # checkpoints exist but none loads: never silently start over
            raise UserError(f"no loadable checkpoint in {str(self.dir)!r}; delete or repair the files listed. "
                            f"Problems: {' | '.join(problems)}")


def mark_sharded_complete(directory: str | os.PathLike, **info: Any) -> Path:
    """Rank 0, after every rank's part is written: list the parts and sizes in the marker, atomically."""
    directory = Path(directory)
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir())
             if p.is_file() and p.name != SHARDED_MARKER and not _TEMP.match(p.name)}
    return atomic_write(directory / SHARDED_MARKER, "w", lambda f: json.dump({**info, "files": files}, f))


def sharded_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` is not a complete sharded checkpoint, or None when it is."""
    directory = Path(directory)
    marker = directory / SHARDED_MARKER
    if not marker.is_file():
        return f"no {SHARDED_MARKER} (a rank died before every part was written)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"unreadable {SHARDED_MARKER} ({type(e).__name__})"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"part {name} is missing"
        if path.stat().st_size != size:
            return f"part {name} has {path.stat().st_size} bytes, expected {size}"
    return None


def check_sharded_complete(directory: str | os.PathLike) -> None:
    """Raise a UserError naming ``directory`` unless it is a complete sharded checkpoint."""
    problem = sharded_problem(directory)
    if problem is not None:
        raise UserError(f"sharded checkpoint {str(directory)!r} is incomplete: {problem}; "
                        "resume from an earlier checkpoint.")


def save_sharded(directory: str | os.PathLike, strategy: Any, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None = None) -> Path:
    """Write one sharded checkpoint; every rank calls this (it is a collective).

    Rank 0 first removes the marker (a directory being re-saved is incomplete until the end);
    every rank writes its part of model and optimizer through ``strategy.save_sharded_state``;
    once all parts are on disk rank 0 writes ``extra`` (the rest of the checkpoint) as
    :data:`SHARDED_STATE`, then the marker. A run killed anywhere in between leaves a directory
    without the marker, which :func:`load_sharded` refuses and ``latest_sharded`` skips. A
    failure on rank 0 is raised on every rank, so no rank waits for it.
    """
    from mmvl.distributed import comm

    directory = Path(directory)

    def prepare() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SHARDED_MARKER).unlink(missing_ok=True)

    def finish() -> None:
        if extra is not None:
            atomic_save(extra, directory / SHARDED_STATE)
        mark_sharded_complete(directory, world_size=comm.get_world_size())

    comm.on_main_agreed(prepare, f"prepare {directory}")
    strategy.save_sharded_state(model, optimizer, str(directory))
    comm.synchronize()  # every rank's part is on disk
    comm.on_main_agreed(finish, f"complete {directory}")
    return directory


def load_sharded(directory: str | os.PathLike, strategy: Any, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Load model (and optimizer, unless None) from a complete sharded checkpoint; every rank
    calls this. The strategy reads the parts it needs (re-sharded to this world size)."""
    check_sharded_complete(directory)
    strategy.load_sharded_state(model, optimizer, str(directory))


def apply_state_mapping(state: Mapping[str, Any], mapping: Mapping[str, str] | None) -> dict[str, Any]:
    """Rename checkpoint keys by prefix (``checkpoint.pretrained_state_mapping``).

    ``mapping`` is {checkpoint key prefix: model key prefix}; with a non-empty
    mapping only the mapped keys are kept (load the result with strict=False),
    which is how a pretrained encoder is moved into a fine-tuning model.
    """
    if not mapping:
        return dict(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        canonical = canonical_key(key)
        for src, dst in mapping.items():
            src, dst = str(src).rstrip("."), str(dst or "").rstrip(".")
            if not src or canonical == src or canonical.startswith(src + "."):
                rest = canonical[len(src) + 1:] if src else canonical
                out[".".join(p for p in (dst, rest) if p)] = value
                break
    return out


def canonical_key(key: str) -> str:
    """``key`` without the ``module.`` / ``_orig_mod.`` prefixes that DDP and torch.compile add."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def load_model_state(model: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
    """Load a model state dict (or a checkpoint holding one under ``model``).

    ``module.`` / ``_orig_mod.`` prefixes (DDP, torch.compile) are stripped or
    added to match ``model``. Shape mismatches are listed by key in a UserError;
    with ``strict`` so are missing/unexpected keys. Returns (missing, unexpected).
    """
    if isinstance(state.get("model"), Mapping):
        state = state["model"]
    model_state = model.state_dict()
    by_canonical = {canonical_key(k): k for k in model_state}
    mapped = {by_canonical.get(canonical_key(k), k): v for k, v in state.items()}
    mismatched = [
        f"key {k!r}: checkpoint {tuple(v.shape)} vs model {tuple(model_state[k].shape)}"
        for k, v in mapped.items()
        if k in model_state and isinstance(v, torch.Tensor) and v.shape != model_state[k].shape
    ]
    if mismatched:
        more = f"; ... and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""
        raise UserError(f"checkpoint from another model? {'; '.join(mismatched[:5])}{more}.")
    missing = [k for k in model_state if k not in mapped]
    unexpected = [k for k in mapped if k not in model_state]
    if strict and (missing or unexpected):
        raise UserError(
            f"checkpoint does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''} "
            f"({len(missing)}), unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} "
            f"({len(unexpected)}); load with strict=False to load the overlap."
        )
    model.load_state_dict(mapped, strict=False)
    return missing, unexpected
