"""``benchmarks/hf_vlm_speed.py`` runs end to end on a smoke size and prints its ratios (never asserted)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.proc  # a subprocess importing transformers and peft, writing a tiny LLaVA folder (~10 s)
def test_smoke_size_prints_full_and_lora_ratios():
    proc = subprocess.run([sys.executable, "benchmarks/hf_vlm_speed.py", "--steps", "1", "--rounds", "1", "--batch",
                           "2", "--width", "32", "--layers", "1", "--heads", "2", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in ("full", "lora"):
        for name in ("mmvl", "plain"):
            assert re.search(rf"^{kind} {name}: \d+\.\d ms/update, \d+ tokens/s$", proc.stdout, re.M), proc.stdout
        assert re.search(rf"^ratio {kind} hf_vlm mmvl/plain: \d+\.\d{{3}} \(target: at most 1\.05\)$", proc.stdout,
                         re.M), proc.stdout
