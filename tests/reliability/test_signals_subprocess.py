"""SIGUSR1/SIGTERM sent from outside to a running ``mmvl_run``: it checkpoints the update it is at,
exits 0 at once (no final evaluation), asks SLURM to requeue, and the requeued run (the same
command again) ends bitwise equal to an uninterrupted one."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmvl.io import safe_load
from mmvl_cli.run import main
from tests.fixtures.faults import ROOT, SCRIPT, child_env
from tests.fixtures.toy import register, toy_opts

register()
UPDATES = 30


def _opts(root: Path) -> list[str]:
    return toy_opts(root, f"training.max_updates={UPDATES}", "training.checkpoint_interval=100",
                    "training.evaluation_interval=100", "training.log_interval=1",
                    "model_config.toy_mlp.hidden_dropout_prob=0.1", "checkpoint.slurm_requeue=true")


def _train_updates(root: Path) -> list[int]:
    path = root / "save" / "metrics.jsonl"
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e["update"] for e in events if e.get("split") == "train"]


def _fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A ``scontrol`` on PATH that records its arguments (the requeue request)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir, record


@pytest.mark.parametrize("sig, twice", [pytest.param(signal.SIGUSR1, False, marks=pytest.mark.slow),
                                        pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
                                        pytest.param(signal.SIGINT, True, marks=pytest.mark.slow)],
                         ids=["SIGUSR1", "SIGTERM", "SIGINT twice at once (one Ctrl-C)"])
def test_signal_checkpoints_current_update_exits_0_and_resume_matches(tmp_path, sig, twice):
    bin_dir, record = _fake_scontrol(tmp_path)
    root = tmp_path / "run"
    slow = [{"update": 1, "action": "sleep", "seconds": 0.15}]  # ~5 s of training: time to signal it
    env = child_env(slow, SLURM_JOB_ID="4242", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen([sys.executable, SCRIPT, *_opts(root)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(_train_updates(root)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.02)
        seen = _train_updates(root)[-1]
        proc.send_signal(sig)
        if twice:  # the terminal's SIGINT and the launcher's forwarded copy: one Ctrl-C
            time.sleep(0.05)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)  # a bound against a hang, not a speed check
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    state = safe_load(root / "save" / "checkpoints" / "last.ckpt")
    stopped = state["trainer"]["update"]
    assert seen <= stopped <= seen + 2 and stopped < UPDATES  # the update it was at, not the last periodic
    assert _train_updates(root)[-1] == stopped
    log = (root / "save" / "train.log").read_text()
    assert f"Received {sig.name}: saving a checkpoint at update {stopped}" in log
    assert "val toy" not in log  # no evaluation between the signal and the exit
    if sig == signal.SIGINT:  # the user stopped it: never requeued
        assert not record.exists()
    else:
        assert record.read_text().split() == ["requeue", "4242"]

    # the requeued job: the same command; checkpoint.resume=auto picks up last.ckpt
    assert main(_opts(root)) == 0
    assert f"Resumed from {root / 'save' / 'checkpoints' / 'last.ckpt'} at update {stopped}" in \
        (root / "save" / "train.log").read_text()
    assert main(_opts(tmp_path / "straight")) == 0
    got = safe_load(root / "save" / "checkpoints" / "last.ckpt")
    want = safe_load(tmp_path / "straight" / "save" / "checkpoints" / "last.ckpt")
    assert got["trainer"]["update"] == want["trainer"]["update"] == UPDATES
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(tmp_path):
    root = tmp_path / "run"
    # from update 2 on an update takes 6 s: both Ctrl-Cs (1.3 s apart) arrive inside update 2, before
    # the first could have saved and stopped (which, on a quiet machine, took under 1.3 s with 0.5 s updates)
    slow = [{"update": 2, "action": "sleep", "seconds": 6.0}]
    proc = subprocess.Popen([sys.executable, SCRIPT, *_opts(root)], cwd=ROOT, env=child_env(slow),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(_train_updates(root)) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.3)  # later than one Ctrl-C delivered twice: a second Ctrl-C
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Traceback" not in err, err
