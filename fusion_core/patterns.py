"""Module-path patterns (``target_modules``, ``exclude_modules``, ``target_modules_patterns``), in linear time.

These patterns arrive from files fusion-core does not control: the ``fusion_core`` record of a
downloaded ``config.json`` is applied on load. Python's ``re`` backtracks, so a pattern such as
``(.*.*)*X`` takes minutes on a 30-character module path. Patterns are therefore compiled and
searched with RE2 (the ``google-re2`` package), whose matching time is linear in the length of
the path for every pattern. The syntax is Python's for everything module paths need (``.``,
``\\.``, ``|``, ``^``, ``$``, classes, repetition); backreferences and lookaround, which cannot
run in linear time, are refused when the option is validated.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import re2

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the error is raised to the caller, not also printed on stderr


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> Any:
    """The compiled RE2 pattern; ``ValueError`` naming the pattern when RE2 cannot run it."""
    if not isinstance(pattern, str):
        raise TypeError(f"a module-path pattern is a str, got {type(pattern).__name__}")
    try:
        return re2.compile(pattern, options=_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise ValueError(
            f"invalid regular expression {pattern!r}: {reason} (module-path patterns run on RE2: no "
            "backreferences or lookaround)"
        ) from None


def search_any(patterns: Iterable[str], path: str) -> bool:
    """Whether any of ``patterns`` is found in ``path`` (``re.search`` semantics), in linear time."""
    return any(compile_pattern(pattern).search(path) is not None for pattern in patterns)
