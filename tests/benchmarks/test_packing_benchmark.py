"""``benchmarks/packing.py`` runs end to end on a smoke size, both sets, and prints its lines (never asserted)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.easy_vqa_generative_run import write_root

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "benchmarks/packing.py", "--updates", "1", "--rounds", "1", "--smoke",
                           "--threads", "1", "--batch", "4", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _check(out: str, name: str) -> None:
    assert f"set {name}" in out, out
    for side in ("shuffled", "grouped", "packed"):
        assert re.search(rf"^  {side}: \d+\.\d ms/update, .* real tokens/s$", out, re.M), out
    for line in (r"packed/grouped \d+\.\d{3}", r"packed/shuffled \d+\.\d{3}", r"real positions packed (0|1)\.\d{3}"):
        assert re.search(rf"^{line}$", out, re.M), out


@pytest.mark.proc  # subprocesses building three Trainers a set (~30 s)
def test_smoke_size_prints_each_set_s_ratios(tmp_path):
    pytest.importorskip("easy_vqa")  # the config's image processor and dataset come with the easy_vqa extra
    data = write_root(tmp_path / "evqa")
    _check(_run("--set", "easy_vqa", f"dataset_config.easy_vqa_generative.data_root={data}",
                f"env.data_dir={tmp_path / 'cache'}", "dataset_config.easy_vqa_generative.val_images=4",
                "model_config.vlm.image_encoder.params={channels: [4, 8, 8], strides: [1, 1, 1]}"), "easy_vqa_conversations")
    out = _run("--set", "llava", f"env.data_dir={tmp_path / 'cache'}")
    _check(out, "llava")
    assert "real positions packed 1.000" in out  # one row a micro-batch: nothing padded
