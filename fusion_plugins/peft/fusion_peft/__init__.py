"""fusion-core's PEFT integration (the ``fusion-peft`` distribution): LoRA on fused models.

Installed, it is found through the ``fusion_core`` entry point like any plugin; nothing to call.
See ``docs/interop.md`` for what LoRA on a fused model does and what it refuses.
"""
