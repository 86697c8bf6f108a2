"""The command line: the ``klrl`` command (:func:`main`, :mod:`klrl.cli.commands`) and the flags of
``python experiments/run.py`` translated into it (:func:`legacy_main`, :mod:`klrl.cli.legacy`).

:mod:`klrl.cli.args` builds the parser and the config from the flags, :mod:`klrl.cli.launch` runs and
prints, :mod:`klrl.cli.export` is ``klrl export``. :mod:`~klrl.cli.commands`,
:mod:`~klrl.cli.args` and :mod:`~klrl.cli.legacy` import the rest of klrl inside their functions, when a
command needs it, and the other modules here are imported only by the command they serve, so that a
parse error or ``klrl --help`` / ``klrl train --help`` does not import jax (tests/project/test_imports.py)."""

from klrl.cli.commands import main
from klrl.cli.legacy import legacy_main

__all__ = ["legacy_main", "main"]
