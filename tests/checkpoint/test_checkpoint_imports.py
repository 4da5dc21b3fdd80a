"""The checkpoint package sits below the Engine: it imports nothing from data, config or distributed,
not even inside a function (strategies hand it state dicts; the Engine decides who writes)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mmvl" / "checkpoint"
FORBIDDEN = ("mmvl.data", "mmvl.config", "mmvl.distributed", "mmvl.engine", "mmvl.trainers", "mmvl.models")


def imported(source: str) -> list[str]:
    """Every module a source imports, at any depth, ``importlib.import_module("...")`` included."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
    return names


def upward(source: str) -> list[str]:
    return [n for n in imported(source) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_no_upward_import(path):
    assert upward(path.read_text(encoding="utf-8")) == []
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 400


def test_the_check_sees_imports_inside_functions():
    planted = "def f():\n    from mmvl.distributed import comm\n    importlib.import_module('mmvl.config.load')\n"
    assert upward(planted) == ["mmvl.distributed", "mmvl.distributed.comm", "mmvl.config.load"]
