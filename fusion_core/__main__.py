"""``python -m fusion_core`` is the ``fusion`` command."""

from fusion_core.cli import main

raise SystemExit(main())
