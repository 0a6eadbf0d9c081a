"""Every private name and version-dependent behaviour of transformers that fusion-core relies on.

Nothing else in ``fusion_core`` reaches a private transformers name or branches on its version:
when a release moves something, this module is the one place to change. Each entry says what it
needs, the releases it was checked on (:data:`CHECKED_RELEASES`, each in its own environment)
and what happens on a release where it is not found: a fallback, or a refusal that names the
release and one that works.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

SUPPORTED_RANGE = ">=4.57,<6"
"""The transformers releases fusion-core declares (``pyproject.toml``) and tests."""

CHECKED_RELEASES = (
    "4.57.6", "5.0.0", "5.2.0", "5.4.0", "5.8.1", "5.12.1", "5.16.1", "5.20.2", "5.22.2", "5.24.0", "5.25.0",
)
"""The releases the entries below were checked on, each in its own environment (CI: 4.57.6, 5.0.0, 5.8.1,
5.16.1, 5.22.2, 5.24.0, 5.25.0; the others by hand, 5.2.0 and 5.4.0 without tensor parallelism)."""


def installed_version() -> str | None:
    """The installed transformers' version, None when it is not installed; transformers is not imported.

    Read from the first ``transformers-<version>.dist-info`` folder on ``sys.path`` (what
    ``importlib.metadata`` finds first), because importing ``importlib.metadata`` costs ~45 ms and
    this runs at ``import fusion_core``; other layouts fall back to ``importlib.metadata``.
    """
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as entries:
                for item in entries:
                    if item.name.startswith("transformers-") and item.name.endswith(".dist-info"):
                        return item.name[len("transformers-"):-len(".dist-info")]
        except OSError:  # a zip or a missing folder on sys.path
            continue
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def release() -> tuple[int, int]:
    """(major, minor) of the installed transformers (transformers is not imported)."""
    return _major_minor(installed_version() or "0.0")


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"fusion-core cannot read the transformers version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_supported(version: str | None = None) -> None:
    """Raise ImportError, naming the range, when the installed transformers is outside it.

    Called when ``fusion_core`` is imported, so an unsupported release fails there with this
    message instead of deep inside a load.
    """
    if version is None:
        version = installed_version()
        if version is None:
            raise ImportError(f"fusion-core needs transformers{SUPPORTED_RANGE}; it is not installed")
    if not (4, 57) <= _major_minor(version) < (6, 0):
        raise ImportError(
            f"fusion-core supports transformers{SUPPORTED_RANGE}; transformers {version} is installed "
            f"(install a release in that range, e.g. `pip install 'transformers{SUPPORTED_RANGE}'`; "
            "docs/compatibility.md lists the releases tested)"
        )


# -- the loading report -------------------------------------------------------------------------
LOAD_METHOD = "_load_pretrained_model"
"""The ``PreTrainedModel`` method every ``from_pretrained`` calls to load the weights into the built model.

Checked on every release in :data:`CHECKED_RELEASES`. Its kind and its result differ per line:

- 4.57: a classmethod ``(cls, model, state_dict, ...)`` returning
  ``(model, missing, unexpected, mismatched, offload_index, error_msgs)``;
- 5.0: a classmethod ``(cls, model, state_dict, ...)`` returning a ``LoadStateDictInfo``;
- 5.1 and later: a staticmethod ``(model, state_dict, ...)`` returning ``(LoadStateDictInfo, offload_index)``.
"""


def raw_load_method() -> Any:
    """The ``classmethod``/``staticmethod`` object as stored on ``PreTrainedModel``."""
    from transformers import PreTrainedModel

    return PreTrainedModel.__dict__[LOAD_METHOD]


@contextmanager
def wrapped_load_method(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``PreTrainedModel._load_pretrained_model`` by ``wrap(function)`` for the block, of the same kind."""
    from transformers import PreTrainedModel

    raw = raw_load_method()
    setattr(PreTrainedModel, LOAD_METHOD, type(raw)(wrap(raw.__func__)))
    try:
        yield
    finally:
        setattr(PreTrainedModel, LOAD_METHOD, raw)


Report = Callable[[], dict[str, Any]]


def loading_report(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Report]:
    """(the model loaded, a function giving its report as ``output_loading_info=True`` does) from one
    call of the load method.

    Call the function once ``from_pretrained`` has returned: 5.x adjusts the report in place
    after this method (tied and ignored keys are no longer missing). The model is the first
    ``nn.Module`` instance among the call's arguments (``cls`` is a class, not an instance), so
    the classmethod and staticmethod forms read alike. Raises TypeError for a result of a shape
    no checked release returns.
    """
    from torch import nn

    model = next((a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)), None)
    if isinstance(result, tuple) and len(result) == 6 and isinstance(result[0], nn.Module):  # 4.57
        report = {"missing_keys": result[1], "unexpected_keys": result[2], "mismatched_keys": result[3],
                  "error_msgs": result[5]}
        return result[0], lambda: report
    info = result[0] if isinstance(result, tuple) and result else result  # 5.1+: (info, offload index); 5.0: info
    if callable(getattr(info, "to_dict", None)):  # 5.1 and later
        return model, info.to_dict
    import dataclasses

    if dataclasses.is_dataclass(info) and not isinstance(info, type):  # 5.0: a plain dataclass
        return model, lambda: {field.name: getattr(info, field.name) for field in dataclasses.fields(info)}
    raise TypeError(
        f"transformers {installed_version()}'s PreTrainedModel.{LOAD_METHOD} returned "
        f"{type(result).__name__}, which no release fusion-core was checked on returns "
        f"({', '.join(CHECKED_RELEASES)})"
    )


# -- tensor parallelism ---------------------------------------------------------------------------
def tensor_parallel_size(model: nn.Module) -> int:
    """How many ranks transformers sharded ``model`` over (1: not tensor parallel).

    ``PreTrainedModel._tp_size`` (set by 4.57.6, 5.0.0, 5.8.1, 5.22.2, 5.24.0; 5.16 and later also
    expose it as the ``tp_size`` property, read first); 5.16.1 leaves it None and keeps the size in
    ``config.distributed_config.tp_size``, read when neither is set.
    """
    size = getattr(type(model), "tp_size", None)
    value: Any = getattr(model, "tp_size" if isinstance(size, property) else "_tp_size", None)
    if not value:
        value = getattr(getattr(getattr(model, "config", None), "distributed_config", None), "tp_size", None)
    return int(value or 1)


_LAYER_NUMBER = re.compile(r"\.\d+(\.|$)")
_ANY_NUMBER = re.compile(r"\d+")


def plan_style(parameter: str, plan: dict[str, str]) -> str | None:
    """The style a tensor-parallel ``plan`` gives the parameter at path ``parameter``, or None.

    transformers' own rule (its private ``_get_parameter_tp_plan`` / ``_get_parameter_plan``,
    which moved module and name three times between 5.0 and 5.24), implemented here so that no
    release can lack it: numbers become ``*`` (4.57: every run of digits, ``w1`` -> ``w*``;
    5.x: only whole dotted components, the layer numbers), and an entry for the owning module
    covers its ``weight`` and ``bias``.
    """
    if release() < (5, 0):
        generic = _ANY_NUMBER.sub("*", parameter)
    else:
        generic = _LAYER_NUMBER.sub(lambda m: ".*" + m.group(1), parameter)
    if generic in plan:
        return plan[generic]
    if "." in generic and (module := generic.rsplit(".", 1)[0]) in plan:
        return plan[module]
    return None


def tensor_parallel_mesh(model: nn.Module) -> Any:
    """The device mesh transformers sharded ``model`` over (its ``tp`` dimension), or None.

    ``PreTrainedModel._device_mesh`` on every checked release. Needed where transformers loads
    each rank's shard as a plain local tensor (5.1-5.15; checked on 5.8.1), which carries no mesh.
    """
    mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None and mesh.ndim > 1 and "tp" in names:
        mesh = mesh["tp"]
    return mesh


# -- fused subclasses of a PreTrainedModel ------------------------------------------------------------
def fused_class_overrides(original_cls: type) -> dict[str, Any]:
    """Class attributes a fused subclass of ``original_cls`` needs to be treated as ``original_cls`` by transformers.

    5.x's ``get_model_conversion_mapping`` skips every ``PreTrainedModel`` whose class is "custom code"
    (``is_custom_code``: a ``__module__`` outside ``transformers.``, checked on 5.0-5.25): a fused root class
    (``fusion_core.spec``'s, for pickling) would then load and save a checkpoint without the key renames its
    original class has (Qwen2-VL's ``model.`` -> ``model.language_model.``). The fused class answers as its
    original does. 4.57 has no such method: nothing to override.
    """
    custom = getattr(original_cls, "is_custom_code", None)
    if custom is None:
        return {}
    return {"is_custom_code": classmethod(lambda cls: custom())}


# -- 5.x experts modules -------------------------------------------------------------------------
def experts_implementation(config: Any) -> str | None:
    """The experts implementation a 5.x config selects (``config._experts_implementation``: ``"eager"``,
    ``"batched_mm"``, ``"grouped_mm"``, ...; every checked 5.x release), or None (4.57, or not an experts model)."""
    value = getattr(config, "_experts_implementation", None)
    return value if isinstance(value, str) else None


def is_expert_parallel(experts: nn.Module) -> bool:
    """Whether a 5.x experts module holds only this rank's experts under expert parallelism
    (``_is_expert_parallel``, set by 5.x's distributed loading; False where absent)."""
    return bool(getattr(experts, "_is_expert_parallel", False))


def apply_gate(experts: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A gated 5.x experts module's activation of its gate/up rows (its ``_apply_gate``: ``act(gate) * up``,
    with each model's own split and activation; every checked 5.x release)."""
    apply: Callable[[torch.Tensor], torch.Tensor] = getattr(experts, "_apply_gate")  # noqa: B009 (a module's method)
    return apply(hidden)


# -- building a model from a config --------------------------------------------------------------
def build_from_config(model_cls: Any, config: Any, **kwargs: Any) -> Any:
    """A randomly initialised model of ``model_cls`` for ``config``, the way ``from_pretrained`` would build it.

    Auto classes have the public ``from_config``; a concrete ``PreTrainedModel`` class has only
    the private ``_from_config`` (every checked release), which applies ``dtype`` and the
    attention implementation as ``from_pretrained`` does, where ``cls(config)`` would not.
    """
    builder = getattr(model_cls, "from_config", None) or model_cls._from_config
    return builder(config, **kwargs)


# -- from_pretrained's keyword arguments: the model's and the config's -----------------------------
MODEL_LOAD_KWARGS = frozenset({
    # named parameters of PreTrainedModel.from_pretrained
    "config", "cache_dir", "ignore_mismatched_sizes", "force_download", "local_files_only", "token", "revision",
    "use_safetensors", "weights_only", "fusion_config", "disable_mmap",
    # popped from its **kwargs before it loads the config
    "state_dict", "proxies", "tqdm_class", "output_loading_info", "use_auth_token", "_from_pipeline", "_from_auto",
    "dtype", "torch_dtype", "device_map", "max_memory", "offload_folder", "offload_buffers", "load_in_8bit",
    "load_in_4bit", "quantization_config", "subfolder", "_commit_hash", "variant", "adapter_kwargs", "adapter_name",
    "generation_config", "gguf_file", "distributed_config", "device_mesh", "tp_plan", "tp_size", "trust_remote_code",
    "allow_all_kernels", "use_kernels", "kernel_config", "key_mapping", "resume_download", "mirror", "_fast_init",
    "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict", "kernels_mode",
})
"""The keyword arguments a model class's ``from_pretrained`` reads itself: every other one is first offered to
its config class as an attribute override. The union over 4.57.6, 5.0.0, 5.8.1, 5.16.1, 5.22.2, 5.24.0 and 5.25.0
(``tests/test_compat.py`` checks the installed release against it); a name one release lacks is one no config has."""

AUTO_LOAD_KWARGS = frozenset({
    "config", "cache_dir", "force_download", "local_files_only", "proxies", "resume_download", "revision",
    "subfolder", "use_auth_token", "token", "code_revision", "_commit_hash", "adapter_kwargs", "trust_remote_code",
    "_from_auto",
})
"""The keyword arguments an Auto class's ``from_pretrained`` takes out (or hands ``AutoConfig`` as hub arguments)
before offering the rest to ``AutoConfig.from_pretrained`` as overrides, on the same releases."""

_AUTO_PASSED_ON = ("dtype", "torch_dtype")


def config_overrides(kwargs: Mapping[str, Any], auto: bool) -> tuple[dict[str, Any], frozenset[str]]:
    """(overrides, passed on): how transformers splits a ``from_pretrained(path, **kwargs)`` that loads its config.

    The overrides are what it offers the config's ``from_pretrained(..., return_unused_kwargs=True)``;
    each the config takes as an attribute is gone from the model's arguments, except the names
    "passed on", which reach the model's ``from_pretrained`` as well. A model class offers every
    argument not in :data:`MODEL_LOAD_KWARGS`. An Auto class (``auto``) offers more: everything but
    :data:`AUTO_LOAD_KWARGS`, ``quantization_config`` and an ``"auto"`` dtype; a concrete ``dtype``
    (or ``torch_dtype``) sets the config's and still reaches the model class, as on 4.57.6 and
    5.16.1 and later (5.0.0 and 5.8.1 left it on the config alone, which loads the same dtype).
    """
    if not auto:
        return {k: v for k, v in kwargs.items() if k not in MODEL_LOAD_KWARGS}, frozenset()
    overrides = {k: v for k, v in kwargs.items() if k not in AUTO_LOAD_KWARGS}
    for name in _AUTO_PASSED_ON:
        if isinstance(overrides.get(name), str) and overrides[name] == "auto":
            del overrides[name]
    if overrides.get("quantization_config") is not None:  # the checkpoint's own must not be replaced
        del overrides["quantization_config"]
    return overrides, frozenset(_AUTO_PASSED_ON).intersection(overrides)


# -- checkpoint key names -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class LoadedNames:
    """How transformers names, in one model, each checkpoint key it loads: its own renaming rules, captured once.

    A checkpoint key is matched to a model key only by the rule transformers applies when it
    loads (never by a shared suffix: two towers of one model both have ``layers.0.self_attn``).
    Captured from the (meta-device) model by :func:`loaded_names`; :meth:`rename` applies it to a
    checkpoint's keys. The rules per line, each mirroring transformers' own loading code:

    - 4.57 (``PreTrainedModel._load_pretrained_model`` and ``_get_key_renaming_mapping``): the
      class's ``_fix_state_dict_key_on_load`` (``LayerNorm.gamma`` -> ``LayerNorm.weight``, ...),
      then the first matching regex of ``key_mapping`` (by default the class's
      ``_checkpoint_conversion_mapping``, for the classes transformers' ``VLMS`` names), then the
      base-model prefix added or stripped when the checkpoint is a base (or task) model's;
    - 5.x (``core_model_loading.convert_and_load_state_dict_in_model``): the model's weight
      conversions (``conversion_mapping.get_model_conversion_mapping``, sub-models scoped to their
      prefix) through ``rename_source_key``, with the base-model prefix added or stripped per key.
      A key a ``WeightConverter`` merges or splits is not loaded one to one and is left out.
    """

    model_keys: frozenset[str]
    base_model_prefix: str
    expects_prefix_module: bool
    fix_key: Callable[[str], tuple[str, bool]] | None
    class_key_mapping: dict[str, str] | None
    conversions: tuple[Any, ...]

    def rename(self, checkpoint_keys: Iterable[str], key_mapping: Mapping[str, str] | None = None) -> dict[str, str]:
        """Checkpoint key -> the model key transformers loads it into, for every key it renames one to one.

        A key the model has no tensor for is renamed all the same (transformers reports it as unexpected).

        ``key_mapping`` is ``from_pretrained``'s argument of that name (a regex -> replacement mapping).
        """
        if release() < (5, 0):
            return self._rename_4(list(checkpoint_keys), key_mapping)
        return self._rename_5(checkpoint_keys, key_mapping)

    def _rename_4(self, keys: list[str], key_mapping: Mapping[str, str] | None) -> dict[str, str]:
        prefix = self.base_model_prefix
        has_prefix_module = bool(prefix) and any(key.startswith(prefix) for key in keys)
        task_from_base = not has_prefix_module and self.expects_prefix_module
        base_from_task = has_prefix_module and not self.expects_prefix_module
        mapping = key_mapping if key_mapping is not None else self.class_key_mapping
        renamed: dict[str, str] = {}
        for key in keys:
            new = self.fix_key(key)[0] if self.fix_key is not None else key
            for pattern, replacement in (mapping or {}).items():
                new, count = re.subn(pattern, replacement, new)
                if count:
                    break
            if task_from_base:
                new = f"{prefix}.{new}"
            elif base_from_task:
                if not new.startswith(f"{prefix}."):
                    continue
                new = new[len(prefix) + 1:]
            renamed[key] = new
        return renamed

    def _rename_5(self, keys: Iterable[str], key_mapping: Mapping[str, str] | None) -> dict[str, str]:
        try:
            from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        except ImportError:  # a 5.x release without the conversion machinery: names as they are
            return {key: key for key in keys}
        conversions = [WeightRenaming(source_patterns=k, target_patterns=v) for k, v in (key_mapping or {}).items()]
        conversions += self.conversions
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        meta = dict.fromkeys(self.model_keys, True)
        prefix = self.base_model_prefix
        renamed: dict[str, str] = {}
        for key in keys:
            new, converted = rename_source_key(key, renamings, converters, prefix, meta)
            if new not in meta and key in meta:  # as transformers: a key that should not have been renamed
                new, converted = rename_source_key(key, [], [], prefix, meta)
            if converted is None:
                renamed[key] = new
        return renamed


def loaded_names(model: nn.Module) -> LoadedNames:
    """The renaming rules transformers applies to a checkpoint loaded into ``model`` (see :class:`LoadedNames`).

    Call it on the model as built, before any module is fused: the model keys are its state-dict
    keys. A model that is not a ``PreTrainedModel`` gets its keys matched as they are.
    """
    from transformers import PreTrainedModel

    keys = frozenset(model.state_dict(keep_vars=True))
    if not isinstance(model, PreTrainedModel):
        return LoadedNames(keys, "", False, None, None, ())
    prefix = str(model.base_model_prefix or "")
    expects = bool(prefix) and hasattr(model, prefix)
    if release() < (5, 0):
        from transformers.modeling_utils import VLMS

        cls = type(model)
        vlm = any(name in c.__name__.lower() for c in cls.__mro__[:-1] for name in VLMS)
        mapping = dict(getattr(cls, "_checkpoint_conversion_mapping", None) or {}) if vlm else None
        return LoadedNames(keys, prefix, expects, cls._fix_state_dict_key_on_load, mapping, ())
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return LoadedNames(keys, prefix, expects, None, None, ())
    return LoadedNames(keys, prefix, expects, None, None, tuple(get_model_conversion_mapping(model)))
