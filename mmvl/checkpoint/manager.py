"""``<save_dir>/checkpoints/``: where checkpoints go, which are kept, which one a run resumes.

Periodic checkpoints are ``model_<update>.ckpt``, pruned to the newest ``max_to_keep``;
``last.ckpt`` and ``best.ckpt`` are hard links to them (a copy where the file system has none),
switched in atomically, so they always name a complete file, even if the process dies mid-save.
The state is serialised once. Sharded checkpoints are ``sharded_<update>/`` folders
(:mod:`mmvl.checkpoint.sharded`), pruned the same way. Temp files a killed process left behind
are removed by the next run's first save. Only rank 0 uses a manager.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmvl import io
from mmvl.checkpoint import sharded
from mmvl.checkpoint.schema import (BEST, CHECKPOINTS_DIR, LAST, MODEL, PERIODIC, SHARDED, SHARDED_STATE,
                                    periodic_name, sharded_name, stamp, update_of, upgrade)
from mmvl.errors import UserError

log = logging.getLogger(__name__)


class CheckpointManager:
    """Owns ``<save_dir>/checkpoints/``; call from one process (rank 0) only."""

    def __init__(self, save_dir: str | os.PathLike[str], max_to_keep: int = 5):
        self.dir = Path(save_dir) / CHECKPOINTS_DIR
        self.max_to_keep = int(max_to_keep)
        self._cleaned = False

    @property
    def directory(self) -> Path:
        return self.dir

    @property
    def last_path(self) -> Path:
        return self.dir / LAST

    @property
    def best_path(self) -> Path:
        return self.dir / BEST

    def periodic_paths(self) -> list[Path]:
        """``model_<update>.ckpt`` files, oldest update first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := PERIODIC.match(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, state: Mapping[str, Any], update: int, is_best: bool = False, periodic: bool = True) -> Path:
        """Write ``state`` once, then switch ``last`` (and ``best``) to it; returns the written file."""
        if not self._cleaned:
            self.remove_stale_temps()
            self._cleaned = True
        state = stamp(dict(state))
        try:
            if periodic:
                written = io.atomic_save(state, self.dir / periodic_name(update))
                io.link_replace(written, self.last_path)
            else:
                written = io.atomic_save(state, self.last_path)
            if is_best:
                io.link_replace(written, self.best_path)
        except io.DiskFull as e:
            raise self._no_room(e, update) from None
        if periodic:
            self._prune()
        return written

    def save_best(self, state: Mapping[str, Any]) -> Path:
        """Write ``best.ckpt`` alone (a sharded run's periodic saves are folders)."""
        try:
            return io.atomic_save(stamp(dict(state)), self.best_path)
        except io.DiskFull as e:
            raise self._no_room(e, None) from None

    def _no_room(self, err: io.DiskFull, update: int | None) -> UserError:
        """``err`` (a save found no room) with what is still safe: the last good checkpoint."""
        last, good = self.last_path, "there is no earlier checkpoint"
        if last.is_file():
            try:  # mapped, not read: a cheap look that also proves it loads
                good = f"{last.name} (update {update_of(load_checkpoint(last, mmap=True))}) is intact"
            except UserError as e:
                good = f"{last.name} does not load ({e})"
        what = f"checkpoint of update {update}" if update is not None else "best checkpoint"
        fix = "raise ulimit -f" if "file-size limit" in err.reason else "free space or use another env.save_dir"
        return UserError(f"{what} not saved ({err.done}): {str(err.path)!r}: {err.reason}; {good}; {fix}, "
                         "then resume.")

    def remove_stale_temps(self) -> list[Path]:
        """Delete temp files a killed save left behind (this manager is the only writer)."""
        return io.remove_stale_temps(self.dir)

    def sharded_path(self, update: int) -> Path:
        """The folder a sharded checkpoint of ``update`` goes to."""
        return self.dir / sharded_name(update)

    def sharded_paths(self) -> list[Path]:
        """``sharded_<update>`` folders (complete or not), oldest update first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir()
                 if p.is_dir() and (m := SHARDED.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest_sharded(self, require: str | None = None) -> Path | None:
        """The newest complete sharded checkpoint folder; incomplete ones are skipped.

        ``require``: a file the folder must also hold (e.g. :data:`SHARDED_STATE`).
        """
        for path in self.sharded_paths()[::-1]:
            problem = sharded.problem(path)
            if problem is None and require and not (path / require).is_file():
                problem = f"it has no {require} (a strategy-level save, not a trainer checkpoint)"
            if problem is None:
                return path
            log.warning("skipping incomplete sharded checkpoint %s: %s", path, problem)
        return None

    def prune_sharded(self) -> list[Path]:
        """Keep the newest ``max_to_keep`` complete sharded folders; remove older ones and
        incomplete leftovers of crashed saves. Rank 0 only, right after a save; best effort: a
        folder that cannot be removed is only reported."""
        if self.max_to_keep <= 0:
            return []
        paths = self.sharded_paths()
        complete = [p for p in paths if sharded.problem(p) is None]
        keep = set(complete[-self.max_to_keep:])
        removed = [p for p in paths if p not in keep]
        for path in removed:
            try:
                (path / io.MARKER).unlink(missing_ok=True)  # incomplete first, then gone
                shutil.rmtree(path)
                log.info("removed sharded checkpoint %s (checkpoint.max_to_keep=%d)", path, self.max_to_keep)
            except OSError as e:
                log.warning("could not prune sharded checkpoint %s: %s", path, e)
        return removed

    def move_aside(self, also: tuple[str, ...] = ("metrics.jsonl",)) -> Path | None:
        """Start over without losing anything: move ``checkpoints/`` (and ``also``, files of the
        save dir) into ``<save_dir>/previous/<date-time>/``. Returns that folder (None: nothing to move)."""
        save_dir = self.dir.parent
        moving = [p for p in (self.dir, *(save_dir / name for name in also))
                  if p.is_file() or (p.is_dir() and any(p.iterdir()))]
        if not moving:
            return None
        stamp_ = time.strftime("%Y%m%d-%H%M%S")
        target = save_dir / "previous" / stamp_
        suffix = 1
        while target.exists():
            suffix += 1
            target = save_dir / "previous" / f"{stamp_}-{suffix}"
        return io.move_aside(moving, target)

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
        """The newest complete checkpoint, a full file or a sharded folder (rank 0 decides).

        ``best``: ``best.ckpt`` when it exists and is readable. Otherwise the first readable of
        ``last.ckpt`` and the periodic files (newest first) is compared with the newest complete
        sharded folder by update; on a tie the sharded one wins when ``sharded`` (the caller can
        read it). Unusable candidates are skipped with a warning. None when there is no
        checkpoint at all; UserError when there are some but none is usable, or when the newest
        is sharded and ``sharded`` is False.
        """
        problems: list[str] = []
        found_full = self._first_loadable(best, problems, mmap=True)
        if found_full is not None and found_full[1] == self.best_path:
            return self.best_path
        full = None if found_full is None else (update_of(found_full[0]), found_full[1])
        found = self.latest_sharded(require=SHARDED_STATE)
        if found is not None:
            update = int(SHARDED.match(found.name).group(1))
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

        Unusable files are reported with ``logging.warning`` and skipped. Returns None when the
        folder holds no checkpoint at all; raises UserError when there are checkpoints but none
        loads (never silently start over).
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
                return load_checkpoint(path, **load), path
            except UserError as e:
                log.warning("skipping unusable checkpoint: %s", e)
                problems.append(str(e))
        return None

    def _raise_if_unusable(self, problems: list[str]) -> None:
        if problems:  # checkpoints exist but none loads: never silently start over
            more = f"; {len(problems) - 1} more unusable (see train.log)" if len(problems) > 1 else ""
            first = problems[0].replace(str(self.dir) + os.sep, "").removesuffix("; use another checkpoint.")
            raise UserError(f"no loadable checkpoint in {str(self.dir)!r}: {first[:160]}{more}; "
                            "delete or repair them, or choose another env.save_dir.")


def load_checkpoint(path: str | os.PathLike[str], **load: Any) -> dict[str, Any]:
    """A checkpoint file (``weights_only``), in today's layout whatever mmvl wrote it."""
    return upgrade(io.safe_load(path, **{"expect_keys": (MODEL,), **load}))
