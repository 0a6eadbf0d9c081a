"""One module per third-party library, holding every private name and version-dependent behaviour
fusion-core needs from it (:mod:`.transformers`, :mod:`.peft`, :mod:`.torch`), each entry with the
releases it was checked on and its fallback or refusal elsewhere."""
