"""One rank fails, the job ends: a bug (RuntimeError) on rank 1 mid-step takes both processes
down within seconds with rank 1's error in the output; a NaN loss on rank 1 only stops both
ranks at the same update with NonFiniteLossError (exit code 2, one line each)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from mmvl.io import safe_load
from tests.fixtures.faults import launch_ranks, run_torchrun
from tests.fixtures.toy import toy_opts

LIMIT_S = 60


def _opts(root: Path, *extra: str) -> list[str]:
    return toy_opts(root, "distributed.strategy=ddp", "training.device=cpu", "training.max_updates=12",
                    "training.checkpoint_interval=2", "distributed.timeout_minutes=1", *extra)


@pytest.mark.parametrize("when, extra", [
    pytest.param("before", (), marks=pytest.mark.slow),  # rank 0 is left waiting in the gradient all-reduce
    # rank 0 waits in the next collective, with a DataLoader worker process of its own
    pytest.param("after", ("training.num_workers=1",), marks=pytest.mark.slow),
])
def test_rank1_raises_under_torchrun_both_exit_fast(tmp_path, when, extra):
    fault = {"update": 5, "action": "raise", "rank": 1, "when": when}
    proc, seconds = run_torchrun(_opts(tmp_path, *extra), [fault], timeout=LIMIT_S + 60)
    assert proc.returncode not in (0, None), "torchrun should report the failure"
    assert seconds < LIMIT_S, f"took {seconds:.0f} s"
    assert "RuntimeError: injected fault on rank 1 at update 5" in proc.stderr
    assert "rank      : 1 (local_rank: 1)" in proc.stderr  # torchrun names rank 1 as the failure


@pytest.mark.slow
def test_rank1_raises_without_an_agent_both_exit_fast(tmp_path):
    """Plain processes (srun-style, nobody to kill the survivor): rank 0 must notice by itself."""
    start = time.monotonic()
    ranks = launch_ranks(_opts(tmp_path), 2, [{"update": 5, "action": "raise", "rank": 1, "when": "before"}],
                         timeout=LIMIT_S + 60)
    assert time.monotonic() - start < LIMIT_S
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr[-800:] for r in ranks]
    assert "RuntimeError: injected fault on rank 1 at update 5" in ranks[1].stderr


@pytest.mark.slow  # two torchrun ranks
def test_nan_on_one_rank_stops_both_with_exit_2(tmp_path):
    start = time.monotonic()
    ranks = launch_ranks(_opts(tmp_path), 2, [{"update": 5, "action": "nan", "rank": 1}], timeout=LIMIT_S + 60)
    assert time.monotonic() - start < LIMIT_S
    for rank, r in enumerate(ranks):
        assert r.returncode == 2, (rank, r.stderr[-1500:])
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        prefix = "mmvl: error: " if rank == 0 else "mmvl: error (rank 1): "
        assert len(lines) == 1 and lines[0].startswith(prefix), r.stderr
        assert "Loss is not finite at update 5" in lines[0] and "Traceback" not in r.stderr
    assert "cross_entropy=nan" in ranks[1].stderr
    # both stopped before update 5 was applied; the message points at the last good checkpoint
    last = tmp_path / "save" / "checkpoints" / "last.ckpt"
    assert f"Last good checkpoint: {last}" in ranks[0].stderr
    assert safe_load(last)["trainer"]["update"] == 4
