"""Trainers and callbacks run collectives only through the Engine (its gather, reduce_dict,
on_main_agreed, ...): no module under mmvl/trainers imports mmvl.distributed.comm, at any depth."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_layering import ROOT, imports

COMM = "mmvl.distributed.comm"
TRAINERS = sorted((ROOT / "mmvl" / "trainers").rglob("*.py"))


def comm_imports(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in imports(path)
            if name == COMM or name.startswith(COMM + ".")]


@pytest.mark.parametrize("path", TRAINERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_trainer_module_imports_comm(path):
    assert comm_imports(path) == []


@pytest.fixture
def planted():
    """A throwaway module under mmvl/trainers (removed afterwards, whatever the test does)."""
    fake = ROOT / "mmvl" / "trainers" / "callbacks" / "_planted_for_test.py"
    yield fake
    fake.unlink(missing_ok=True)


def test_a_planted_comm_import_is_found(planted):
    """Not vacuous: ``from mmvl.distributed import comm`` inside a function, and a name from it."""
    planted.write_text("def f():\n    from mmvl.distributed import comm\n"
                       "    from mmvl.distributed.comm import AsyncMax\n", encoding="utf-8")
    found = comm_imports(planted)
    assert len(found) == 2 and all(COMM in f for f in found)
