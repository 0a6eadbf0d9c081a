"""``fusion_config``: which families to apply, with which options, validated by pydantic.

The accepted shape is ``{family_name: True | False | {option: value}}``. ``True`` enables a
family with its default options, a mapping enables it with those options (validated by the
family's own ``options_model``), ``False`` lists it disabled. Order is kept: families apply in
the order given. Every error of a config is reported at once, as a
:class:`~fusion_core.errors.FusionConfigError` (an :class:`~fusion_core.errors.UnknownFamilyError`
as well when a family is not installed) that is also a ``pydantic.ValidationError``: its message
names the family and the field (pydantic's own text kept), its ``errors()`` give the locations,
and an unknown family lists the installed ones and the distribution that would provide it.

Family names are resolved against the registry once, here: the validated config keeps the
registered families it was checked against, and discovery and the adapter use those.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import PrivateAttr, RootModel, ValidationError, ValidationInfo, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticUndefined

from fusion_core.errors import FusionConfigError, UnknownFamilyError
from fusion_core.plugins import FamilyRegistry, PluginSource, RegisteredFamily, get_registry
from fusion_core.spec import FamilyOptions, ModuleFusionSpec

if TYPE_CHECKING:  # typing.Self is Python 3.11+; typing_extensions is needed by the type checker only
    from typing_extensions import Self

FamilySetting = bool | FamilyOptions


class FusionConfigValidationError(FusionConfigError, ValidationError):
    """What validating a ``fusion_config`` raises: a :class:`~fusion_core.errors.FusionConfigError` that is
    also the ``pydantic.ValidationError`` it was (same message, same ``errors()``)."""


class UnknownFamilyConfigError(UnknownFamilyError, FusionConfigValidationError):
    """A ``fusion_config`` that names a family that is not installed (its other errors reported with it)."""


def _as_fusion_config_error(exc: ValidationError) -> FusionConfigValidationError:
    """``exc`` (a failed validation of :class:`FusionConfig`) as the same errors in a fusion-core error type."""
    errors = exc.errors(include_url=False)
    unknown = any(error["type"] == "unknown_family" for error in errors)
    kind = UnknownFamilyConfigError if unknown else FusionConfigValidationError

    def rebuilt(with_context: bool) -> FusionConfigValidationError:
        # Each message is already rendered; it becomes the template of a custom error of the same type.
        return kind.from_exception_data(exc.title, [
            InitErrorDetails(
                type=PydanticCustomError(error["type"], error["msg"], error.get("ctx") if with_context else None),
                loc=error["loc"],
                input=error.get("input"),
            )
            for error in errors
        ])

    converted = rebuilt(with_context=True)
    if converted.errors(include_url=False) != errors:  # a rendered message that reads like a {placeholder}
        converted = rebuilt(with_context=False)
    return converted


@contextlib.contextmanager
def _fusion_config_errors() -> Iterator[None]:
    """Raise a failed validation of :class:`FusionConfig` as a :class:`FusionConfigValidationError`."""
    try:
        yield
    except ValidationError as exc:
        if isinstance(exc, FusionConfigError) or exc.title != FusionConfig.__name__:
            raise
        raise _as_fusion_config_error(exc) from None


class FusionConfig(RootModel[dict[str, Any]]):
    """The validated ``fusion_config``: family name -> ``True`` | ``False`` | options.

    >>> FusionConfig.model_validate({"patch_embeddings": True}).enabled_names()  # doctest: +SKIP
    ['patch_embeddings']

    Validate against a registry other than the process-wide one with
    ``FusionConfig.model_validate(value, context={"registry": registry})``. A config that does not
    validate raises :class:`FusionConfigValidationError` (see the module docs), from the constructor
    and every ``model_validate*`` method alike.
    """

    root: dict[str, FamilySetting]
    _families: dict[str, RegisteredFamily] = PrivateAttr(default_factory=dict)

    def __init__(self, /, root: Any = PydanticUndefined, **data: Any) -> None:
        """``FusionConfig(value)``: the same as ``FusionConfig.model_validate(value)`` (no argument: ``{}``)."""
        if data:
            if root is not PydanticUndefined:
                raise TypeError("FusionConfig() takes either one positional mapping or keyword arguments, not both")
            root = data
        validated = type(self).model_validate({} if root is PydanticUndefined else root)
        for attribute in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"):
            value = getattr(validated, attribute, None)
            object.__setattr__(self, attribute, value.copy() if value is not None else None)

    @classmethod
    def model_validate(cls, *args: Any, **kwargs: Any) -> Self:
        """pydantic's ``model_validate``, raising :class:`FusionConfigValidationError` for an invalid config."""
        with _fusion_config_errors():
            return super().model_validate(*args, **kwargs)

    @classmethod
    def model_validate_json(cls, *args: Any, **kwargs: Any) -> Self:
        """pydantic's ``model_validate_json``, raising :class:`FusionConfigValidationError` for an invalid config."""
        with _fusion_config_errors():
            return super().model_validate_json(*args, **kwargs)

    @classmethod
    def model_validate_strings(cls, *args: Any, **kwargs: Any) -> Self:
        """pydantic's ``model_validate_strings``, raising :class:`FusionConfigValidationError` for an invalid
        config."""
        with _fusion_config_errors():
            return super().model_validate_strings(*args, **kwargs)

    @model_validator(mode="wrap")
    @classmethod
    def _validate(cls, value: Any, handler: Any, info: ValidationInfo) -> FusionConfig:
        if isinstance(value, FusionConfig):
            return value
        context = info.context if isinstance(info.context, Mapping) else {}
        registry: FamilyRegistry = context.get("registry") or get_registry()
        if not isinstance(value, Mapping):
            raise PydanticCustomError(
                "fusion_config_type",
                "fusion_config must be a mapping of family name to True, False or an options mapping; "
                "got {kind}",
                {"kind": type(value).__name__},
            )
        errors: list[InitErrorDetails] = []
        settings: dict[str, FamilySetting] = {}
        families: dict[str, RegisteredFamily] = {}
        for name, setting in value.items():
            if not isinstance(name, str):
                errors.append(_error(
                    "family_name_type", "family names are strings, got {type_name}", (repr(name),), name,
                    type_name=type(name).__name__,
                ))
                continue
            if name not in registry:
                errors.append(_error("unknown_family", "{message}", (name,), setting,
                                     message=registry.unknown_family_message(name)))
                continue
            families[name] = registry.get(name)
            options_model = families[name].spec.options_model
            if isinstance(setting, bool):
                settings[name] = setting
            elif isinstance(setting, options_model):
                settings[name] = setting
            elif isinstance(setting, Mapping):
                try:
                    settings[name] = options_model.model_validate(dict(setting))
                except ValidationError as exc:
                    for detail in exc.errors():
                        errors.append(_error(
                            "family_option",
                            "family '{family}': {msg}",
                            (name, *detail["loc"]),
                            detail.get("input"),
                            family=name,
                            msg=detail["msg"],
                        ))
            else:
                errors.append(_error(
                    "family_setting_type",
                    "family '{family}': expected True, False or a mapping of options, got {type_name}",
                    (name,), setting, family=name, type_name=type(setting).__name__,
                ))
        if errors:
            raise ValidationError.from_exception_data("FusionConfig", errors)
        instance = cls.model_construct(root=settings)
        instance._families = families
        return instance

    @model_serializer(mode="plain")
    def _serialize(self) -> dict[str, Any]:
        return {
            name: setting if isinstance(setting, bool) else setting.model_dump(mode="json", exclude_unset=True)
            for name, setting in self.root.items()
        }

    # -- reading ---------------------------------------------------------------------------
    def families(self) -> list[tuple[RegisteredFamily, FamilyOptions]]:
        """Enabled families, in order, as registered when this config was validated, each with its
        options object (the family's defaults for ``True``)."""
        result: list[tuple[RegisteredFamily, FamilyOptions]] = []
        for name, setting in self.root.items():
            if setting is False:
                continue
            family = self._families[name]
            result.append((family, family.spec.options_model() if setting is True else setting))
        return result

    def sources(self) -> dict[str, PluginSource]:
        """Where each enabled family came from, by name: what every error about a family names."""
        return {family.name: family.source for family, _ in self.families()}

    def specs(self) -> dict[str, ModuleFusionSpec[Any]]:
        """Each enabled family's spec, by name (what the lifecycle hooks receive as ``families``)."""
        return {family.name: family.spec for family, _ in self.families()}

    def enabled(self) -> dict[str, FamilyOptions]:
        """Enabled family names, in order, each with its options object (defaults for ``True``)."""
        return {family.name: options for family, options in self.families()}

    def enabled_names(self) -> list[str]:
        return [name for name, setting in self.root.items() if setting is not False]

    def to_json(self) -> str:
        return json.dumps(self.model_dump())


def _error(error_type: str, template: str, loc: tuple[Any, ...], value: Any, **ctx: Any) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(error_type, template, ctx), loc=loc, input=value)


def parse_fusion_config(value: Any, registry: FamilyRegistry | None = None) -> FusionConfig:
    """Validate ``value`` (a mapping or a :class:`FusionConfig`) against ``registry``.

    Raises :class:`FusionConfigValidationError` (a :class:`~fusion_core.errors.FusionConfigError`, and an
    :class:`~fusion_core.errors.UnknownFamilyError` when a family is not installed) naming each family at fault.
    """
    context = {"registry": registry} if registry is not None else None
    return FusionConfig.model_validate(value, context=context)
