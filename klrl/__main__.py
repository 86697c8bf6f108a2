"""``python -m klrl COMMAND [flags]``: the ``klrl`` command (:mod:`klrl.cli.commands`)."""

import sys

from klrl.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
