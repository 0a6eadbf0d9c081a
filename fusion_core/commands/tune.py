"""``fusion tune``: forget this machine's stored decisions, so that the next load measures them again.

The decisions are those of :mod:`fusion_core.decisions` ("which way is faster here", measured once per kind and
stored per machine and software). Setting ``FUSION_CORE_DECISIONS=measure`` re-measures without forgetting first;
``FUSION_CORE_DECISIONS=off`` uses no stored decision at all.
"""

from __future__ import annotations

from typing import Any

from fusion_core.decisions import fingerprint, forget_stored, store_path


def run_tune(every_machine: bool = False) -> dict[str, Any]:
    forgotten = forget_stored(every_machine)
    return {"ok": True, "store": str(store_path()), "forgotten": forgotten, "every_machine": every_machine,
            "fingerprint": fingerprint()}
