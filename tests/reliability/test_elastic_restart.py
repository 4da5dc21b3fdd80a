"""``torchrun --max-restarts=1`` with 2 gloo ranks: rank 1 is SIGKILLed mid-run on the first
attempt, torchrun restarts the group, the run resumes from ``last.ckpt`` by itself
(``checkpoint.resume=auto``) and ends bitwise equal to an uninterrupted 2-process run."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from mmvl.checkpoint import safe_load
from tests.distributed.dist_launch import launch
from tests.fixtures.faults import run_torchrun
from tests.fixtures.toy import register, toy_opts

register()
STRATEGIES = ["ddp", "fsdp"]


def _opts(root: Path, strategy: str) -> list[str]:
    return toy_opts(root, f"distributed.strategy={strategy}", "training.device=cpu",
                    "training.checkpoint_interval=2", "training.max_updates=12",
                    "model_config.toy_mlp.hidden_dropout_prob=0.1", "training.clip_grad_norm=0.5",
                    "distributed.timeout_minutes=1", "checkpoint.resume=auto")


def _uninterrupted(env, root: str, strategies: list[str]) -> None:
    """Every rank: one uninterrupted ``mmvl_run`` per strategy in this process group."""
    from mmvl_cli.run import main

    register()
    torch.set_num_threads(1)
    for s in strategies:
        assert main(_opts(Path(root) / s, s)) == 0


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    state = safe_load(path)
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    launch(_uninterrupted, world_size=2, args=(str(root), STRATEGIES), timeout=240)
    return root


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rank_killed_torchrun_restarts_and_resumes_bitwise(tmp_path, reference, strategy):
    kill = random.Random(f"elastic-{strategy}").randint(3, 9)
    fault = {"update": kill, "action": "sigkill", "rank": 1, "attempt": 0, "when": "after"}
    proc, seconds = run_torchrun(_opts(tmp_path, strategy), [fault], max_restarts=1, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"exitcode: -9\) local_rank: 1", proc.stderr), "rank 1 was not killed"
    log = (tmp_path / "save" / "train.log").read_text()
    resumed = [int(u) for u in re.findall(r"Resumed from \S+last\.ckpt at update (\d+)", log)]
    assert len(resumed) == 1 and kill - 2 <= resumed[0] < kill, (kill, resumed)
    got = _tensors(tmp_path / "save" / "checkpoints" / "last.ckpt")
    want = _tensors(reference / strategy / "save" / "checkpoints" / "last.ckpt")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{strategy}: {k} differs from the uninterrupted run"
