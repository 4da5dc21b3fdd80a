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


@pytest.mark.proc
def test_without_open_clip_mmvls_step_is_timed_alone_with_a_note():
    """A GPU machine without a package index lacks open_clip: gpu_check's clip step must still measure."""
    code = ("import runpy, sys\nsys.modules['open_clip'] = None  # not installed\n"
            "sys.argv = ['contrastive_speed.py', '--steps', '1', '--rounds', '1', '--batch', '4', '--image', '32', "
            "'--layers', '1', '--width', '32', '--heads', '2', '--threads', '1', '--loss-batch', '0']\n"
            "runpy.run_path('benchmarks/contrastive_speed.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: open_clip is not installed: mmvl's step is timed alone, no ratio" in proc.stdout
    assert re.search(r"^mmvl: \d+\.\d ms/update, \d+\.\d samples/s, peak memory ", proc.stdout, re.M), proc.stdout
    assert not re.search(r"^(open_clip: |time ratio )", proc.stdout, re.M), proc.stdout
    assert "saved for backward" not in proc.stdout  # --loss-batch 0: no loss-memory part
