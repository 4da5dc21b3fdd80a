"""The modules of ``mmvl/engine/`` import each other as a DAG: no circle, counting imports at module
level, inside functions and under ``if TYPE_CHECKING:`` (a circle held by a late import still ties
the files together). What the prepared objects need from the Engine comes through the leaf
:mod:`mmvl.engine.clock`, not through an import of :mod:`mmvl.engine.core`.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "mmvl.engine"
ENGINE_DIR = ROOT / "mmvl" / "engine"


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (``__init__`` is the package itself)."""
    found = {}
    for path in sorted(ENGINE_DIR.glob("*.py")):
        name = PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"
        found[name] = path
    return found


def imported(path: Path, own: str, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its tree (functions and
    ``TYPE_CHECKING`` blocks included); ``from mmvl.engine import nested`` names the submodule."""
    is_package = path.stem == "__init__"
    base_parts = own.split(".") if is_package else own.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base_parts[: len(base_parts) - (node.level - 1)]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in modules else source)
        for target in targets:
            if target in modules and target != own:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported(path, name, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as a path that starts and ends on the same module, or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == grey:
                return stack[stack.index(nxt):] + [nxt]
            if colour[nxt] == white:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = black
        return None

    for start in sorted(graph):
        if colour[start] == white:
            found = visit(start)
            if found:
                return found
    return None


def test_engine_imports_form_a_dag():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in mmvl/engine: " + " -> ".join(cycle)


def test_cycle_finder_sees_type_checking_and_function_imports(tmp_path):
    """The checker itself: a back-import under TYPE_CHECKING or inside a function is a circle."""
    a = tmp_path / "a.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mmvl.engine.b import B\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from mmvl.engine import a\n")
    modules = {"mmvl.engine.a", "mmvl.engine.b"}
    graph = {"mmvl.engine.a": imported(a, "mmvl.engine.a", modules),
             "mmvl.engine.b": imported(b, "mmvl.engine.b", modules)}
    assert graph == {"mmvl.engine.a": {"mmvl.engine.b"}, "mmvl.engine.b": {"mmvl.engine.a"}}
    assert find_cycle(graph) is not None
    assert find_cycle({"mmvl.engine.a": {"mmvl.engine.b"}, "mmvl.engine.b": set()}) is None
