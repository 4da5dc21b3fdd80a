"""``benchmarks/packing_lm.py`` runs end to end on a smoke size and prints its lines (never asserted)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.proc  # a subprocess building two Trainers (~20 s)
def test_smoke_size_prints_where_the_time_goes(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/packing_lm.py", "--set", "llava", "--updates", "2", "--rounds", "1",
                           "--smoke", "--threads", "1", "--batch", "4", f"env.data_dir={tmp_path / 'cache'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^set llava: \d+ batches a way, 1 epoch\(s\)", out, re.M), out
    for way in ("grouped", "one-bucket", "packed"):
        assert re.search(rf"^  {way}: \d+\.\d ms/batch$", out, re.M), out
    for line in (r"one-bucket/grouped time \d+\.\d{3}", r"packed/grouped time \d+\.\d{3}"):
        assert re.search(rf"^{line}$", out, re.M), out
