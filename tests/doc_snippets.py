"""Running a documentation page's Python: its ```python blocks, joined, as one script in a fresh process.

Shared by ``test_docs.py`` (the pages that need only the core) and ``test_quantization.py``
(docs/quantization.md, in the environments that have the quantizers). ``FUSION_CORE_*`` variables
are dropped, so a snippet runs as a user's script would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of ``docs/<page>``, in order."""
    return FENCE.findall((DOCS / page).read_text())


def run_python_blocks(page: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """Run ``page``'s Python blocks as one script in ``directory``; the finished process."""
    script = directory / "snippets.py"
    script.write_text("\n\n".join(python_blocks(page)))
    env = {key: value for key, value in os.environ.items() if not key.startswith("FUSION_CORE_")}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=directory, env=env,
                          timeout=600)
