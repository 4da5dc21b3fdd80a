"""``benchmarks/group_by_length.py`` runs end to end on a smoke size and prints its lines (never asserted)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.easy_vqa_generative_run import write_root

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.proc  # a subprocess building two Trainers (~15 s)
def test_smoke_size_prints_both_sides_and_the_ratio(tmp_path):
    pytest.importorskip("easy_vqa")  # the config's image processor and dataset come with the easy_vqa extra
    data = write_root(tmp_path / "evqa")
    proc = subprocess.run([sys.executable, "benchmarks/group_by_length.py", "--updates", "1", "--rounds", "1",
                           "--smoke", "--threads", "1", "--batch", "2",
                           f"dataset_config.easy_vqa_generative.data_root={data}", f"env.data_dir={tmp_path / 'cache'}",
                           "dataset_config.easy_vqa_generative.val_images=4",  # 8x8 images: 16 tokens unstrided
                           "model_config.vlm.image_encoder.params={channels: [4, 8, 8], strides: [1, 1, 1]}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("shuffled", "grouped"):
        assert re.search(rf"^{name}: \d+\.\d ms/update, \d+\.\d positions/sample$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^ratio grouped/shuffled: \d+\.\d{3}$", proc.stdout, re.M), proc.stdout
