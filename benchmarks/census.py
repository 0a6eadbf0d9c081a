"""Census: what fusion-core does to every model type of transformers' model zoo, on tiny random models.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``--image-text`` adds
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``; ``--encoders`` adds ``MODEL_FOR_MASKED_LM_MAPPING_NAMES``
and the ``MODEL_MAPPING_NAMES`` types no other mapping covers) the census

1. builds a tiny random model from the real config class: the class's defaults, shrunk generically
   (every attribute of :data:`SHRINK` that the config or one of its sub-configs has is set; special
   token ids are moved inside the small vocabulary), and saves it with ``save_pretrained``;
2. loads it plain and fused (every installed family of :data:`FAMILIES`, ``required=False``) and
   runs both on the same random inputs (:func:`fusion_core.compare.model_inputs`);
3. saves the fused model with ``fusion_core.save_pretrained``, compares it byte for byte with the
   source checkpoint, and reloads that save plainly (its outputs must match the plain model's too).

``--cast`` saves each checkpoint in bf16 and loads it as float32 on both sides (every tensor cast; the
merged parts by the merge, :mod:`fusion_core.casting`); the fused save is then compared with plain's save.

``--training`` checks the training-time family instead (``linear_cross_entropy``, ``required=False``, on the
causal-LM types): one training step in float32 with labels (a third of them ``-100``), the loss and every
parameter's gradient of the fused model against plain's (loss within 1e-5 relative, each gradient within
1e-5 relative L2), then the logits without labels (bit for bit). A type the family declines at plan time
is ``declined``, with its reason. A gradient that is zero or tiny in exact arithmetic (a key projection's
bias: softmax ignores a shift of a query's scores; a router that gets no gradient through its top-k) is
float32 rounding noise on both sides, which any change of summation order reshuffles (the chunked loss sums
the hidden states' gradient chunk by chunk). Such a gradient passes when it differs from plain's by less than
:data:`ROUNDING_FLOOR` of the whole model's gradient norm; beyond that, the step is run once more on a float64
copy of the plain model, and the fused gradient passes if it is as close to that exact gradient as plain's
float32 one is (:data:`ROUNDING_FACTOR` times plain's distance, or 1e-5 of the exact gradient's norm).

Each row gets one outcome:

- ``fused-exact``: something was fused, outputs within ``TOLERANCES[float32]``, the save identical;
- ``nothing-to-fuse``: the plan is empty (and the outputs and the save still match);
- ``refused``: fusion-core raised a :class:`fusion_core.FusionError` naming the problem;
- ``SILENT``: outputs or saved bytes differ without an error: the worst outcome;
- ``CRASH``: any other exception on the fused path while the plain model works;
- ``plain-fails``: no tiny model could be built, or plain transformers fails on it or reloads its save with weights
  missing (not counted);
- with ``--training``: ``training-exact`` (loss and gradients equal) and ``declined`` (the family's reason).

Why: the unit tests cover hand-picked architectures; the census shows, in a few minutes, how the
families fare on everything else transformers ships, and finds silent mismatches early.

Run it (``nice`` it on a shared machine)::

    .venvs/tf5/bin/python benchmarks/census.py [--image-text] [--encoders] [--only llama qwen3_moe] [--json out.json]
    .venvs/tf5/bin/python benchmarks/census.py --kernels-win   # linear_kernels packs and switches kernels everywhere
    .venvs/tf5/bin/python benchmarks/census.py --cast          # bf16 checkpoints loaded as float32
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import json
import logging
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import fusion_core
from fusion_core.compare import TOLERANCES, compare_checkpoints, compare_outputs, model_inputs, relative_l2

#: Attribute -> tiny value, set wherever the config (or a sub-config) has the attribute.
SHRINK: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "out_hidden_size"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim"), 128),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "depth", "decoder_layers",
                     "encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), 2),
    "head_dim": 16,
    "vocab_size": 256,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "v_head_dim": 16,
    "rotary_dim": 8,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")
#: The most parameters a tiny model may have (the largest shrunk ones have a few million).
MAX_PARAMETERS = 50_000_000
#: Attributes only shrunk when the default is an int (None means "feature off": keep it off).
ONLY_IF_SET = ("q_lora_rank", "n_inner", "num_kv_heads", "head_dim")
#: Families the census asks for when installed, each with ``required=False``.
FAMILIES = ("qkv", "gate_up", "patch_embeddings", "moe_experts", "linear_kernels")
TOLERANCE = TOLERANCES[torch.float32]


@dataclass
class Row:
    model_type: str
    auto_class: str
    outcome: str = "plain-fails"
    families: str = ""
    max_rel_diff: float | None = None
    note: str = ""


# -- tiny models -------------------------------------------------------------------------------
def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    from transformers import PretrainedConfig

    return [(name, value) for name, value in vars(config).items() if isinstance(value, PretrainedConfig)]


def _shrink_values(config: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, size in SHRINK.items():
        current = getattr(config, name, None) if hasattr(config, name) else None
        if not hasattr(config, name) or (current is None and name in ONLY_IF_SET):
            continue
        if isinstance(current, (int, type(None))) and not isinstance(current, bool):
            values[name] = size
    if "head_dim" in values and config.head_dim != _conventional_head_dim(config):
        del values["head_dim"]  # derived from something else (DeepSeek: qk_rope_head_dim), or deliberate
    layers = next((getattr(config, n) for n in LAYER_COUNTS if isinstance(getattr(config, n, None), int)), None)
    for name, value in vars(config).items():  # per-layer lists (layer_types, attention_layers): first layers
        if layers and name not in values and isinstance(value, list) and len(value) == layers:
            values[name] = value[: SHRINK["num_hidden_layers"]]
    return values


def _conventional_head_dim(config: Any) -> int | None:
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _shrink(config: Any, vocab: int, constructed: bool) -> None:
    """Set the :data:`SHRINK` attributes (unless ``__init__`` took them already, deriving what depends
    on them, such as a ``head_dim`` that follows ``qk_rope_head_dim``), then fix per-layer lists."""
    for name, value in ({} if constructed else _shrink_values(config)).items():
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            setattr(config, name, value)
    layers = next((getattr(config, n) for n in LAYER_COUNTS if isinstance(getattr(config, n, None), int)), None)
    for name, value in list(vars(config).items()):
        if layers and name.endswith("layer_types") and isinstance(value, list) and len(value) > layers:
            setattr(config, name, value[:layers])
    _move_token_ids(config, vocab)
    for _, sub in _sub_configs(config):
        _shrink(sub, vocab, constructed)


def _move_token_ids(config: Any, vocab: int) -> None:
    """Special token ids beyond the small vocabulary are moved to its top (distinct ids, still special)."""
    spare = iter(range(vocab - 1, vocab // 2, -1))
    for name, value in list(vars(config).items()):
        if not (name.endswith("token_id") or name.endswith("token_index") or name.endswith("token_ids")):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            setattr(config, name, next(spare))
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            setattr(config, name, [next(spare) if isinstance(v, int) and v >= vocab else v for v in value])


def _tiny_kwargs(config: Any) -> dict[str, Any]:
    """The shrunk values of ``config`` and, as dicts, of its sub-configs at any depth (a vision tower's own encoder
    config inside its vision config: DeepSeek-OCR 2), for its ``__init__``."""
    kwargs = _shrink_values(config)
    for name, sub in _sub_configs(config):
        kwargs[name] = {**sub.to_dict(), **_tiny_kwargs(sub)}
    return kwargs


def tiny_config(model_type: str) -> Any:
    """The config class's defaults, shrunk: first through its ``__init__`` (so derived values follow)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls()
    kwargs = _tiny_kwargs(defaults)
    try:
        config, constructed = config_cls(**kwargs), True
    except Exception:  # an __init__ that rejects some combination: shrink the defaults in place
        config, constructed = defaults, False
    _shrink(config, SHRINK["vocab_size"], constructed)
    return config


def build_checkpoint(auto_cls: Any, model_type: str, target: Path, dtype: torch.dtype | None = None) -> None:
    config = tiny_config(model_type)
    refuse_large(auto_cls, config)
    torch.manual_seed(0)
    model = auto_cls.from_config(config)
    (model if dtype is None else model.to(dtype)).save_pretrained(target)


def refuse_large(auto_cls: Any, config: Any) -> None:
    """Raise ValueError when the model ``config`` makes has more than :data:`MAX_PARAMETERS` parameters, counted on
    the meta device: a part the shrinking did not reach (a new kind of sub-config) would otherwise be built at full
    size, and one model's gigabytes end the whole census. A model that cannot be built on meta is let through."""
    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in auto_cls.from_config(config).parameters())
    except Exception:
        return
    if count > MAX_PARAMETERS:
        raise ValueError(f"the tiny model would have {count / 1e6:.0f}M parameters (the census builds at most "
                         f"{MAX_PARAMETERS / 1e6:.0f}M): a part of the config the census does not shrink")


# -- one model ---------------------------------------------------------------------------------
def load_plain(auto_cls: Any, source: Path, **kwargs: Any) -> Any:
    """The plain model of ``source``; ValueError when plain transformers reloads its own save with weights missing (it
    initialises them anew: ShieldGemma 2 on 5.19-5.25 misses every one), so there is nothing a fused load must match."""
    model, info = auto_cls.from_pretrained(source, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(f"plain transformers reloads its own save with {len(missing)} weights missing, e.g. "
                         f"{missing[:2]}")
    return model


def _run(model: Any, inputs: dict[str, torch.Tensor]) -> Any:
    """The model's eval-mode forward, with the random generator seeded: some forwards draw noise even in eval mode
    (ViT-MAE's patch masking, VITS's durations), and each run must draw the same."""
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    torch.manual_seed(0)
    with torch.no_grad():
        return model.eval()(**inputs, **extra)


def _inputs(model: Any) -> dict[str, torch.Tensor]:
    found = model_inputs(model, torch.Generator().manual_seed(0))
    if found is None:
        raise ValueError("no inputs the census can build for this model's forward")
    return found


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def _fused_families(model: Any) -> str:
    plan = fusion_core.get_fusion_plan(model)
    counts = Counter(module.family for module in plan.modules) if plan is not None else Counter()
    return ", ".join(f"{family}×{count}" for family, count in counts.items())


def census_one(model_type: str, auto_cls: Any, fusion_config: dict[str, Any], work: Path, cast: bool = False) -> Row:
    """One model type (see the module docs); ``cast``: a bf16 checkpoint, loaded as float32 by both sides."""
    row = Row(model_type, auto_cls.__name__)
    source, saved, reference = work / f"{model_type}-source", work / f"{model_type}-saved", work / "plain-saved"
    load = {"dtype": torch.float32} if cast else {}
    try:
        build_checkpoint(auto_cls, model_type, source, torch.bfloat16 if cast else None)
    except Exception as error:
        row.note = f"could not build a tiny model: {_message(error)}"
        return row
    try:
        plain = load_plain(auto_cls, source, **load)
        inputs = _inputs(plain)
        expected = _run(plain, inputs)
        if cast:  # what the fused save must equal: plain's save of its float32 model
            plain.save_pretrained(reference)
    except Exception as error:
        row.note = f"plain transformers fails: {_message(error)}"
        return row
    stage = "fused load"
    try:
        fused = fusion_core.from_pretrained(auto_cls, source, fusion_config=fusion_config, **load)
        row.families = _fused_families(fused)
        stage = "fused forward"
        _, row.max_rel_diff = compare_outputs(expected, _run(fused, inputs))
        stage = "fused save"
        fusion_core.save_pretrained(fused, saved)
        trip = compare_checkpoints(reference if cast else source, saved)
        stage = "plain reload of the fused save"
        _, reload_diff = compare_outputs(expected, _run(auto_cls.from_pretrained(saved, **load), inputs))
    except fusion_core.FusionError as error:
        row.outcome, row.note = "refused", f"{stage}: {_message(error)}"
        return row
    except AssertionError as error:  # compare_outputs: different output structure
        row.outcome, row.note = "SILENT", f"{stage}: {_message(error)}"
        return row
    except Exception as error:
        row.outcome, row.note = "CRASH", f"{stage}: {_message(error)}"
        return row
    problems = [] if row.max_rel_diff <= TOLERANCE else [f"outputs differ ({row.max_rel_diff:.2e} > {TOLERANCE})"]
    problems += [] if trip.ok else [f"save differs: {'; '.join(trip.problems[:3])}"]
    problems += [] if reload_diff <= TOLERANCE else [f"reloaded save differs ({reload_diff:.2e})"]
    if problems:
        row.outcome, row.note = "SILENT", "; ".join(problems)
    else:
        row.outcome = "fused-exact" if row.families else "nothing-to-fuse"
    return row


# -- one model, training ------------------------------------------------------------------------
TRAINING_FAMILY = "linear_cross_entropy"
TRAINING_BOUND = 1e-5
ROUNDING_FLOOR = 1e-7
"""A gradient that misses the relative bound by less than this fraction of the whole model's gradient norm (float32
resolves about 6e-8 of a value) is rounding noise without a float64 step."""
ROUNDING_FACTOR = 4.0
"""Beyond the floor: how much farther from the float64 gradient than plain's float32 one a fused float32 gradient
may lie. Two roundings of one computation in another order land at comparable distances (AMD EPYC, 5.25.0:
fused/plain distance 0.9-2.3 on the tensors that miss the relative bound: key biases, routers, small gates; up to 17
on 4.57.6's DBRX router, 1.4e-8 against a whole gradient of norm 5, which the floor passes)."""


def _training_step(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward in training mode with labels: the loss and every parameter's gradient.

    A forward without gradients runs first: a model may change itself in its first call (BigBird leaves
    block-sparse attention for full attention on a short input), and the step measures the model after it."""
    labels = inputs["input_ids"].clone()
    labels[:, : labels.shape[1] // 3] = -100
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    model.train()
    with torch.no_grad():
        model(**inputs, labels=labels, **extra)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks on both sides
    loss = model(**inputs, labels=labels, **extra).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def census_training_one(model_type: str, auto_cls: Any, work: Path) -> Row:
    """The training-time family on one causal-LM type (see the module docs)."""
    row = Row(model_type, auto_cls.__name__)
    source = work / f"{model_type}-source"
    try:
        build_checkpoint(auto_cls, model_type, source)
    except Exception as error:
        row.note = f"could not build a tiny model: {_message(error)}"
        return row
    try:
        plain = load_plain(auto_cls, source)
        inputs = {k: v for k, v in _inputs(plain).items() if k in ("input_ids", "attention_mask")}
        expected_loss, expected_grads = _training_step(plain, inputs)
        expected_logits = _run(plain, inputs).logits
    except Exception as error:
        row.note = f"plain transformers fails: {_message(error)}"
        return row
    stage = "fused load"
    try:
        fused = fusion_core.from_pretrained(auto_cls, source, fusion_config={TRAINING_FAMILY: {"required": False}})
        plan = fusion_core.get_fusion_plan(fused)
        if plan is None or TRAINING_FAMILY not in plan.families:
            reasons = [reason for family, _, reason in (plan.refused if plan else ()) if family == TRAINING_FAMILY]
            row.outcome, row.note = "declined", reasons[0] if reasons else "nothing the family recognises"
            return row
        row.families = _fused_families(fused)
        stage = "fused training step"
        loss, grads = _training_step(fused, inputs)
        stage = "fused forward without labels"
        logits = _run(fused, inputs).logits
    except fusion_core.FusionError as error:
        row.outcome, row.note = "refused", f"{stage}: {_message(error)}"
        return row
    except Exception as error:
        row.outcome, row.note = "CRASH", f"{stage}: {_message(error)}"
        return row
    row.max_rel_diff = abs(loss - expected_loss) / max(abs(expected_loss), 1e-12)
    problems = [] if row.max_rel_diff <= TRAINING_BOUND else [f"loss {loss:.6g} vs plain {expected_loss:.6g}"]
    if sorted(grads) != sorted(expected_grads):
        problems.append(f"gradients of other parameters: {sorted(set(grads) ^ set(expected_grads))[:3]}")
    problems += gradient_problems(plain, inputs, expected_loss, expected_grads, grads)
    if not torch.equal(logits, expected_logits):
        problems.append("logits without labels differ from plain's")
    row.outcome, row.note = ("SILENT", "; ".join(problems)) if problems else ("training-exact", "")
    return row


def gradient_problems(plain: Any, inputs: dict[str, torch.Tensor], expected_loss: float,
                      expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """The worst fused gradient in ``got`` that is not plain's in ``expected`` up to float32 rounding, or nothing.

    A gradient passes within the relative bound, or below :data:`ROUNDING_FLOOR` of the whole gradient's norm;
    what is left is judged against a float64 step (:func:`_beyond_rounding`)."""
    whole = float(torch.cat([g.double().flatten() for g in expected.values()]).norm())
    missed = [name for name, grad in expected.items()
              if name in got and not relative_l2(grad, got[name]) <= TRAINING_BOUND
              and not float((got[name].double() - grad.double()).norm()) <= ROUNDING_FLOOR * whole]
    return _beyond_rounding(plain, inputs, expected_loss, expected, got, missed) if missed else []


def _beyond_rounding(plain: Any, inputs: dict[str, torch.Tensor], expected_loss: float,
                     expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], missed: list[str]) -> list[str]:
    """The gradients of ``missed`` that a float64 step shows are not rounding noise.

    ``expected_loss`` and ``expected`` are ``plain``'s float32 step. A model that builds a scalar without a dtype
    (XGLM's ``torch.full((), finfo(dtype).min)``) overflows float32 in float64: its step is run again with float64
    as torch's default dtype. Not every model's: that also changes what ``torch.rand([])`` draws (4.57's OPT draws
    its layer drop so), and with it the dropout masks that follow."""
    worst = max(missed, key=lambda name: relative_l2(expected[name], got[name]))
    verdict = f"gradient of {worst} differs by {relative_l2(expected[worst], got[worst]):.1e}"
    exact_model = copy.deepcopy(plain).double()
    if hasattr(exact_model, "set_experts_implementation") and getattr(exact_model.config, "_experts_implementation",
                                                                      None) not in (None, "eager"):
        exact_model.set_experts_implementation("eager")  # grouped_mm takes no float64
    try:
        try:
            exact_loss, exact = _training_step(exact_model, inputs)
        except RuntimeError:
            exact_loss, exact = _float64_by_default(_training_step, exact_model, inputs)
    except Exception as error:
        return [f"{verdict} (no float64 step to tell rounding apart: {_message(error)})"]
    if abs(exact_loss - expected_loss) > TRAINING_BOUND * abs(exact_loss):
        return [f"{verdict} (the float64 step is not the same computation: loss {exact_loss:.6g})"]
    problems = []
    for name in missed:
        reference = exact[name]
        plain_distance = float((expected[name].double() - reference).norm())
        fused_distance = float((got[name].double() - reference).norm())
        if fused_distance > max(ROUNDING_FACTOR * plain_distance, TRAINING_BOUND * float(reference.norm())):
            problems.append(f"gradient of {name} differs by {relative_l2(expected[name], got[name]):.1e}, "
                            f"{fused_distance:.2e} from float64's where plain's is {plain_distance:.2e}")
    return problems[:1]


def _float64_by_default(function: Any, *args: Any) -> Any:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return function(*args)
    finally:
        torch.set_default_dtype(default)


# -- the zoo -----------------------------------------------------------------------------------
def zoo(image_text: bool, encoders: bool) -> list[tuple[str, Any]]:
    """(model type, Auto class) for every type of the chosen mappings, each type once."""
    import transformers
    from transformers.models.auto import modeling_auto as names

    chosen: list[tuple[str, Any]] = [(t, transformers.AutoModelForCausalLM)
                                     for t in names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if image_text:
        chosen += [(t, transformers.AutoModelForImageTextToText)
                   for t in names.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES]
    if encoders:
        chosen += [(t, transformers.AutoModelForMaskedLM) for t in names.MODEL_FOR_MASKED_LM_MAPPING_NAMES]
        covered = {*names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *names.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                   *names.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
        chosen += [(t, transformers.AutoModel) for t in names.MODEL_MAPPING_NAMES if t not in covered]
    seen: set[str] = set()
    return [(t, cls) for t, cls in chosen if not (t in seen or seen.add(t))]  # type: ignore[func-returns-value]


def _fusion_config() -> dict[str, Any]:
    installed = set(fusion_core.get_registry().names())
    return {name: {"required": False} for name in FAMILIES if name in installed}


def _kernels_win() -> None:
    """Make every linear_kernels measurement report the alternative to the original fastest (see ``--kernels-win``);
    the faked decisions are neither read from nor written to the decision store."""
    import os

    from fusion_core.plugin import Decisions
    from fusion_core.testing.decisions import fake_clock, original_slowest

    os.environ["FUSION_CORE_DECISIONS"] = "off"
    # Every timer lists the original way first (packing: the dense weight); the merge policy keeps its clock.
    Decisions.times = fake_clock({"linear_kernels": original_slowest})  # type: ignore[method-assign]


def _print_table(rows: list[Row]) -> None:
    header = ("model type", "outcome", "families fused", "max rel diff", "note")
    cells = [(r.model_type, r.outcome, r.families or "-",
              "-" if r.max_rel_diff is None else f"{r.max_rel_diff:.1e}", r.note) for r in rows]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(4)]
    for line in [header, *cells]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line[:4], widths, strict=True)) + "  " + line[4])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--image-text", action="store_true", help="add MODEL_FOR_IMAGE_TEXT_TO_TEXT types")
    parser.add_argument("--encoders", action="store_true", help="add masked-LM and other base-model types")
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="run only these model types")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--quiet", action="store_true", help="no per-model progress on stderr")
    parser.add_argument("--kernels-win", action="store_true",
                        help="linear_kernels packs every weight it may and takes another kernel wherever one is "
                             "admitted (its timers report the alternatives fastest): tiny models then exercise what "
                             "real sizes choose")
    parser.add_argument("--cast", action="store_true",
                        help="save each tiny checkpoint in bf16 and load it as float32, plain and fused (the merges "
                             "cast the parts they build: fusion_core.casting); the fused save is compared with "
                             "plain's save of its float32 model")
    parser.add_argument("--training", action="store_true",
                        help=f"the training-time family ({TRAINING_FAMILY}) on the causal-LM types: loss and every "
                             "gradient of one training step against plain's, or the family's reason to decline")
    args = parser.parse_args(argv)
    if args.kernels_win:
        _kernels_win()
    import transformers

    transformers.logging.set_verbosity(logging.CRITICAL)
    transformers.logging.disable_progress_bar()
    logging.getLogger("fusion_core").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    chosen = zoo(args.image_text, args.encoders)
    if args.only:
        unknown = sorted(set(args.only) - {t for t, _ in chosen})
        if unknown:
            parser.error(f"not in the chosen mappings: {', '.join(unknown)}")
        chosen = [(t, cls) for t, cls in chosen if t in args.only]
    fusion_config = {TRAINING_FAMILY: {"required": False}} if args.training else _fusion_config()
    rows: list[Row] = []
    start = time.perf_counter()
    for model_type, auto_cls in chosen:
        if not args.quiet:
            print(f"[{len(rows) + 1}/{len(chosen)}] {model_type}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="fusion-census-") as tmp, \
                contextlib.redirect_stdout(io.StringIO()):  # models that print while building
            rows.append(census_training_one(model_type, auto_cls, Path(tmp)) if args.training else
                        census_one(model_type, auto_cls, fusion_config, Path(tmp), cast=args.cast))
    _print_table(rows)
    counts = Counter(row.outcome for row in rows)
    print(f"\ntransformers {transformers.__version__}, families {sorted(fusion_config)}, {len(rows)} model types "
          f"in {time.perf_counter() - start:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.json:
        args.json.write_text(json.dumps({"transformers": transformers.__version__, "fusion_config": fusion_config,
                                         "counts": dict(counts), "rows": [asdict(r) for r in rows]}, indent=1))
    return 1 if counts["SILENT"] or counts["CRASH"] else 0


if __name__ == "__main__":
    sys.exit(main())
