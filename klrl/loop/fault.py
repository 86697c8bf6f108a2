"""A test-only fault: ``KLRL_FAULT=<phase>:<iteration>`` kills the process (SIGKILL, as ``kill -9``:
no clean-up, no flush, orbax's background save cut where it is) when the training loop reaches that
boundary. Unset (always, outside the tests), :func:`point` is one dictionary look-up.

The phases (tests/loop/test_kill_points.py kills at each of them):

* ``row-before:I`` / ``row-after:I``: before / after row ``I`` is written to ``metrics.jsonl`` (every
  member's);
* ``save-started:S``: checkpoint ``S``'s save was started (orbax writes it in the background:
  ``checkpoints/S.orbax-checkpoint-tmp-*``, not committed);
* ``save-committed:S``: checkpoint ``S`` is committed (the loop waited for it: only under the fault).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

ENV = "KLRL_FAULT"


def armed(phase: str, iteration: int) -> bool:
    """Whether ``KLRL_FAULT`` names this boundary."""
    return os.environ.get(ENV, "") == f"{phase}:{iteration}"


def point(phase: str, iteration: int, before: Callable[[], object] | None = None) -> None:
    """Kill this process here if ``KLRL_FAULT`` names this boundary (``before()`` first: e.g. wait
    for a save to commit)."""
    if armed(phase, iteration):
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
