"""The comparison engine under its former name: it is :mod:`fusion_core.compare` now.

Kept so test suites that import ``checkpoint_tensors`` and friends from here keep working.
"""

from fusion_core.compare import (
    TOLERANCES,
    Comparison,
    ModuleReport,
    RoundTripReport,
    SampleInputs,
    WholeModelReport,
    checkpoint_tensors,
    compare_checkpoints,
    compare_models,
    compare_outputs,
    iter_checkpoint_tensors,
    median_seconds,
    model_inputs,
    relative_error,
    round_trip,
    synthetic_inputs,
    tensors_of,
    tower_inputs,
)

__all__ = [
    "TOLERANCES", "Comparison", "ModuleReport", "RoundTripReport", "SampleInputs", "WholeModelReport",
    "checkpoint_tensors", "compare_checkpoints", "compare_models", "compare_outputs", "iter_checkpoint_tensors",
    "median_seconds", "model_inputs", "relative_error", "round_trip", "synthetic_inputs", "tensors_of", "tower_inputs",
]
