"""Recognising a forward by its code, not by its class name.

A sparse MoE block is fused only when the code it runs is code this family reproduces. Class
names cannot prove that (a model may copy Qwen2-MoE's block under its own name, or a release may
change Mixtral's forward under the same one), so each method is reduced to a fingerprint: the
hash of its tokens with comments, blank lines, indentation, decorators and the docstring left
out. Two methods with one fingerprint run the same statements on the same names; a changed
statement gives another fingerprint, and the block is refused.

Tokens (not ``ast.dump``, whose text changed in 3.13), with each string literal one token, as
Python 3.11's ``tokenize`` gives it: from 3.12 (PEP 701) an f-string comes as ``FSTRING_START``,
its text and the tokens of each replacement field, then ``FSTRING_END``, and
:func:`joined_fstrings` joins these back into the one ``STRING`` token of the literal's source
text. So a method has one fingerprint on every Python release this project supports.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
#: The token types that open and close an f-string from Python 3.12; None before (an f-string is one STRING token).
_FSTRING_START: int | None = getattr(tokenize, "FSTRING_START", None)
_FSTRING_END: int | None = getattr(tokenize, "FSTRING_END", None)


def joined_fstrings(tokens: Iterable[tokenize.TokenInfo], lines: Sequence[str]) -> Iterator[tokenize.TokenInfo]:
    """``tokens`` with the parts of each f-string, ``FSTRING_START`` to its ``FSTRING_END`` (nested f-strings
    inside), replaced by one ``STRING`` token of the literal's source text in ``lines`` (kept line ends): the
    token Python 3.11 gives. Only the two ends' positions are read: 3.12.1 misplaces text after a ``{{``."""
    openings: list[tokenize.TokenInfo] = []
    for token in tokens:
        if token.type == _FSTRING_START:
            openings.append(token)
        elif openings and token.type == _FSTRING_END:
            opening = openings.pop()
            if not openings:
                (first, start), (last, end) = opening.start, token.end
                text = "".join(lines[first - 1:last])
                text = text[start:len(text) - len(lines[last - 1]) + end]
                yield tokenize.TokenInfo(tokenize.STRING, text, opening.start, token.end, opening.line)
        elif not openings:
            yield token


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
    lines = source.splitlines(keepends=True)
    for token in joined_fstrings(tokenize.generate_tokens(io.StringIO(source).readline), lines):
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
