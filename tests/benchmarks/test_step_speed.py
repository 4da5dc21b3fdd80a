"""``benchmarks/step_speed.py --preset tiny`` runs every variant and ends with one summary line each, after
the MFU formula (and, compiled, the recompiles while timed); the clock's recompile count itself. Figures are
benchmarks, never asserted here."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "MFU = FLOPs per sample x samples/s / peak FLOP/s = " in proc.stdout
    assert "no peak known for cpu" in proc.stdout


@pytest.mark.slow  # torch.compile on the CPU: about a minute on a busy 2-core machine
def test_tiny_preset_compiled_reports_zero_recompiles_while_timed():
    proc = subprocess.run([sys.executable, "benchmarks/step_speed.py", "--preset", "tiny", "--threads", "1",
                           "--compile", "--variants", "plain,trainer"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^recompiles while timed \(.*\): plain 0, trainer 0$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^MFU = FLOPs per sample x samples/s / peak FLOP/s = [\d.e+-]+ GFLOP x samples/s / ",
                     proc.stdout, re.M), proc.stdout


def test_clock_counts_the_compiles_inside_timed_updates_only():
    """torch.compile with the eager backend: Dynamo still translates frames (and counts them), in milliseconds."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_speed_setup import Clock
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def run(shapes: list[int]) -> int:
        torch._dynamo.reset()
        f = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
        clock = Clock(torch.device("cpu"), warmup=1, updates=len(shapes) - 1)
        clock.begin()
        for update, n in enumerate(shapes, start=1):
            f(torch.ones(n))
            clock.tick(update)
        return clock.recompiles

    assert run([3, 3, 3]) == 0  # compiled in the untimed first update
    assert run([3, 4, 4]) == 1  # a new shape while timed
    assert run([3, 4, 5]) == 2
