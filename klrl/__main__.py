"""``python -m klrl COMMAND [flags]``: the ``klrl`` command (:func:`klrl.cli.main`)."""

import sys

from klrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
