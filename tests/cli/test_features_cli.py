"""`mmvl_features`: convert/info/extract from the shell; user mistakes exit 2 with one line, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

lmdb = pytest.importorskip("lmdb", reason="lmdb is not installed (the feature store needs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MMVL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "mmvl_cli.features", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_user_error(proc, *needles):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("mmvl: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def npy_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("feats")
    for key, rows in (("10", 4), ("11", 6)):
        np.save(root / f"{key}.npy", np.full((rows, 8), float(key), np.float32))
        np.save(root / f"{key}_info.npy", {"bbox": np.tile([0, 0, 5, 5], (rows, 1)), "image_width": 10,
                                           "image_height": 10, "num_boxes": rows}, allow_pickle=True)
    return root


@pytest.mark.slow  # four CLI processes
def test_convert_info_and_user_errors(npy_dir, tmp_path):
    out = tmp_path / "f.lmdb"
    assert_user_error(cli("convert", "--npy-dir", npy_dir, "--out", out, "--quiet"), "--allow-pickle")
    done = cli("convert", "--npy-dir", npy_dir, "--out", out, "--allow-pickle", "--fp16", "--quiet")
    assert done.returncode == 0 and "wrote 2 feature records" in done.stdout, done.stderr
    info = cli("info", out, "--id", "11", "--check", "--max-features", "5")
    assert info.returncode == 0 and "(5, 8) float16" in info.stdout and "all 2 values decode" in info.stdout

    assert_user_error(cli("info", out, "--id", "12345"), "'12345'", str(out))
    env = lmdb.open(str(out), map_size=1 << 24)  # damage one value the way a torn copy would
    with env.begin(write=True) as txn:
        txn.put(b"11", txn.get(b"11")[:-5])
    env.close()
    assert_user_error(cli("info", out, "--check"), "'11'", str(out), "corrupt", "mmvl_features convert")


@pytest.mark.slow  # CLI processes
def test_missing_inputs_exit_2(tmp_path):
    assert_user_error(cli("convert", "--npy-dir", tmp_path / "nope", "--out", tmp_path / "o.lmdb"), "nope")
    assert_user_error(cli("info", tmp_path / "missing.lmdb"), "missing.lmdb")
    assert_user_error(cli("extract", "--images", tmp_path, "--out", tmp_path / "g.lmdb", "--backbone", "vgg"),
                      "vgg")
