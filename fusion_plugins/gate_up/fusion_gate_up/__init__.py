"""The ``gate_up`` fusion family: gated-MLP gate/up projections run as one merged GEMM."""

from fusion_gate_up.family import GateUpFamily, GateUpMixin, GateUpOptions

__all__ = ["GateUpFamily", "GateUpMixin", "GateUpOptions"]
