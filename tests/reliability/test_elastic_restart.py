"""``torchrun --max-restarts`` with 2 gloo ranks: rank 1 is SIGKILLed mid-run, torchrun restarts the
group, the run resumes from ``last.ckpt`` by itself (``checkpoint.resume=auto``) and ends bitwise
equal to an uninterrupted 2-process run, for ``ddp`` and ``fsdp``.

One torchrun job (one agent, so CI pays for its start-up once) runs four ``mmvl_run``s in order:
ddp and fsdp with faults, then ddp and fsdp uninterrupted as the references. Attempt 0 loses
rank 1 in the ddp run; attempt 1 resumes ddp, finishes it, then loses rank 1 in the fsdp run;
attempt 2 finds ddp complete (a restart after the end changes nothing), resumes fsdp, and runs
the references once each.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

import torch

from mmvl.io import safe_load
from tests.fixtures.faults import KILLED, SEPARATOR, run_torchrun
from tests.fixtures.toy import register, toy_opts

register()
STRATEGIES = ["ddp", "fsdp"]


def _opts(root: Path, strategy: str) -> list[str]:
    return toy_opts(root, f"distributed.strategy={strategy}", "training.device=cpu",
                    "training.checkpoint_interval=2", "training.max_updates=12",
                    "model_config.toy_mlp.hidden_dropout_prob=0.1", "training.clip_grad_norm=0.5",
                    "distributed.timeout_minutes=1", "checkpoint.resume=auto")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    state = safe_load(path)
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _resumes(root: Path) -> list[int]:
    log = (root / "save" / "train.log").read_text()
    return [int(u) for u in re.findall(r"Resumed from \S+last\.ckpt at update (\d+)", log)]


@pytest.mark.slow  # ~30 s; CI keeps tests/distributed/test_launch.py (the same elastic agent restarting ranks)
def test_rank_killed_torchrun_restarts_and_resumes_bitwise(tmp_path):
    rng = random.Random(20241129)
    kills = {s: rng.randint(3, 9) for s in STRATEGIES}
    faults = [{"update": kills[s], "action": "sigkill", "rank": 1, "attempt": i, "run": i, "when": "after"}
              for i, s in enumerate(STRATEGIES)]
    roots = {(s, kind): tmp_path / kind / s for kind in ("faulted", "straight") for s in STRATEGIES}
    runs = [_opts(roots[s, "faulted"], s) for s in STRATEGIES] + [_opts(roots[s, "straight"], s) for s in STRATEGIES]
    argv = [a for i, opts in enumerate(runs) for a in ([SEPARATOR] if i else []) + opts]
    proc, seconds = run_torchrun(argv, faults, max_restarts=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (counted by the fault's own line: the agent names the first failure by time, and the survivor's
    # "Connection closed by peer" may be seen in the same poll as rank 1's SIGKILL)
    assert [KILLED.format(rank=1, attempt=a) in proc.stderr for a in (0, 1)] == [True, True], \
        "rank 1 was not killed in attempts 0 and 1"
    for s in STRATEGIES:
        resumed = _resumes(roots[s, "faulted"])
        assert kills[s] - 2 <= resumed[0] < kills[s], (s, kills[s], resumed)
        assert _resumes(roots[s, "straight"]) == []  # the references ran once, uninterrupted
        got = _tensors(roots[s, "faulted"] / "save" / "checkpoints" / "last.ckpt")
        want = _tensors(roots[s, "straight"] / "save" / "checkpoints" / "last.ckpt")
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{s}: {k} differs from the uninterrupted run"
    assert _resumes(roots["ddp", "faulted"])[1:] == [12]  # attempt 2: ddp already complete
