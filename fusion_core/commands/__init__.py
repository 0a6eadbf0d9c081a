"""What the ``fusion`` command does, one module per subcommand; ``fusion_core.cli`` parses and prints.

Each ``run_*`` function returns plain data (what ``--json`` prints) and raises
:class:`~fusion_core.errors.FusionError` (or a pydantic ``ValidationError``) for a user error.
"""
