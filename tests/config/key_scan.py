"""A static scan of which config keys mmvl's code reads, for the key-coverage test.

Reads are found in the AST of ``mmvl/`` and ``mmvl_cli/`` as chains of key names:

- dotted literals given to the one getter (``config_value(c, "training.seed")``, ``lookup``,
  ``OmegaConf.select``); an f-string such as ``f"distributed.nccl.{key}"`` reads everything
  below its constant prefix (a trailing ``*``);
- attribute, subscript and ``.get("name")`` chains (``config.training.get("clip_grad_norm")``),
  through plain conversions (``plain(...)``, ``dict(...)``, ``int(...)``, ``x or {}``) and through
  names assigned from them in the same function (``t = config.training``; ``t.seed``);
- identifier-like string constants (tables of key names such as ``BERT_KEYS``).

A chain is *config-rooted* when it starts at a name or attribute called ``config``/``cfg`` (or
``*_config``/``*_cfg``, or ``sections``: the Trainer's typed sections, ``trainer.sections.training.x``), or at a name assigned from such a chain; those chains are what code
claims exists in a config, so they are checked against the shipped YAMLs.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

GETTERS = {"config_value", "lookup", "select"}  # (config, "dotted.key", ...)
PASS_THROUGH = {"plain", "plain_dict", "plain_config", "dict", "int", "float", "str", "bool", "list", "tuple",
                "to_container", "create", "OmegaConf"}
CONFIG_NAME = re.compile(r"^(config|cfg|conf|sections|.*_config|.*_cfg)$")
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
WILDCARD = "*"


@dataclass(frozen=True)
class Read:
    """One chain of key names read at ``where`` (file:line); ``rooted``: starts at a config."""

    keys: tuple[str, ...]
    where: str
    rooted: bool


@dataclass
class _Chain:
    keys: list[str] = field(default_factory=list)
    rooted: bool = False


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.reads: list[Read] = []
        self.aliases: list[dict[str, _Chain]] = [{}]
        self.docstrings: set[int] = set()

    # -- scopes and aliases -------------------------------------------------------------------------
    def _scoped(self, node: ast.AST) -> None:
        body = getattr(node, "body", [])
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self.docstrings.add(id(body[0].value))
        self.aliases.append({})
        self.generic_visit(node)
        self.aliases.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _scoped

    def visit_Module(self, node: ast.Module) -> None:
        self._scoped(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        chain = self.chain(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name):
                if chain is not None and chain.rooted:
                    self.aliases[-1][target.id] = chain
                else:
                    self.aliases[-1].pop(target.id, None)
            else:
                self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno))

    # -- reads -----------------------------------------------------------------------------------
    def _record(self, node: ast.AST) -> None:
        chain = self.chain(node)
        if chain is not None and chain.keys:
            self.reads.append(Read(tuple(chain.keys), f"{self.path}:{getattr(node, 'lineno', 0)}", chain.rooted))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._record(node)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._record(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self._record(node)
        func = node.func  # a method (``x.get``, ``s.lower``) is not a key: visit what it is called on
        self.visit(func.value if isinstance(func, ast.Attribute) else func)
        for arg in [*node.args, *node.keywords]:
            self.visit(arg)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.docstrings and IDENT.match(node.value):
            self.reads.append(Read(tuple(node.value.split(".")), f"{self.path}:{node.lineno}", False))

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        pass  # messages; f-string keys are read through the getters above

    # -- chains ----------------------------------------------------------------------------------
    def chain(self, node: ast.AST) -> _Chain | None:
        """The key names ``node`` reads, or None when it is not a read of named keys."""
        if isinstance(node, ast.Name):
            alias = self._alias(node.id)
            if alias is not None:
                return _Chain(list(alias.keys), True)
            return _Chain([], bool(CONFIG_NAME.match(node.id)))
        if isinstance(node, ast.Attribute):
            base = self.chain(node.value)
            if base is None:
                return None
            if CONFIG_NAME.match(node.attr) and not base.keys:
                return _Chain([], True)
            return _Chain(base.keys + [node.attr], base.rooted)
        if isinstance(node, ast.Subscript):
            key = node.slice
            base = self.chain(node.value)
            if base is None or not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return None
            return _Chain(base.keys + [key.value], base.rooted)
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            return self.chain(node.values[0])
        if isinstance(node, ast.Call):
            return self._call_chain(node)
        return None

    def _call_chain(self, node: ast.Call) -> _Chain | None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        args = node.args
        if name in GETTERS and len(args) >= 2:
            base = self.chain(args[0])
            keys = _literal_keys(args[1])
            if keys is None:
                return None
            return _Chain((base.keys if base else []) + keys, True)  # the getters read configs
        if name == "get" and isinstance(func, ast.Attribute) and args and _is_str(args[0]):
            base = self.chain(func.value)
            return None if base is None else _Chain(base.keys + [args[0].value], base.rooted)
        if name == "getattr" and len(args) >= 2 and _is_str(args[1]):
            base = self.chain(args[0])
            return None if base is None else _Chain(base.keys + [args[1].value], base.rooted)
        if name in PASS_THROUGH and args:
            return self.chain(args[0])
        return None

    def _alias(self, name: str) -> _Chain | None:
        for scope in reversed(self.aliases):
            if name in scope:
                return scope[name]
        return None


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _literal_keys(node: ast.AST) -> list[str] | None:
    """``"a.b"`` -> [a, b]; ``f"a.b.{x}"`` -> [a, b, *]."""
    if _is_str(node):
        return node.value.split(".")
    if isinstance(node, ast.JoinedStr) and node.values and _is_str(node.values[0]):
        prefix = node.values[0].value
        return [k for k in prefix.split(".") if k] + [WILDCARD]
    return None


def scan(files: Iterable[Path], root: Path) -> list[Read]:
    reads: list[Read] = []
    for path in files:
        scanner = _Scanner(str(path.relative_to(root)))
        scanner.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        reads.extend(scanner.reads)
    return reads


# -- the shipped keys ------------------------------------------------------------------------------
def shipped_tree(defaults: dict[str, Any], components: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """defaults.yaml with every model/dataset YAML merged in (their model_config/dataset_config parts)."""
    tree = _merge({}, defaults)
    for layer in components:
        _merge(tree, layer)
    return tree


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> dict[str, Any]:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = _merge({}, value) if isinstance(value, dict) else value
    return dst


def leaf_keys(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key a user sets: leaves, empty mappings, and ``params`` nodes (their contents are the
    keyword arguments of a registered component, checked by its signature, not read by name)."""
    keys: list[tuple[str, ...]] = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value and key != "params":
            keys.extend(leaf_keys(value, path))
        else:
            keys.append(path)
    return keys


def is_read(key: tuple[str, ...], reads: list[Read]) -> bool:
    """Some read chain ends at this key: its names are the key's last names (``*``: anything below)."""
    for read in reads:
        names = read.keys
        if names[-1] == WILDCARD:
            head = names[:-1]
            if any(key[i:i + len(head)] == head for i in range(len(key) - len(head))):
                return True
        elif len(names) <= len(key) and key[len(key) - len(names):] == names:
            return True
    return False


def exists(names: tuple[str, ...], tree: dict[str, Any], open_roots: tuple[str, ...]) -> bool:
    """Whether the chain ``names`` is a path in the shipped tree: from the top when it starts at a
    top-level section, else anywhere below. ``params``, empty mappings and the children of
    ``open_roots`` (model_config/dataset_config: one node per registered name) accept anything."""
    names = tuple(n for n in names if n != WILDCARD)
    if not names:
        return True
    if names[0] in tree:
        return _walk(names, tree, open_roots, top=True)
    return any(_walk(names, node, (), top=False) for node in _nodes(tree))


def _walk(names: tuple[str, ...], node: Any, open_roots: tuple[str, ...], top: bool) -> bool:
    for i, name in enumerate(names):
        if not isinstance(node, dict):
            return False
        if name not in node:
            return node == {}
        if name == "params" or (top and i == 0 and name in open_roots and len(names) > 1 and names[1] not in
                                node[name]):
            return True
        node = node[name]
    return True


def _nodes(tree: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield tree
    for value in tree.values():
        if isinstance(value, dict):
            yield from _nodes(value)
