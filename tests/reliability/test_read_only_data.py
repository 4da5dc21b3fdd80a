"""A read-only data folder (a shared, mounted data set) where Sort-of-CLEVR must first be generated:
one line naming the folder and the fix, exit 2, no traceback.

Tests run as root, which ignores file modes, so the folder is made read-only with a read-only bind
mount in a private mount namespace (``unshare -m``); skipped where that is not possible.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.fixtures.faults import ROOT, child_env
from tests.reliability.test_bad_inputs import _SOC, vl_opts

pytestmark = pytest.mark.slow


def test_a_read_only_data_folder_is_named(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare (a private mount namespace)")
    data = tmp_path / "data"
    data.mkdir()
    run = " ".join([sys.executable, "-m", "mmvl_cli.run", *(f"'{o}'" for o in vl_opts("sort_of_clevr", tmp_path, *_SOC))])
    script = f"mount --bind {data} {data} && mount -o remount,bind,ro {data} || exit 77\n{run}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=180)
    if done.returncode == 77:
        pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()[:200]}")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0] == (f"mmvl: error: sort_of_clevr: cannot write the generated data into '{data}' "
                        "(Read-only file system); make it writable, or set env.data_dir to a writable folder.")
    assert not any(data.iterdir())
