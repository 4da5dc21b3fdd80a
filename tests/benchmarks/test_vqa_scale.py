"""``benchmarks/vqa_scale.py --scale 0.01`` end to end (CI): synthetic VQA v2 in the official layout,
a first run that fills the preprocessing cache, a cached run that maps it and evaluates the whole
val split with a progress bar, and the one-line summary."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^vqa_scale scale=0\.01 startup_s=([\d.]+) cached_startup_s=([\d.]+) samples_per_s=(\d+) "
                  r"main_peak_mb=(\d+) worker_private_growth_mb=(-?[\d.]+) eval_peak_mb=(\d+)$", re.M)


@pytest.mark.slow
def test_vqa_scale_at_one_percent(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vqa_scale.py"), "--scale", "0.01",
                           "--updates", "6", "--cached-updates", "3", "--batch-size", "32",
                           "--data-dir", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    match = LINE.search(out)
    assert match, out
    startup, cached, per_s, main_peak, growth, eval_peak = map(float, match.groups())
    assert startup > 0 and cached > 0 and per_s > 0 and main_peak > 100 and eval_peak > 100
    assert "cached run: parsed nothing" in out  # the second run mapped the cache
    assert "{'train': 4438, 'val': 2144} questions over {'train': 828, 'val': 405} images" in out  # 1% of VQA v2
    assert re.search(r"eval val vqa2: 100%\|.*\| 2144/2144", out), out  # evaluation finished with its bar
    generated = tmp_path / "data" / "vqa2"
    for name in ("v2_OpenEnded_mscoco_train2014_questions.json", "v2_mscoco_train2014_annotations.json",
                 "v2_OpenEnded_mscoco_val2014_questions.json", "v2_mscoco_val2014_annotations.json",
                 "features/trainval.lmdb/data.mdb"):
        assert (generated / name).is_file(), name
