"""A run owns its save dir: two ``mmvl_run`` started together into one folder, exactly one trains and
the other exits 2 naming it; once the owner is SIGKILLed, the next run takes the folder over and
resumes (the OS released the lock with the process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mmvl import locks
from mmvl.errors import UserError
from mmvl.io import safe_load
from tests.fixtures.faults import ROOT, SCRIPT, child_env
from tests.fixtures.toy import toy_opts


def _opts(root: Path, *extra: str) -> list[str]:
    return toy_opts(root, "training.max_updates=40", "training.checkpoint_interval=2", "training.log_interval=1",
                    "training.evaluation_interval=0", *extra)


def _start(root: Path, *extra: str, slow: float = 0.1) -> subprocess.Popen:
    env = child_env([{"update": 1, "action": "sleep", "seconds": slow}])
    return subprocess.Popen([sys.executable, SCRIPT, *_opts(root, *extra)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _updates(root: Path) -> list[int]:
    path = root / "save" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["update"] for line in lines if '"split": "train"' in line]


@pytest.mark.proc
def test_a_second_process_is_refused_and_this_process_may_lock_again(tmp_path):
    assert locks.lock_dir(tmp_path) == locks.lock_dir(tmp_path)  # the same process: its own lock
    holder = subprocess.Popen([sys.executable, "-c", ("import sys, time; from mmvl import locks; "
                               f"locks.lock_dir({str(tmp_path / 'other')!r}); print('held', flush=True); time.sleep(30)")],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        (tmp_path / "other").mkdir()
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"is in use by another run \(pid {holder.pid} on .*, started "):
            locks.lock_dir(tmp_path / "other")
    finally:
        holder.kill()
        holder.wait()
    locks.lock_dir(tmp_path / "other")  # the holder is dead: the OS released its lock


def _hold_unnamed(folder: Path) -> int:
    """Take the folder's lock on a descriptor of its own, as a run that has not written its name yet."""
    import fcntl

    folder.mkdir(exist_ok=True)
    fd = os.open(folder / locks.LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_run_started_at_the_same_moment_waits_for_the_holders_name(tmp_path):
    fd = _hold_unnamed(tmp_path / "save")
    name = json.dumps({"pid": 4321, "host": "node7", "started": "2026-12-08T00:00:00"}).encode()
    writer = threading.Timer(0.3, lambda: os.pwrite(fd, name, 0))
    writer.start()
    try:
        with pytest.raises(UserError, match=r"in use by another run \(pid 4321 on node7, started 2026-12-08"):
            locks.lock_dir(tmp_path / "save")
    finally:
        writer.join()
        os.close(fd)


def test_a_holder_that_never_writes_its_name_is_still_refused_in_one_line(tmp_path):
    fd = _hold_unnamed(tmp_path / "save")
    try:
        with pytest.raises(UserError, match=r"in use by another run \(a process that has not written its name yet\)"):
            locks.lock_dir(tmp_path / "save")
    finally:
        os.close(fd)


@pytest.mark.slow
def test_two_runs_in_one_save_dir_then_a_takeover_after_sigkill(tmp_path):
    first, second = _start(tmp_path, "optimizer.params.lr=0.01"), _start(tmp_path, "optimizer.params.lr=0.02")
    try:
        deadline = time.monotonic() + 90
        while first.poll() is None and second.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused, owner = (first, second) if first.poll() is not None else (second, first)
        err = refused.communicate(timeout=30)[1]
        assert refused.returncode == 2, err
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and f"is in use by another run (pid {owner.pid} on " in lines[0]
        while len(_updates(tmp_path)) < 6:  # the owner trains and checkpoints
            assert owner.poll() is None and time.monotonic() < deadline, owner.communicate()[1]
            time.sleep(0.05)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    finally:
        for p in (first, second):
            p.kill()
    lr = "0.01" if owner is first else "0.02"
    saved = safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")["trainer"]["update"]
    takeover = _start(tmp_path, f"optimizer.params.lr={lr}", slow=0.0)
    _, err = takeover.communicate(timeout=120)
    assert takeover.returncode == 0, err
    log = (tmp_path / "save" / "train.log").read_text()
    assert f"at update {saved}" in log and "Resumed from" in log
    assert safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")["trainer"]["update"] == 40
