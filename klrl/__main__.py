"""``python -m klrl COMMAND [flags]``: the ``klrl`` command (:mod:`klrl.commands`)."""

import sys

from klrl.commands import main

if __name__ == "__main__":
    sys.exit(main())
