"""What a module class's ``forward`` does with its children, read from its source.

Families that merge projections (``qkv``, ``gate_up``) recognise them by structure rather than by
a list of names, and what makes two or three ``nn.Linear`` children one merged GEMM is a
property of the class's ``forward``: that it applies them to the same tensor. These helpers read
that from the source of the first ``forward`` in the class's MRO that calls the children, and
follow plain aliases of the argument (``current = kv if kv is not None else hidden_states``,
``a or b``, a name assigned in both branches of an ``if``). The reading never affects exactness
(the merged slices are exact for any input); it only decides what a family recognises.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

Forward = ast.FunctionDef | ast.AsyncFunctionDef
Aliases = dict[str, list[ast.expr]]


def forwards(cls: type[Any]) -> Iterator[tuple[type[Any], Any, Forward]]:
    """Each ``forward`` defined along the MRO of ``cls`` whose source parses: ``(class, function, tree)``."""
    for klass in cls.__mro__:
        function = klass.__dict__.get("forward")
        tree = parse(function) if function is not None else None
        if tree is not None:
            yield klass, function, tree


def parse(function: object) -> Forward | None:
    """The syntax tree of ``function``; None without readable source (built dynamically, a lambda)."""
    try:
        source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def self_call(node: ast.AST, names: Iterable[str]) -> tuple[str, ast.expr] | None:
    """``(name, input)`` when ``node`` is ``self.<name>(input, ...)`` for one of ``names``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
        argument = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "input"), None)
        if argument is not None:
            return node.func.attr, argument
    return None


def calls(tree: ast.AST, names: Iterable[str]) -> dict[str, list[ast.expr]]:
    """The input argument of every ``self.<name>(...)`` call, per name."""
    found: dict[str, list[ast.expr]] = {name: [] for name in names}
    for node in ast.walk(tree):
        call = self_call(node, found)
        if call is not None:
            found[call[0]].append(call[1])
    return found


def aliases(tree: ast.AST) -> Aliases:
    """Every value assigned to each local name (plain and annotated assignments)."""
    assigned: Aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            assigned.setdefault(node.target.id, []).append(node.value)
    return assigned


def alternatives(expr: ast.expr, assigned: Aliases, seen: frozenset[str] = frozenset()) -> set[str]:
    """The inputs ``expr`` may be: a name is followed only where every value it is given is an alias."""
    if isinstance(expr, ast.IfExp):
        return alternatives(expr.body, assigned, seen) | alternatives(expr.orelse, assigned, seen)
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
        return set().union(*(alternatives(value, assigned, seen) for value in expr.values))
    if isinstance(expr, ast.Name):
        values = assigned.get(expr.id, [])
        if values and expr.id not in seen and all(isinstance(v, (ast.IfExp, ast.BoolOp, ast.Name)) for v in values):
            return set().union(*(alternatives(v, assigned, seen | {expr.id}) for v in values))
        return {expr.id}
    return {ast.unparse(expr)}


def value_of(expr: ast.expr, assigned: Aliases) -> ast.expr:
    """``expr``, or the one value a local name holding it is ever assigned (``h = self.act(self.w(x))``)."""
    seen: set[str] = set()
    while isinstance(expr, ast.Name) and expr.id not in seen and len(assigned.get(expr.id, [])) == 1:
        seen.add(expr.id)
        expr = assigned[expr.id][0]
    return expr
