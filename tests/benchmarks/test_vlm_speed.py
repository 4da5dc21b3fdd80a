"""``benchmarks/vlm_speed.py`` runs end to end on a smoke size and prints its ratios (never asserted)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.proc  # a subprocess importing transformers and peft (~10 s)
def test_smoke_size_prints_full_and_lora_ratios():
    proc = subprocess.run([sys.executable, "benchmarks/vlm_speed.py", "--steps", "1", "--rounds", "1", "--batch", "2",
                           "--width", "32", "--layers", "1", "--heads", "2", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in ("full", "lora"):
        for name in ("mmvl", "plain"):
            assert re.search(rf"^{kind} {name}: \d+\.\d ms/update, \d+ tokens/s$", proc.stdout, re.M), proc.stdout
        assert re.search(rf"^ratio {kind} mmvl/plain: \d+\.\d{{3}} \(target: at most 1\.05\)$", proc.stdout, re.M)


@pytest.mark.proc
def test_without_peft_the_full_comparison_runs_and_a_note_says_lora_is_left_out():
    """A GPU machine without a package index may lack peft: gpu_check's vlm step must still measure."""
    code = ("import runpy, sys\nsys.modules['peft'] = None  # not installed\n"
            "sys.argv = ['vlm_speed.py', '--steps', '1', '--rounds', '1', '--batch', '2', '--width', '32', "
            "'--layers', '1', '--heads', '2', '--threads', '1']\n"
            "runpy.run_path('benchmarks/vlm_speed.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^ratio full mmvl/plain: \d+\.\d{3} ", proc.stdout, re.M), proc.stdout
    assert "note: peft is not installed: the LoRA comparison is left out" in proc.stdout
    assert "lora" not in proc.stdout.replace("LoRA", "")
