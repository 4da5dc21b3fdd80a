"""A checkpoint that finds no room, for real: ENOSPC on a small tmpfs mounted in a private mount
namespace (``unshare -m``, root only), and EFBIG under ``RLIMIT_FSIZE`` with SIGXFSZ ignored (so
``write()`` fails instead of the process dying). Each stops with one line saying so; the last good
checkpoint still loads, no temp file is left, and a resume with room goes on.

The in-process rows (the free-space and limit checks faked) are in test_bad_inputs.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from mmvl.checkpoint import load_checkpoint
from mmvl.checkpoint.schema import update_of
from tests.fixtures.faults import ROOT, SCRIPT, child_env
from tests.fixtures.toy import toy_opts

pytestmark = pytest.mark.slow

_FILE_SIZE_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    import torch
    from mmvl.checkpoint import CheckpointManager
    from mmvl.errors import UserError
    from mmvl.utils import disk

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
    manager, limit = CheckpointManager(sys.argv[1]), int(sys.argv[2])
    state = lambda n, update: {"model": {"w": torch.zeros(n)}, "trainer": {"update": update}}
    manager.save(state(10, 2), 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    said = []
    for checked in (True, False):
        if not checked:  # as if the estimate were low: the write itself runs into the limit
            disk.room_problem = lambda folder, needs: None
        try:
            manager.save(state(limit, 4), 4)
        except UserError as e:
            said.append(str(e))
    print(json.dumps(said))
""")


def _no_temps(folder) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_the_file_size_limit_during_a_checkpoint(tmp_path):
    limit = 64_000
    done = subprocess.run([sys.executable, "-c", _FILE_SIZE_CHILD, str(tmp_path), str(limit)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, during = json.loads(done.stdout.strip().splitlines()[-1])
    assert "the file-size limit (ulimit -f: 64.0 kB) is below" in before and "nothing written" in before
    assert "the file-size limit (ulimit -f: 64.0 kB) was hit" in during and "temp file removed" in during
    for said in (before, during):
        assert "model_4.ckpt" in said and "last.ckpt (update 2) is intact" in said, said
    folder = tmp_path / "checkpoints"
    assert update_of(load_checkpoint(folder / "last.ckpt")) == 2
    assert not (folder / "model_4.ckpt").exists() and _no_temps(folder)


def test_a_full_disk_during_a_run_then_a_resume(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a small tmpfs needs root and unshare (a private mount namespace)")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    opts = [o for o in toy_opts(mnt, "training.max_updates=12", "training.checkpoint_interval=2",
                                "training.evaluation_interval=12") if not o.startswith("env.data_dir")]
    run = " ".join([sys.executable, SCRIPT, f"env.data_dir={tmp_path / 'data'}", *opts])
    checkpoints = mnt / "save" / "checkpoints"
    script = f"""
        mount -t tmpfs -o size=96k tmpfs {mnt} || exit 77
        {run} 2> {out}/first.err; echo $? > {out}/first.rc
        cp {checkpoints}/last.ckpt {out}/kept.ckpt; ls -a {checkpoints} > {out}/files.txt
        mount -o remount,size=16m {mnt} && {run} 2> {out}/second.err; echo $? > {out}/second.rc
        cp {checkpoints}/last.ckpt {out}/resumed.ckpt
    """
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=240)
    if done.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    first = (out / "first.err").read_text()
    lines = [line for line in first.splitlines() if line.startswith("mmvl: error")]
    assert (out / "first.rc").read_text().strip() == "2" and len(lines) == 1, first
    assert "(nothing written)" in lines[0] and "the disk is full (~" in lines[0] and len(lines[0]) < 300 and "Traceback" not in first, first
    kept = update_of(load_checkpoint(out / "kept.ckpt"))
    assert f"last.ckpt (update {kept}) is intact" in lines[0]
    assert not [n for n in (out / "files.txt").read_text().split() if n.endswith(".tmp")]
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.err").read_text()
    assert update_of(load_checkpoint(out / "resumed.ckpt")) == 12
