"""Accelerate's own test scripts (``accelerate/test_utils/scripts/``: ``test_script.py``,
``test_sync.py``, ``test_distributed_data_loop.py``), case by case, on Accelerate and on mmvl
(each script module's Accelerate names replaced by ``mmvl.engine``'s), at 1 and 2 gloo processes
under torchrun, side by side: a case that passes on Accelerate must pass on mmvl.

The cases are in ``tests/engine/accelerate_scripts/cases.py``; ``python -m
tests.engine.accelerate_scripts.harness`` prints the table of both.
"""
from __future__ import annotations

import pytest

from tests.engine.accelerate_scripts.cases import cases_at
from tests.engine.accelerate_scripts.harness import run_cases

#: cases that fail on CPU with both implementations, and why (by world size; "*": both)
FAIL_WITH_BOTH = {
    ("script:test_split_between_processes_dataset", "*"):
        "needs Hugging Face `datasets` (not installed; main() skips the case without it)",
}


def _listed(case: str, world: int) -> bool:
    return (case, "*") in FAIL_WITH_BOTH or (case, world) in FAIL_WITH_BOTH


@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_every_case_passing_on_accelerate_passes_on_mmvl(world, tmp_path):
    ids = [c.id for c in cases_at(world)]
    accelerate = run_cases("accelerate", world, ids, out=tmp_path / "accelerate")
    mmvl = run_cases("mmvl", world, ids, out=tmp_path / "mmvl")
    # the harness runs Accelerate as its launcher would: every case not listed passes there
    broken = {c: (accelerate[c][1] or "")[:600] for c in ids if not accelerate[c][0] and not _listed(c, world)}
    assert not broken, f"cases failing on Accelerate itself, not listed in FAIL_WITH_BOTH: {broken}"
    regressions = {c: (mmvl[c][1] or "")[:1500] for c in ids if accelerate[c][0] and not mmvl[c][0]}
    assert not regressions, f"{len(regressions)} cases pass on Accelerate and fail on mmvl: {regressions}"
