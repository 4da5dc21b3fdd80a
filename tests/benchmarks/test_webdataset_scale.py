"""``benchmarks/webdataset_scale.py`` at its smallest sizes (three fresh interpreters: slow): every
measurement line, the sample counts the plan gives, and the same peak memory at 2x the shards."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("webdataset")
NUMBER = r"(\d+(?:\.\d+)?)"
LINE = re.compile(rf"^webdataset_scale (folder|shards_1x|shards_2x) (?:images|shards)=(\d+) samples=(\d+) "
                  rf"samples_per_s=(\d+) main_peak_mb=(\d+) \(\+-?\d+ in the epoch\) worker_peak_mb=(\d+) "
                  rf"worker_private_peak_mb=(\d+)$", re.M)
RATIOS = re.compile(rf"^webdataset_scale ratios shards_vs_folder_samples_per_s={NUMBER} main_peak_2x_vs_1x={NUMBER} "
                    rf"worker_peak_2x_vs_1x={NUMBER} worker_private_peak_2x_vs_1x={NUMBER}$", re.M)


@pytest.mark.slow
def test_webdataset_scale_smallest(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "webdataset_scale.py"), "--samples", "64",
                           "--per-shard", "16", "--scale", "2", "--batch-size", "8", "--buffer", "8",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m[0]: [int(v) for v in m[1:]] for m in LINE.findall(proc.stdout)}
    assert set(rows) == {"folder", "shards_1x", "shards_2x"}, proc.stdout
    # 64 images; 4 and 8 shards of 16 over 2 workers, batches of 8: nothing to drop
    assert [rows[k][:2] for k in ("folder", "shards_1x", "shards_2x")] == [[64, 64], [4, 64], [8, 128]]
    assert all(r[2] > 0 and r[3] > 100 and r[4] > 0 and r[5] > 0 for r in rows.values())
    ratios = [float(v) for v in RATIOS.search(proc.stdout).groups()]
    assert ratios[0] > 0 and 0.8 < ratios[1] < 1.2 and 0.8 < ratios[2] < 1.2 and ratios[3] < 1.5, proc.stdout
    assert list(tmp_path.iterdir()) == []  # the generated data is removed
