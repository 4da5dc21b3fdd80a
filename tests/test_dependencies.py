"""Declare what the code imports: every third-party module imported anywhere in mmvl/ and mmvl_cli/
(at the top or lazily inside a function) comes from a distribution pyproject.toml names, in the
dependencies or in an extra."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
OWN = {"mmvl", "mmvl_cli"}


def _imported_modules() -> dict[str, str]:
    """Top-level module -> first file:line importing it."""
    found: dict[str, str] = {}
    for path in sorted(p for d in OWN for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                found.setdefault(name.split(".")[0], f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs.extend(extra)
    return {_normalise(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in specs}


def test_every_imported_distribution_is_declared():
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = []
    for module, where in sorted(_imported_modules().items()):
        if module in OWN or module in sys.stdlib_module_names or module == "__future__":
            continue
        dists = distributions.get(module)
        assert dists, f"{module} (imported at {where}) is not installed: declare and install it"
        if not any(_normalise(d) in declared for d in dists):
            missing.append(f"{module} ({where}) from {dists}")
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_scan_finds_lazy_imports():
    modules = _imported_modules()
    assert {"torch", "omegaconf", "yaml", "safetensors", "tokenizers"} <= set(modules)
