"""Exception types of fusion-core.

Every error a user can meet names what is at fault: the family, the plugin distribution,
the module path or the checkpoint key. Each type subclasses :class:`FusionError`, so one
``except`` catches them all, and a builtin type that fits (``ValueError``, ``KeyError``
is avoided because its ``str`` quotes the message).
"""

from __future__ import annotations


class FusionError(Exception):
    """Base class of every error raised by fusion-core."""


class PluginError(FusionError, RuntimeError):
    """A plugin failed to load or registered something invalid (strict mode, or on use)."""


class FusionConfigError(FusionError, ValueError):
    """A ``fusion_config`` is invalid: a bad option value, a setting of the wrong type, or a family that is not
    installed (then also an :class:`UnknownFamilyError`). The message names each family and field at fault.

    What validating a ``fusion_config`` raises is at the same time a ``pydantic.ValidationError`` (its
    ``errors()`` give each location), so code that caught that keeps working.
    """


class UnknownFamilyError(FusionError, ValueError):
    """A family named in ``fusion_config`` is not installed."""


class DiscoveryError(FusionError, ValueError):
    """A family could not be applied to a model: nothing fusable, or partly covered instances."""


class PlanError(FusionError, ValueError):
    """A transform plan is inconsistent: overlapping claims, missing leaves or bad shapes."""


class CheckpointError(FusionError, ValueError):
    """A checkpoint on disk is unusable for a fused load: missing, extra, mis-shaped or corrupt."""


class FusionLoadError(FusionError, RuntimeError):
    """Loading finished in transformers, but a fused module did not get all of its weights."""


class InsufficientMemoryError(FusionLoadError):
    """A fused load onto the CPU would allocate more memory than is available; refused before any weight is read."""


class SaveError(FusionError, RuntimeError):
    """Saving a fused model failed; the target directory was left as it was."""


class MissingIntegrationError(FusionError, RuntimeError):
    """A workflow on a fused model needs an integration plugin that is not installed; the message names it."""
