"""A dead run never holds its save dir, even while the DataLoader workers it forked are still alive.

The folder lock is taken by the run's main process; its forked workers must not keep it. A worker
notices its parent is gone only at its next status check (seconds later), so a restart within
0.2 s of a SIGKILL meets orphaned workers: both tests here restart into exactly that state, as a
quick SLURM requeue or ``torchrun --max-restarts`` does.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmvl.io import safe_load
from tests.fixtures.faults import KILLED, ROOT, SCRIPT, SEPARATOR, child_env, communicate, run_torchrun
from tests.fixtures.toy import register, toy_opts

register()
pytestmark = pytest.mark.proc


def _opts(root: Path, *extra: str) -> list[str]:
    return toy_opts(root, "training.num_workers=2", "training.checkpoint_interval=2", "training.max_updates=12",
                    "training.evaluation_interval=0", "checkpoint.resume=auto", *extra)


def _alive_with(marker: str, exclude: int) -> list[int]:
    """Pids whose command line names ``marker`` (a forked worker keeps its parent's argv)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode("utf-8", "replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def _resumes(root: Path) -> list[int]:
    log = (root / "save" / "train.log").read_text()
    return [int(u) for u in re.findall(r"Resumed from \S+last\.ckpt at update (\d+)", log)]


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc to see the orphaned workers")
def test_sigkilled_run_with_live_workers_restarts_within_0_2_s(tmp_path):
    faults = [{"update": 7, "action": "sigkill", "when": "after"}]
    err = tmp_path / "first.err"  # a file, not a pipe: the orphaned workers would hold a pipe open
    with open(err, "w") as stderr:
        first = subprocess.Popen([sys.executable, SCRIPT, *_opts(tmp_path)], cwd=ROOT, env=child_env(faults),
                                 stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    code = first.wait(timeout=120)
    died = time.monotonic()
    assert code == -9 and KILLED.format(rank=0, attempt=0) in err.read_text(), err.read_text()[-2000:]
    orphans = _alive_with(str(tmp_path), exclude=os.getpid())
    restart = subprocess.Popen([sys.executable, SCRIPT, *_opts(tmp_path)], cwd=ROOT, env=child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert time.monotonic() - died < 0.2
    # the scenario this test is about: the killed run's workers outlived it
    assert orphans, "the killed run left no live worker; the restart did not meet them"
    done = communicate(restart, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _resumes(tmp_path) == [6]
    assert safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")["trainer"]["update"] == 12


@pytest.mark.slow  # ~25-50 s: one torchrun job, a restart and a reference run
def test_rank_killed_under_torchrun_with_workers_resumes_bitwise(tmp_path):
    faults = [{"update": 5, "action": "sigkill", "rank": 1, "attempt": 0, "run": 0, "when": "after"}]
    faulted, straight = tmp_path / "faulted", tmp_path / "straight"
    dist = ("distributed.strategy=ddp", "training.device=cpu", "distributed.timeout_minutes=1")
    argv = [*_opts(faulted, *dist), SEPARATOR, *_opts(straight, *dist)]
    proc, _ = run_torchrun(argv, faults, max_restarts=1, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert KILLED.format(rank=1, attempt=0) in proc.stderr
    assert _resumes(faulted) == [4] and _resumes(straight) == []
    got = safe_load(faulted / "save" / "checkpoints" / "last.ckpt")
    want = safe_load(straight / "save" / "checkpoints" / "last.ckpt")
    assert got["trainer"]["update"] == want["trainer"]["update"] == 12
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"{key} differs from the uninterrupted run"
