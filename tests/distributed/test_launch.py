"""``mmvl_run ... distributed.world_size=2`` without a launcher starts the 2 processes itself, through
torch's elastic agent: the same result as torchrun (bitwise), restarts with
``distributed.max_restarts``, a UserError in the ranks ends as one line + exit 2, a crash shows every
failed rank's error. A process-group strategy in a one-process run is a one-line error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmvl.io import safe_load
from mmvl.distributed.launch import processes_to_start
from mmvl_cli.run import main
from tests.fixtures.faults import ROOT, child_env, run_torchrun
from tests.fixtures.toy import register, toy_opts

register()
LIMIT_S = 300


def _user_dir(tmp_path: Path) -> Path:
    """A user_dir that registers the toy parts and installs ``$MMVL_FAULTS`` in every process."""
    package = tmp_path / "mmvl_launch_faults"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import json, os\nfrom tests.fixtures.faults import install\nfrom tests.fixtures.toy import register\n"
        "register()\ninstall(json.loads(os.environ.get('MMVL_FAULTS') or '[]'))\n")
    return package


def _opts(root: Path, user_dir: Path, *extra: str) -> list[str]:
    return toy_opts(root, "distributed.strategy=ddp", "training.device=cpu", "training.max_updates=8",
                    "training.checkpoint_interval=2", "model_config.toy_mlp.hidden_dropout_prob=0.1",
                    "distributed.timeout_minutes=1", f"env.user_dir={user_dir}", *extra)


def _mmvl_run(opts: list[str], faults: list | None = None) -> subprocess.CompletedProcess:
    """A plain ``mmvl_run`` process: no torchrun, no SLURM variables."""
    return subprocess.run([sys.executable, "-m", "mmvl_cli.run", *opts], cwd=ROOT, env=child_env(faults),
                          capture_output=True, text=True, timeout=LIMIT_S)


@pytest.mark.slow  # starts and kills processes: with the slow tests, which CI runs too
def test_world_size_starts_processes_like_torchrun_and_restarts(tmp_path):
    user_dir = _user_dir(tmp_path)
    # rank 1 dies like an OOM kill during update 5 of the first attempt; the agent restarts both
    kill = [{"update": 5, "action": "sigkill", "rank": 1, "attempt": 0}]
    own = _mmvl_run(_opts(tmp_path / "own", user_dir, "distributed.world_size=2", "distributed.max_restarts=1"),
                    kill)
    assert own.returncode == 0, own.stderr[-3000:]
    reference, _ = run_torchrun(_opts(tmp_path / "torchrun", user_dir), nproc=2, timeout=LIMIT_S)
    assert reference.returncode == 0, reference.stderr[-3000:]
    got = safe_load(tmp_path / "own" / "save" / "checkpoints" / "last.ckpt")
    want = safe_load(tmp_path / "torchrun" / "save" / "checkpoints" / "last.ckpt")
    assert got["trainer"] == want["trainer"]  # counters and best alike
    assert (got["trainer"]["update"], got["trainer"]["world_size"]) == (8, 2)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{k} differs from the torchrun run"
    log = (tmp_path / "own" / "save" / "train.log").read_text()
    assert "Resumed from" in log and "at update 4" in log  # the restart continued from update 4


@pytest.mark.slow  # mmvl_run starting two ranks
def test_user_error_in_the_ranks_is_one_line(tmp_path):
    proc = _mmvl_run(_opts(tmp_path, _user_dir(tmp_path), "distributed.world_size=2", "training.batch_size=7"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["mmvl: error: training.batch_size=7 is not divisible by the world size 2; "
                     "use a multiple of 2."], proc.stderr[-3000:]


@pytest.mark.slow
def test_crash_in_one_rank_shows_every_failed_rank(tmp_path):
    fault = [{"update": 3, "action": "raise", "rank": 1}]
    proc = _mmvl_run(_opts(tmp_path, _user_dir(tmp_path), "distributed.world_size=2"), fault)
    assert proc.returncode == 1
    assert "[rank1]: RuntimeError: injected fault on rank 1 at update 3" in proc.stderr  # rank 1's own traceback
    assert "[rank0]: RuntimeError:" in proc.stderr  # rank 0's: its peer is gone
    summary = proc.stderr[proc.stderr.index("mmvl_cli.run FAILED"):]
    assert "rank      : 1 (local_rank: 1)" in summary and "rank      : 0 (local_rank: 0)" in summary


def test_a_multi_process_strategy_in_one_process_is_one_line(tmp_path, capsys):
    for strategy in ("ddp", "fsdp", "zero_torch"):
        assert main(toy_opts(tmp_path, f"distributed.strategy={strategy}", "distributed.world_size=1")) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"mmvl: error: distributed.strategy={strategy} needs "
                                                       "several processes"), err
    assert not (tmp_path / "save" / "checkpoints").exists()


@pytest.mark.parametrize("environ, config, want", [
    ({}, {"distributed": {"world_size": 4}}, 4),                             # MMF's command line
    ({}, {"distributed": {"world_size": 1}}, 0),
    ({"RANK": "0", "WORLD_SIZE": "4"}, {"distributed": {"world_size": 4}}, 0),  # torchrun started it
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n1"},
     {"distributed": {"world_size": 2}}, 0),                                 # srun started it
    ({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}, {"distributed": {"world_size": 2}}, 2),  # sbatch, one task
    ({}, {"distributed": {"world_size": 2, "init_method": "tcp://h:1"}}, 0),  # the user starts each rank
])
def test_processes_to_start(environ, config, want):
    assert processes_to_start(config, environ) == want
