"""The protocol a fusion family implements, its options base, and a convenient base class.

A family answers four questions, each a method here: which modules may it fuse
(:meth:`ModuleFusionSpec.is_fusable`, pre-filtered by ``target_modules_patterns``), what runs
instead (:meth:`~ModuleFusionSpec.make_fused_class`), and how checkpoint tensors move between
the original and the fused layout (:meth:`~ModuleFusionSpec.make_transforms`). Options are a
pydantic model of the family's own, validated by :class:`fusion_core.FusionConfig` and handed
to every method.

**The fused class contract.** ``make_fused_class(original_cls, options)`` returns a *subclass*
of ``original_cls`` that does not override ``__init__``. fusion-core builds each selected
instance with the original ``__init__`` (so any checkpoint loader fills it in the original
layout), switches its class, applies the family's transforms to its tensors, and then calls
``fusion_finalize()`` (see :class:`FusedModule`) so the instance can set up whatever its fused
``forward`` needs. The forward must compute what the original computed.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from fusion_core.compat.transformers import fused_class_overrides
from fusion_core.patterns import compile_pattern
from fusion_core.transforms import DISPLAY_NAME_ATTRIBUTE, WeightTransform

if TYPE_CHECKING:  # transformers is imported by the pipeline, not by the protocol
    import torch
    from transformers import PretrainedConfig

    from fusion_core.parallel.rules import TensorParallelRule

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
"""One example call of a module: ``(args, kwargs)``."""


class FamilyOptions(BaseModel):
    """Options every family accepts; a family subclasses this to add its own.

    ``target_modules`` and ``exclude_modules`` are regular expressions searched in module paths
    (``model.visual.patch_embed.proj``), the way PEFT scopes adapters: a module is considered only
    when it matches one of ``target_modules`` (when given) and none of ``exclude_modules``. They
    run on RE2, in time linear in the path (see :mod:`fusion_core.patterns`).

    ``required`` (default True) makes a family that finds nothing to fuse in a model an error,
    the way PEFT treats ``target_modules`` that match nothing; ``required=False`` skips the
    family for that model instead, with a warning, so one ``fusion_config`` serves many models.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_modules: tuple[str, ...] | None = Field(
        default=None, description="Regexes; only module paths matching one of them are considered."
    )
    exclude_modules: tuple[str, ...] = Field(
        default=(), description="Regexes; module paths matching any of them are left alone."
    )
    required: bool = Field(
        default=True,
        description="False: a model in which the family finds nothing to fuse loads without it (a warning), "
        "instead of raising DiscoveryError.",
    )

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _patterns_compile(cls, patterns: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """A bad regex is a config error here, not an error from deep inside discovery."""
        for pattern in patterns or ():
            compile_pattern(pattern)
        return patterns


OptionsT = TypeVar("OptionsT", bound=FamilyOptions)


class ModuleFusionSpec(Protocol[OptionsT]):
    """The family contract: what the registry checks a registered family against.

    Generic in the family's options model: every method receives an instance of
    ``options_model`` (``ModuleFusionSpec[QkvOptions]``; ``ModuleFusionSpec[Any]`` for any family).

    The first four attributes and three methods are required. The members after them are
    optional: a spec that leaves one out gets the default written here (read it with
    :func:`spec_member`); :class:`FusionFamily` carries the same defaults.
    """

    name: str
    description: str
    options_model: type[OptionsT]
    target_modules_patterns: Sequence[str]

    def is_fusable(self, module: nn.Module, options: OptionsT) -> bool:
        """Can this (meta-device) module instance be replaced by the fused class exactly?"""
        ...

    def make_fused_class(self, original_cls: type[nn.Module], options: OptionsT) -> type[nn.Module]:
        """The runtime replacement class: a subclass of ``original_cls`` (see the module docs)."""
        ...

    def make_transforms(self, config: PretrainedConfig, options: OptionsT) -> Sequence[WeightTransform]:
        """Module-relative weight transforms from the original layout to the fused layout."""
        ...

    # -- optional members (defaults in OPTIONAL_MEMBERS) -------------------------------------
    tensor_parallel: TensorParallelRule | None
    """How the fused tensors shard under a tensor-parallel plan (:mod:`fusion_core.parallel.rules`);
    None (the default): the fused module runs unsharded, and a plan sharding it is refused."""

    preserves: str
    """What the fused forward preserves: ``"outputs"`` (the default), every output the original computed,
    in every mode; or ``"training_loss"``, for a training-time fusion at the model's root that never builds
    what it need not (``linear_cross_entropy``: the logits): in training mode, called with labels, the loss
    and every gradient equal the original's and the other outputs may be None; in every other call the fused
    forward is the original's. The conformance kit checks the declaration (:data:`PRESERVES`)."""

    owns_submodules: bool
    """True for a family that fuses a module whole, owning every tensor beneath it: another family's
    plan for a module inside one it fuses is then left to it (:attr:`fusion_core.FusionPlan.nested`)
    instead of being a conflict. Default False."""

    def refusal(self, module: nn.Module, options: OptionsT) -> str | None:
        """Why ``is_fusable`` declined this module instance, in one sentence; None: nothing to say.

        Asked only for modules the name patterns selected and ``is_fusable`` declined. The reasons
        are listed by ``fusion plan`` (:attr:`fusion_core.FusionPlan.refused`) and quoted in the
        "found nothing to fuse" error, so a user learns why a block that looks fusable was left
        alone (a changed forward, a bias, stacked weights already). Return None for modules that
        are not candidates at all (most of a model, for a family with broad patterns). Default: None.
        """
        ...

    def module_transforms(
        self, module: nn.Module, config: PretrainedConfig, options: OptionsT
    ) -> Sequence[WeightTransform] | None:
        """The transforms of one module ``is_fusable`` accepted, when they depend on the instance; None: the
        family's :meth:`make_transforms`.

        For a family whose modules name or shape their tensors differently from instance to instance
        (``qkv``: ``query``/``key``/``value`` in BERT, a bias on ``q_proj`` and ``v_proj`` but not
        ``k_proj`` in Whisper), where one family-wide list would have to hold every variant and
        every variant's sources would be partly present on most modules. Called on meta-device
        instances, once per fused module. Default: None.
        """
        ...

    def sample_inputs(self, module: nn.Module, generator: torch.Generator) -> list[Inputs]:
        """Example ``(args, kwargs)`` calls of the *original* ``module`` for ``fusion check`` and the kit.

        They feed fused modules what the whole-model run gave them and, for standard torch layers,
        random inputs of the right shape; a module neither reaches (an MoE block, a custom
        attention) is reported "no input" unless its family returns calls here (plain device and
        dtype: use ``module``'s parameters; randomness from ``generator``). Default: ``[]``.
        """
        ...


REQUIRED_MEMBERS = ("name", "description", "options_model", "target_modules_patterns", "is_fusable",
                    "make_fused_class", "make_transforms")
"""The members every spec must have."""


def _no_sample_inputs(module: nn.Module, generator: torch.Generator) -> list[Inputs]:
    return []


def _no_refusal(module: nn.Module, options: Any) -> str | None:
    return None


def _no_module_transforms(module: nn.Module, config: Any, options: Any) -> Sequence[WeightTransform] | None:
    return None


PRESERVES = ("outputs", "training_loss")
"""The values :attr:`ModuleFusionSpec.preserves` may take."""

OPTIONAL_MEMBERS: dict[str, Any] = {
    "tensor_parallel": None,
    "preserves": "outputs",
    "owns_submodules": False,
    "sample_inputs": _no_sample_inputs,
    "refusal": _no_refusal,
    "module_transforms": _no_module_transforms,
}
"""Each optional member of :class:`ModuleFusionSpec` and the value a spec without it gets."""


def spec_member(spec: object, name: str) -> Any:
    """The optional member ``name`` of ``spec``, or its default from :data:`OPTIONAL_MEMBERS`."""
    if name not in OPTIONAL_MEMBERS:
        raise KeyError(f"{name!r} is not an optional member of ModuleFusionSpec ({', '.join(OPTIONAL_MEMBERS)})")
    return getattr(spec, name, OPTIONAL_MEMBERS[name])


class FusionFamily(Generic[OptionsT]):
    """A base class with the defaults most families want; subclass it and fill in the rest.

    ``description`` defaults to the first line of the class docstring. Subclass
    ``FusionFamily[MyOptions]`` (with ``options_model = MyOptions``) and type checkers know what
    every method's ``options`` is.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    options_model: type[OptionsT] = FamilyOptions  # type: ignore[assignment]  # the default for FamilyOptions
    target_modules_patterns: ClassVar[Sequence[str]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("description") and cls.__doc__:
            cls.description = cls.__doc__.strip().splitlines()[0]

    def is_fusable(self, module: nn.Module, options: OptionsT) -> bool:
        raise NotImplementedError(f"family {self.name!r} must implement is_fusable")

    owns_submodules: ClassVar[bool] = False
    """See :attr:`ModuleFusionSpec.owns_submodules`."""

    preserves: ClassVar[str] = "outputs"
    """See :attr:`ModuleFusionSpec.preserves`."""

    tensor_parallel: ClassVar[TensorParallelRule | None] = None
    """See :attr:`ModuleFusionSpec.tensor_parallel`."""

    def sample_inputs(self, module: nn.Module, generator: torch.Generator) -> list[Inputs]:
        """See :meth:`ModuleFusionSpec.sample_inputs`: none by default."""
        return []

    def refusal(self, module: nn.Module, options: OptionsT) -> str | None:
        """See :meth:`ModuleFusionSpec.refusal`: no reason by default."""
        return None

    def module_transforms(
        self, module: nn.Module, config: PretrainedConfig, options: OptionsT
    ) -> Sequence[WeightTransform] | None:
        """See :meth:`ModuleFusionSpec.module_transforms`: the family's :meth:`make_transforms` by default."""
        return None

    fused_mixin: ClassVar[type | None] = None
    """Set this to a mixin class (usually a :class:`FusedModule` subclass) and the default
    :meth:`make_fused_class` returns ``fused_subclass(fused_mixin, original_cls)``."""

    def make_fused_class(self, original_cls: type[nn.Module], options: OptionsT) -> type[nn.Module]:
        if self.fused_mixin is None:
            raise NotImplementedError(f"family {self.name!r} must set fused_mixin or implement make_fused_class")
        return fused_subclass(self.fused_mixin, original_cls)

    def make_transforms(self, config: PretrainedConfig, options: OptionsT) -> Sequence[WeightTransform]:
        return ()

    def __repr__(self) -> str:
        return f"<fusion family {self.name!r} ({type(self).__module__}.{type(self).__qualname__})>"


_subclasses: dict[tuple[type, type], type[nn.Module]] = {}
_subclasses_lock = threading.Lock()
_FUSED_PREFIX = "fused_class"


def _reference(cls: type) -> str:
    """``module:qualname`` with every dot written as ``/``: one attribute name for pickle's lookup."""
    return f"{cls.__module__}:{cls.__qualname__}".replace(".", "/")


def _resolve(reference: str) -> type:
    module_name, _, qualname = reference.replace("/", ".").partition(":")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    if not isinstance(value, type):
        raise TypeError(f"{reference!r} names {value!r}, not a class")
    return value


def fused_subclass(mixin: type, original_cls: type[nn.Module]) -> type[nn.Module]:
    """``mixin`` mixed into ``original_cls``, one class per pair (so ``isinstance`` holds across loads).

    This is the one cache of fused classes: keyed by the two classes themselves (never by an
    ``id()`` that could be reused), so the same pair always gives the same class, in this
    process and, through :func:`__getattr__`, in the next one.

    The class keeps the original's ``__name__``: transformers and accelerate match
    ``_no_split_modules`` and similar lists by class name, and a renamed class drops out of them.
    Its ``__qualname__`` (``fused_class[<mixin>,<original>]``, both written ``module:qualname``
    with ``/`` for dots) names the pair, and ``__module__`` is this module: pickle stores the
    class by that reference, and unpickling in a fresh process rebuilds it from the pair, so
    ``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` of a fused model work. That
    reference is for pickle; plans and the CLI show ``<mixin module.qualname>[<original qualname>]``
    (``fusion_patch_embeddings.family.PatchLinearMixin[Conv3d]``, see :func:`fusion_core.transforms.class_name`).
    """
    key = (mixin, original_cls)
    with _subclasses_lock:
        fused = _subclasses.get(key)
        if fused is not None:
            return fused
        fused = type(
            original_cls.__name__,
            (mixin, original_cls),
            {
                "__module__": __name__,
                "__qualname__": f"{_FUSED_PREFIX}[{_reference(mixin)},{_reference(original_cls)}]",
                DISPLAY_NAME_ATTRIBUTE: f"{mixin.__module__}.{mixin.__qualname__}[{original_cls.__qualname__}]",
                **fused_class_overrides(original_cls),
            },
        )
        _subclasses[key] = fused
    return fused


def __getattr__(name: str) -> Any:
    """Resolve a fused class's reference (see :func:`fused_subclass`): how unpickling finds it."""
    if name.startswith(f"{_FUSED_PREFIX}[") and name.endswith("]"):
        mixin, _, original = name[len(_FUSED_PREFIX) + 1 : -1].partition(",")
        try:
            return fused_subclass(_resolve(mixin), _resolve(original))
        except (ImportError, AttributeError, TypeError) as exc:
            raise AttributeError(f"cannot rebuild fused class {name!r}: {exc}") from exc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FusedModule(nn.Module):
    """Optional mixin for fused classes; documents the two hooks fusion-core calls on them."""

    def fusion_finalize(self) -> None:
        """Called once the loaded tensors are in the fused layout, before the model is returned.

        Set up here what ``forward`` needs beyond the tensors (views, merged sub-modules).
        """

    def fusion_unfinalize(self) -> None:
        """Undo :meth:`fusion_finalize` (called by :func:`fusion_core.unfuse` before the tensors go back).

        A fused class whose ``fusion_finalize`` changes the module tree must implement this, or
        ``unfuse`` refuses it; the default does nothing, which is right when finalize does nothing.
        """
