"""Recognising a forward by its code, not by its class name.

A sparse MoE block is fused only when the code it runs is code this family reproduces. Class
names cannot prove that (a model may copy Qwen2-MoE's block under its own name, or a release may
change Mixtral's forward under the same one), so each method is reduced to a fingerprint: the
hash of its tokens with comments, blank lines, indentation, decorators and the docstring left
out. Two methods with one fingerprint run the same statements on the same names; a changed
statement gives another fingerprint, and the block is refused.

Tokens (not ``ast.dump``) because the token stream of a source text is the same on every Python
release this project supports, while ``ast.dump``'s text changed in 3.13.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable
from typing import Any

_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}


def function_fingerprint(function: Callable[..., Any]) -> str | None:
    """A 16-hex-digit fingerprint of ``function``'s code; None when its source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    skipped_lines: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        skipped_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    tokens: list[str] = []
    started = False
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if not started:  # decorators come before the ``def``; the function's own name does not matter
            started = token.type == tokenize.NAME and token.string == "def"
            if started:
                tokens.append("def")
            continue
        if token.type in _SKIPPED or token.start[0] in skipped_lines:
            continue
        tokens.append(token.string)
    tokens[1] = "<name>"
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]


def method_fingerprints(cls: type, stop: type) -> dict[str, str | None]:
    """Fingerprints of every method ``cls`` runs that is defined below ``stop`` in its MRO (``__init__`` aside)."""
    names = {name for klass in cls.__mro__ if klass not in stop.__mro__ for name, value in vars(klass).items()
             if inspect.isfunction(value) and name != "__init__"}
    return {name: function_fingerprint(getattr(cls, name)) for name in sorted(names)}
