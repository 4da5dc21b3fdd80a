"""``benchmarks/contrastive_speed.py`` runs end to end on a smoke size and prints its ratios (never asserted)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.proc  # a subprocess, which spawns 2 gloo ranks for the loss memory
@pytest.mark.slow  # ~30 s: open_clip, timm and two ranks to import
def test_smoke_size_prints_speed_and_loss_memory_ratios():
    proc = subprocess.run([sys.executable, "benchmarks/contrastive_speed.py", "--steps", "1", "--rounds", "1",
                           "--batch", "4", "--image", "32", "--layers", "1", "--width", "32", "--heads", "2",
                           "--loss-batch", "1024", "--embed-loss", "32", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for name in ("mmvl", "open_clip"):
        assert re.search(rf"^{name}: \d+\.\d ms/update, \d+\.\d samples/s, peak memory ", out, re.M), out
    assert re.search(r"^time ratio mmvl/open_clip: \d+\.\d{3} \(target: at most 1\.05\)", out, re.M), out
    memory = re.search(r"saved for backward per rank: ([\d.]+) MB global, ([\d.]+) MB local_loss", out)
    # 1,024 rows of width 32: the logits dominate, and local_loss keeps half of them per rank
    assert memory and float(memory.group(2)) < 0.8 * float(memory.group(1)), out
