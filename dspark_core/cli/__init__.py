"""The ``dspark`` command: parses arguments, loads what a verb needs, calls the packages below.

Nothing imports this package but the entry point (``dspark = dspark_core.cli.main:main``) and
``python -m dspark_core.cli``; command plugins receive a :class:`~dspark_core.cli.common.CommandKit`.
"""
