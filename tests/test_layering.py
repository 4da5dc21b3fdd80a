"""Every import in mmvl/ and mmvl_cli/ goes down the layer table or stays in its layer, including
imports inside functions and ``importlib.import_module("...")`` with a literal name.

The table is the architecture's (docs/architecture.md): a module imports only from its own
layer or below, so data never imports models, a strategy never imports checkpoints, config
never imports the layers that read it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: layer, bottom to top: each module of mmvl/ falls under the longest prefix listed
LAYERS: dict[str, int] = {
    "mmvl.errors": 0, "mmvl.utils": 0, "mmvl.labels": 0,
    "mmvl.registry": 1, "mmvl.io": 1, "mmvl.locks": 1,
    "mmvl.config": 2,
    "mmvl.distributed": 3, "mmvl.losses": 3, "mmvl.adapters": 3, "mmvl.runs": 3,
    "mmvl.data": 4, "mmvl.metrics": 4, "mmvl.optim": 4, "mmvl.plots": 4,
    "mmvl.models": 5,
    "mmvl.checkpoint": 6, "mmvl.tracking": 6,
    "mmvl.engine": 7,
    "mmvl.trainers": 8, "mmvl.build": 8, "mmvl.export": 8,
    "mmvl": 9,  # the package itself: ``import mmvl`` registers every built-in
    "mmvl_cli": 9,
}


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name (None: not ours)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        found = LAYERS.get(".".join(parts[:n]))
        if found is not None:
            return found
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative ones resolved, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in _MODULES]
            found += [(node.lineno, m) for m in submodules] or [(node.lineno, base)]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def upward(path: Path) -> list[str]:
    """The imports of ``path`` that reach a higher layer than its own."""
    own = layer_of(module_name(path))
    return [f"{path.relative_to(ROOT)}:{line} imports {name} (layer {layer_of(name)} > {own})"
            for line, name in imports(path) if (layer_of(name) or -1) > own]


FILES = sorted(p for d in ("mmvl", "mmvl_cli") for p in (ROOT / d).rglob("*.py"))
_MODULES = {module_name(p) for p in FILES}


def test_every_module_has_a_layer():
    assert [module_name(p) for p in FILES if layer_of(module_name(p)) is None] == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_import(path):
    assert upward(path) == []


def test_a_planted_upward_import_is_found(tmp_path):
    """The check is not vacuous: a data module importing the Engine inside a function, and a
    config module importing trainers by name, are both caught."""
    fake = ROOT / "mmvl" / "data" / "_planted_for_test.py"
    try:
        fake.write_text("def f():\n    from mmvl.engine import Engine\n"
                        "    import importlib\n    importlib.import_module('mmvl.trainers')\n", encoding="utf-8")
        found = upward(fake)
    finally:
        fake.unlink()
    assert len(found) == 2 and "mmvl.engine" in found[0] and "mmvl.trainers" in found[1]
