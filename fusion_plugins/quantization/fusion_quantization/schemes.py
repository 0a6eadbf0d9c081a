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
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

SKIPPED = "left unquantized"
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def config_field(quantization: Any, name: str) -> Any:
    """A field of a quantization config, whether the load passed the config object or the checkpoint stored a dict."""
    return quantization.get(name) if isinstance(quantization, dict) else getattr(quantization, name, None)


def _skip_list(quantization: Any) -> list[str]:
    names = config_field(quantization, "llm_int8_skip_modules") or []
    names = [*names, *(config_field(quantization, "modules_to_not_convert") or [])]
    return [str(name) for name in names]


def skipped(fqn: str, patterns: Sequence[str]) -> bool:
    """Whether any of transformers' matching rules skips module ``fqn`` for one of ``patterns``."""
    for key in patterns:
        if key in fqn or fqn.endswith(key):
            return True
        try:
            if re.match(rf"(?:{key}){_BOUNDARY}", fqn):
                return True
        except re.error:
            continue
    return False


def _torchao_scheme(quant_type: Any, fqn: str) -> str | None:
    """torchao's per-module config for ``fqn`` (its repr, or :data:`SKIPPED`); None when the config is not per
    module."""
    table = getattr(quant_type, "fqn_to_config", None) or getattr(quant_type, "module_fqn_to_config", None)
    if not isinstance(table, dict):
        return None
    if fqn in table:
        chosen = table[fqn]
    else:
        matches = [table[key] for key in table if key.startswith("re:")
                   and (re.fullmatch(key[3:], fqn) or re.fullmatch(key[3:], f"{fqn}.weight"))]
        chosen = matches[0] if matches else table.get("_default")
    return SKIPPED if chosen is None else repr(chosen)


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
