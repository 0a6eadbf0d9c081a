"""How a quantizing load will treat each original module, read from its config before any weight is.

A merged projection holds one scheme: its parts (q, k and v) must be quantized alike, or all left
alone. transformers decides per module, from the config: a list of modules not to convert
(bitsandbytes' ``llm_int8_skip_modules``, ``modules_to_not_convert`` for the others) and, for
torchao, a per-module config (``FqnToConfig`` / ``ModuleFqnToConfig``: exact names, ``re:``
patterns, ``_default``). :func:`part_schemes` predicts that decision per part, so that parts the
load would treat differently are refused at planning time, not found after the weights are read
(the conversion still checks what it receives).

Skip lists are matched by every rule transformers has used: a substring (4.57), and from 5.x a
name prefix ending at a module boundary, a regular expression with that boundary, or a suffix; a
part any rule skips counts as skipped. Where the rules disagree the prediction can be wrong, and the
conversion's own check of the parts it receives refuses instead (after the weights are read).

The patterns come from a checkpoint's config, which fusion-core does not control, so they run on
RE2 (:func:`fusion_core.plugin.compile_pattern`), in time linear in the module path, with transformers' semantics
(its ``re.match`` with a boundary, torchao's ``re.fullmatch``): Python's ``re`` backtracks, and a
pattern such as ``(.*.*)*X`` would hang the planning. A pattern RE2 cannot run (a backreference,
lookaround) matches nothing here, like a pattern ``re`` rejects; the conversion's check then decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusion_core.plugin import compile_pattern
from fusion_quantization.compat import TORCHAO_DEFAULT, TORCHAO_PATTERN_PREFIX, torchao_module_table

SKIPPED = "left unquantized"


def config_field(quantization: Any, name: str) -> Any:
    """A field of a quantization config, whether the load passed the config object or the checkpoint stored a dict."""
    return quantization.get(name) if isinstance(quantization, dict) else getattr(quantization, name, None)


def _skip_list(quantization: Any) -> list[str]:
    names = config_field(quantization, "llm_int8_skip_modules") or []
    names = [*names, *(config_field(quantization, "modules_to_not_convert") or [])]
    return [str(name) for name in names]


def skipped(fqn: str, patterns: Sequence[str]) -> bool:
    """Whether any of transformers' matching rules skips module ``fqn`` for one of ``patterns``."""
    return any(key in fqn or fqn.endswith(key) or _matches_to_a_boundary(key, fqn) for key in patterns)


def _matches_to_a_boundary(key: str, fqn: str) -> bool:
    """transformers 5.x's ``re.match(rf"(?:{key})(?:(?<=\\.)|(?=\\.|$))", fqn)``: ``key`` matches ``fqn`` from its
    start to a module boundary (just before or after a dot, or the end).

    RE2 has no lookaround, so each boundary is tried as the end of a full match; RE2 matches up to
    ``endpos`` seeing the text around it, so ``$`` and ``\\b`` in ``key`` mean what they mean in transformers'
    ``re.match``. A module path has a few dots: a few linear-time matches.
    """
    compiled = _compiled(key)
    if compiled is None:
        return False
    dots = [i for i, char in enumerate(fqn) if char == "."]
    ends = sorted({len(fqn), *dots, *(i + 1 for i in dots)})
    return any(compiled.fullmatch(fqn, 0, end) is not None for end in ends)


def _compiled(pattern: str) -> Any:
    """The RE2 pattern, or None when RE2 cannot run it (the prediction then ignores it)."""
    try:
        return compile_pattern(pattern)
    except ValueError:
        return None


def _torchao_scheme(quant_type: Any, fqn: str) -> str | None:
    """torchao's per-module config for ``fqn`` (its repr, or :data:`SKIPPED`); None when the config is not per
    module. A ``re:`` key is full-matched against the parameter path, then the module path, as transformers
    does."""
    table = torchao_module_table(quant_type)
    if table is None:
        return None
    if fqn in table:
        chosen = table[fqn]
    else:
        matches = [table[key] for key in table if key.startswith(TORCHAO_PATTERN_PREFIX)
                   and _fullmatches(key[len(TORCHAO_PATTERN_PREFIX):], (f"{fqn}.weight", fqn))]
        chosen = matches[0] if matches else table.get(TORCHAO_DEFAULT)
    return SKIPPED if chosen is None else repr(chosen)


def _fullmatches(pattern: str, paths: Sequence[str]) -> bool:
    compiled = _compiled(pattern)
    return compiled is not None and any(compiled.fullmatch(path) is not None for path in paths)


def part_schemes(quantization: Any, fqns: Sequence[str]) -> list[str]:
    """How the load quantizes each module of ``fqns``: :data:`SKIPPED`, or a description of its scheme (equal
    descriptions mean the same scheme)."""
    patterns = _skip_list(quantization)
    quant_type = config_field(quantization, "quant_type")
    schemes = []
    for fqn in fqns:
        if skipped(fqn, patterns):
            schemes.append(SKIPPED)
            continue
        schemes.append(_torchao_scheme(quant_type, fqn) or "quantized")
    return schemes
