"""fusion-core's tensor-parallel integration (the ``fusion-tensor-parallel`` distribution).

Installed, it is found through the ``fusion_core`` entry point like any plugin; nothing to call.
See ``docs/distributed.md`` for what it shards and what it refuses.
"""
