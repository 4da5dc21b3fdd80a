"""``benchmarks/step_speed.py --preset tiny`` runs every variant and ends with one summary line each;
``benchmarks/scaling_model.py`` models the strategies (figures are benchmarks, never asserted here)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^(\w+): (\d+\.\d) ms/update, (\d+) samples/s, MFU (n/a|\d+\.\d%), (\d+\.\d{3})x plain$")


def test_tiny_preset_runs_every_variant():
    proc = subprocess.run([sys.executable, "benchmarks/step_speed.py", "--preset", "tiny", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = {m.group(1): m for m in map(SUMMARY.match, lines) if m}
    expected = ["plain", "engine", "trainer"] + [v for v in ("accelerate", "lightning")
                                                 if importlib.util.find_spec(v) is not None]
    assert list(summary) == expected, proc.stdout
    assert lines[-len(expected):] == [summary[v].group(0) for v in expected]  # the summary ends the output
    assert summary["plain"].group(5) == "1.000" and summary["plain"].group(4) == "n/a"  # no peak on a CPU
    for v in ("accelerate", "lightning"):
        if v not in expected:
            assert f"note: {v} skipped" in proc.stdout


def test_scaling_model_covers_every_strategy_and_gpu_count():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import scaling_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = scaling_model.main(["--params", "110e6", "--step-ms", "23"])
    assert [(s, g) for s, g, _ in rows] == [(s, g) for s in scaling_model.STRATEGIES for g in (8, 16, 64)]
    ddp = {g: x for s, g, x in rows if s == "ddp"}
    assert 0 < ddp[64] / 64 < ddp[16] / 16 < ddp[8] / 8 <= 1.0  # efficiency falls once rings cross nodes
    # without overlapping backward, every all-reduce adds to the update
    slower = {g: x for s, g, x in scaling_model.main(["--params", "110e6", "--step-ms", "23", "--overlap", "0"])
              if s == "ddp"}
    assert all(slower[g] < ddp[g] for g in (8, 16, 64))
