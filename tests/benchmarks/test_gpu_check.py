"""``benchmarks/gpu_check.sh``: its dry mode (every step's CPU part, what CI keeps working), its budgets,
its user mistakes, and the two things an offline GPU machine needs from the tree: the suite collects without
lmdb and fairscale, and ``benchmarks`` is this tree's even when fairscale's wheel installs another one."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["preflight", "step_speed compiled", "pytest -m cuda", "vlm_speed", "hf_vlm_speed", "contrastive_speed",
         "step_speed eager",
         "demo bf16", "demo fp16"]
STEP = re.compile(r"^STEP (.+?): (ok|FAILED \(exit \d+\)|TIMED OUT|SKIPPED.*?)(?: in (\d+) s \(budget (\d+) s\))?$")


def check(tmp_path: Path, *args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_DRY", "PYTHONPATH")}
    environ.update(PYTHON=sys.executable, GPU_CHECK_DIR=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=environ, cwd=tmp_path)  # from anywhere: the script finds its tree


@pytest.mark.slow  # about 80 s on a busy 2-core machine (a cold torch.compile of the tiny model)
def test_dry_mode_runs_every_step_and_writes_its_summary(tmp_path):
    proc = check(tmp_path, "--dry")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:]
    steps = [m.groups() for m in map(STEP.match, summary.splitlines()) if m]
    assert [s[0] for s in steps] == STEPS and all(s[1] == "ok" for s in steps), summary
    assert sum(int(s[3]) for s in steps) <= 480  # the step budgets fit 8 minutes by construction
    assert all(int(s[2]) <= int(s[3]) for s in steps)
    assert re.search(r"^  recompiles while timed \(.*\): plain 0, trainer 0$", summary, re.M), summary
    assert re.search(r"^  MFU = FLOPs per sample x samples/s / peak FLOP/s = ", summary, re.M), summary
    assert re.search(r"^  \d+ skipped, \d+ deselected", summary, re.M), summary  # cuda tests collected, skipped
    assert len(re.findall(r"\| update 3/3 \|", summary)) == 2  # both demos trained their 3 updates
    for kind in ("full", "lora"):  # the VLM and a released one against a plain transformers (+ peft) loop
        assert re.search(rf"^  ratio {kind} mmvl/plain: \d+\.\d{{3}} ", summary, re.M), summary
        assert re.search(rf"^  ratio {kind} hf_vlm mmvl/plain: \d+\.\d{{3}} ", summary, re.M), summary
    assert re.search(r"^  time ratio mmvl/open_clip: \d+\.\d{3} ", summary, re.M), summary
    assert summary.splitlines()[-1].endswith("all steps passed")
    assert len(summary.encode()) < 10_000  # one small file
    assert (tmp_path / "out" / "logs" / "demo_fp16.log").is_file()


@pytest.mark.proc
def test_the_overall_budget_stops_and_skips_steps(tmp_path):
    proc = check(tmp_path, "--dry", GPU_CHECK_BUDGET="12", timeout=120)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 1, summary
    steps = [m.groups() for m in map(STEP.match, summary.splitlines()) if m]
    assert [s[0] for s in steps] == STEPS, summary  # every step accounted for
    assert steps[0][1] in ("ok", "TIMED OUT") and int(steps[0][2]) <= int(steps[0][3]) <= 12
    assert all(s[1].startswith("SKIPPED") for s in steps[2:]), summary
    total = re.search(r"^gpu_check: (\d+) s in all \(budget 12 s\); FAILED: ", summary, re.M)
    assert total and int(total.group(1)) <= 13, summary


@pytest.mark.proc
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a host without CUDA")
def test_real_mode_without_cuda_says_so_in_one_line_and_exits_2(tmp_path):
    proc = check(tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA device visible"), proc.stderr
    assert "--dry" in proc.stderr


@pytest.mark.parametrize("args, env, needle", [(["--fast"], {}, "'--fast'"),
                                               (["--dry"], {"GPU_CHECK_BUDGET": "8m"}, "GPU_CHECK_BUDGET='8m'"),
                                               (["--dry"], {"DEMO_UPDATES": "0"}, "DEMO_UPDATES='0'")])
@pytest.mark.proc
def test_user_mistakes_exit_2_with_one_line(tmp_path, args, env, needle):
    proc = check(tmp_path, *args, timeout=60, **env)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_suite_collects_without_lmdb_and_fairscale():
    """The GPU machine has neither: modules that need them skip instead of stopping `pytest -m cuda`."""
    code = ("import sys\nfor name in ('lmdb', 'fairscale'):\n    sys.modules[name] = None  # import raises\n"
            "import pytest\nsys.exit(pytest.main(['--collect-only', '-q', '-m', '', '-p', 'no:cacheprovider', "
            "'tests']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]


@pytest.mark.proc
def test_benchmarks_is_this_trees_package_even_with_another_on_the_path(tmp_path):
    """fairscale's wheel installs a top-level ``benchmarks`` package into site-packages (after PYTHONPATH)."""
    (tmp_path / "site" / "benchmarks").mkdir(parents=True)
    (tmp_path / "site" / "benchmarks" / "__init__.py").write_text("")
    code = f"import sys; sys.path.append({str(tmp_path / 'site')!r}); import benchmarks; print(benchmarks.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "benchmarks" / "__init__.py"
