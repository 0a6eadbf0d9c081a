"""Which children of an attention module are its q/k/v projections, and whether they read one input.

Architectures name the three projections differently (``q_proj``/``k_proj``/``v_proj`` in Llama,
Whisper and BART, ``query``/``key``/``value`` in BERT, RoBERTa, XLM-R, ELECTRA, BigBird and
CamemBERT, ``q_lin``/``k_lin``/``v_lin`` in DistilBERT, ``q``/``k``/``v`` in T5), so no list of
names is kept: a triple is three ``nn.Linear`` children whose names differ only in the role word,
``q``/``k``/``v`` or ``query``/``key``/``value``, in the same place (``<prefix><role><suffix>``).

A triple is worth one merged GEMM only when the three are applied to the same tensor. That is a
property of the class's ``forward``, not of the instance, so it is read from the source of the
first ``forward`` in the class's MRO that calls the projections (:func:`fusion_core.plugin.forwards`):
the argument of every call is followed through plain aliases (``current = kv if kv is not None
else hidden_states``, ``a or b``, a name assigned in both branches of an ``if``), and the three
must share at least one possible input. Whisper's and BART's attention (``k_proj(current_states)``,
where ``current_states`` may be ``hidden_states``) pass, their cross-attention instances being
excluded by path; BERT's ``BertCrossAttention`` (``key(encoder_hidden_states)``) does not. The analysis never affects
exactness, which the merged slices guarantee for any input; it keeps modules that could never
share a GEMM unfused, with a reason.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from torch import nn

from fusion_core.plugin import MergedSlice, aliases, alternatives, calls, forwards

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
    for klass, _, tree in forwards(cls):
        found = calls(tree, names)
        if not any(found.values()):
            continue
        missing = [name for name in names if not found[name]]
        if missing:
            return f"{klass.__qualname__}.forward does not call {'/'.join(missing)}: q/k/v are not one attention input"
        assigned = aliases(tree)
        inputs = {name: set().union(*(alternatives(arg, assigned) for arg in args)) for name, args in found.items()}
        if set.intersection(*inputs.values()):
            return None
        shown = ", ".join(f"{name}({' | '.join(sorted(inputs[name]))})" for name in names)
        return f"{klass.__qualname__}.forward applies the projections to different inputs: {shown} (cross-attention)"
    return f"no forward of {cls.__qualname__} calls {'/'.join(names)} directly: cannot tell that they read one input"
