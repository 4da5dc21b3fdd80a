"""``benchmarks/step_speed.py --preset tiny`` runs every variant and ends with one summary line each, after
the MFU formula (and, compiled, the model's graph breaks and the recompiles while timed); the clock's
recompile count itself. Figures are benchmarks, never asserted here."""
from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^(\w+): (\d+\.\d) ms/update, (\d+) samples/s, MFU (n/a|\d+\.\d%), (\d+\.\d{3})x plain$")


@pytest.mark.proc
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
    ratio = re.search(r"^the ported Accelerate loop on the Engine against the plain loop, same process: "
                      r"(\d+\.\d{3})x \(target: at most 1\.02x\)$", proc.stdout, re.M)
    assert ratio and ratio.group(1) == summary["engine"].group(5), proc.stdout


def test_engine_variant_is_accelerates_loop_with_only_the_import_changed():
    """One loop text for both: the Engine variant differs from Accelerate's in its import line only."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    engine, accelerate = (inspect.getsource(f).splitlines() for f in (step_speed.run_engine, step_speed.run_accelerate))
    assert len(engine) == len(accelerate)
    differing = [(a.strip(), b.strip()) for a, b in zip(engine, accelerate) if a != b]
    assert differing[1:] == [("from mmvl.engine import Accelerator", "from accelerate import Accelerator")]
    assert differing[0][0].startswith("def run_engine(") and differing[0][1].startswith("def run_accelerate(")
    assert engine[-1].strip() == "accelerate_loop(Accelerator, p, args, device, clock)"
    loop = inspect.getsource(step_speed.accelerate_loop)
    assert all(f"accelerator.{name}(" in loop for name in ("prepare", "backward"))


@pytest.mark.slow  # torch.compile on the CPU: about a minute on a busy 2-core machine
def test_tiny_preset_compiled_reports_zero_recompiles_while_timed():
    proc = subprocess.run([sys.executable, "benchmarks/step_speed.py", "--preset", "tiny", "--threads", "1",
                           "--compile", "--variants", "plain,trainer"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^recompiles while timed \(.*\): plain 0, trainer 0$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^graph breaks \(Dynamo, training mode, forward \+ loss; 0 expected\): visual_bert 0$",
                     proc.stdout, re.M), proc.stdout
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
