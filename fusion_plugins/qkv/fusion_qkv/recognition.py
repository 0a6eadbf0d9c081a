"""Which children of an attention module are its q/k/v projections, and whether they read one input.

Architectures name the three projections differently (``q_proj``/``k_proj``/``v_proj`` in Llama,
Whisper and BART, ``query``/``key``/``value`` in BERT, RoBERTa, XLM-R, ELECTRA, BigBird and
CamemBERT, ``q_lin``/``k_lin``/``v_lin`` in DistilBERT, ``q``/``k``/``v`` in T5), so no list of
names is kept: a triple is three ``nn.Linear`` children whose names differ only in the role word,
``q``/``k``/``v`` or ``query``/``key``/``value``, in the same place (``<prefix><role><suffix>``).

A triple is worth one merged GEMM only when the three are applied to the same tensor. That is a
property of the class's ``forward``, not of the instance, so it is read from the source of the
first ``forward`` in the class's MRO that calls the projections: the argument of every call is
followed through plain aliases (``current = kv if kv is not None else hidden_states``, ``a or b``,
a name assigned in both branches of an ``if``), and the three must share at least one possible
input. Whisper's and BART's attention (``k_proj(current_states)``, where ``current_states`` may be
``hidden_states``) pass, their cross-attention instances being excluded by path; BERT's
``BertCrossAttention`` (``key(encoder_hidden_states)``) does not. The analysis never affects
exactness, which the merged slices guarantee for any input; it keeps modules that could never
share a GEMM unfused, with a reason.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Iterable
from typing import Any

from torch import nn

from fusion_core.merged import MergedSlice

#: The role words of a triple, in concatenation order.
ROLE_WORDS = (("q", "k", "v"), ("query", "key", "value"))


def projection_triples(module: nn.Module) -> list[tuple[str, str, str]]:
    """Every ``(q, k, v)`` triple of children with at least one ``nn.Linear`` (or a slice that replaced one).

    A triple with a member of another kind (a quantised or ``Conv1d`` ``v_proj``) is still returned, so
    that it is refused as such rather than not recognised; ``q_norm``/``k_norm``/``v_norm`` (Gemma3n)
    hold no ``nn.Linear`` and are no triple.
    """
    children = {name: child for name, child in module._modules.items() if child is not None}
    triples: list[tuple[str, str, str]] = []
    for name in children:
        for q, k, v in ROLE_WORDS:
            for match in re.finditer(re.escape(q), name):
                prefix, suffix = name[: match.start()], name[match.end():]
                triple = (name, f"{prefix}{k}{suffix}", f"{prefix}{v}{suffix}")
                if (all(part in children for part in triple) and triple not in triples
                        and any(isinstance(children[part], (nn.Linear, MergedSlice)) for part in triple)):
                    triples.append(triple)
    return triples


def input_refusal(cls: type[nn.Module], names: tuple[str, str, str]) -> str | None:
    """Why the ``forward`` of ``cls`` cannot feed one tensor to all of ``names``; None when it can."""
    return _input_refusal(cls, names)


@functools.lru_cache(maxsize=256)
def _input_refusal(cls: Any, names: tuple[str, str, str]) -> str | None:
    for klass in cls.__mro__:
        function = klass.__dict__.get("forward")
        tree = _parse(function) if function is not None else None
        if tree is None:
            continue
        calls = _calls(tree, names)
        if not any(calls.values()):
            continue
        missing = [name for name in names if not calls[name]]
        if missing:
            return f"{klass.__qualname__}.forward does not call {'/'.join(missing)}: q/k/v are not one attention input"
        assigned = _aliases(tree)
        inputs = {name: set().union(*(_alternatives(arg, assigned, frozenset()) for arg in args))
                  for name, args in calls.items()}
        if set.intersection(*inputs.values()):
            return None
        shown = ", ".join(f"{name}({' | '.join(sorted(inputs[name]))})" for name in names)
        return f"{klass.__qualname__}.forward applies the projections to different inputs: {shown} (cross-attention)"
    return f"no forward of {cls.__qualname__} calls {'/'.join(names)} directly: cannot tell that they read one input"


def _parse(function: object) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):  # no source (built dynamically), or a lambda's line
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _calls(tree: ast.AST, names: Iterable[str]) -> dict[str, list[ast.expr]]:
    """The input argument of every ``self.<name>(...)`` call, per name."""
    calls: dict[str, list[ast.expr]] = {name: [] for name in names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            argument = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "input"), None)
            if argument is not None:
                calls[node.func.attr].append(argument)
    return calls


def _aliases(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """Every value assigned to each local name (plain and annotated assignments)."""
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            assigned.setdefault(node.target.id, []).append(node.value)
    return assigned


def _alternatives(expr: ast.expr, assigned: dict[str, list[ast.expr]], seen: frozenset[str]) -> set[str]:
    """The inputs ``expr`` may be: a name is followed only where every value it is given is an alias."""
    if isinstance(expr, ast.IfExp):
        return _alternatives(expr.body, assigned, seen) | _alternatives(expr.orelse, assigned, seen)
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
        return set().union(*(_alternatives(value, assigned, seen) for value in expr.values))
    if isinstance(expr, ast.Name):
        values = assigned.get(expr.id, [])
        if values and expr.id not in seen and all(isinstance(v, (ast.IfExp, ast.BoolOp, ast.Name)) for v in values):
            return set().union(*(_alternatives(v, assigned, seen | {expr.id}) for v in values))
        return {expr.id}
    return {ast.unparse(expr)}
