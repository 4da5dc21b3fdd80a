"""The house rules that a reader of the code relies on, held by reading the source (nothing runs):

- only ``mmvl/config/`` reads dotted keys (``config_value(``) or chains ``config.<section>.get(``:
  everything else is handed its typed section;
- nothing outside ``mmvl/distributed/`` decides by a strategy's name: it asks what the strategy can do;
- no module of ``mmvl/`` over 400 lines, no function over 60;
- ``mmvl/labels.py`` (``IGNORE_INDEX``) imports nothing from mmvl, and nothing outside ``mmvl/losses``
  imports the loss registry for ``IGNORE_INDEX``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for d in ("mmvl", "mmvl_cli") for p in (ROOT / d).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _hits(pattern: str, outside: str) -> list[str]:
    found = re.compile(pattern)
    return [f"{_rel(p)}:{i}: {line.strip()}" for p in FILES if not _rel(p).startswith(outside)
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if found.search(line)]


def test_only_config_reads_dotted_keys_or_chains_into_a_config():
    assert _hits(r"\bconfig_value\(|\bconfig\.[a-z_]+\.get\(", "mmvl/config/") == []


def test_no_strategy_is_compared_by_its_name_outside_distributed():
    assert _hits(r"strategy\.name\s*(==|!=|in\b|not in\b)|\bname\s*==\s*['\"](fsdp|ddp|dp|single|zero_\w+)['\"]",
                 "mmvl/distributed/") == []


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_modules_and_functions_stay_short(path):
    source = path.read_text(encoding="utf-8")
    assert source.count("\n") <= 400, f"{_rel(path)} has {source.count(chr(10))} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert long == [], f"{_rel(path)}: {long}"


def test_ignore_index_lives_in_a_leaf_that_no_data_or_model_reaches_through_the_losses():
    leaf = ast.parse((ROOT / "mmvl" / "labels.py").read_text(encoding="utf-8"))
    assert not [n for n in ast.walk(leaf) if isinstance(n, (ast.Import, ast.ImportFrom))]
    through_losses = [f"{_rel(p)}:{n.lineno}" for p in FILES if not _rel(p).startswith("mmvl/losses/")
                      for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                      if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mmvl.losses")
                      and any(a.name == "IGNORE_INDEX" for a in n.names)]
    assert through_losses == []
