"""fusion-core's quantization integration (the ``fusion-quantization`` distribution).

Installed, it is found through the ``fusion_core`` entry point like any plugin; nothing to call.
See ``docs/quantization.md`` for what it refuses, when, and the way out.
"""
