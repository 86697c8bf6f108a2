"""Guards of a long run: preemption signals, the non-finite stop and the quality rollback.

The decisions are pure functions over plain Python data, so they are tested
without training anything:

* :func:`skip_stop`: the non-finite guard in the step keeps the state when
  anything is NaN/inf and counts consecutive skips; after ``K`` in a row the run
  stops (:class:`RunStopped`), its last good state checkpointed.
* :func:`decide_rollback`: a quality metric (e.g. ``eval/oracle_ppl``) traced
  over iterations crosses ``threshold x`` its value at iteration 0; the run
  goes back to the newest checkpoint whose metric was still on the good side,
  multiplies beta by ``rollback_factor`` and continues, at most
  ``max_rollbacks`` times.

Metric ``trace[i]`` is the metric of iteration ``i``, measured on the rollout of
the state after ``i`` updates, which is exactly the state a checkpoint at step
``i`` holds. So checkpoint ``s`` is *good* iff ``trace[s]`` is on the good side.
"""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class RunStopped(RuntimeError):
    """The run stopped on purpose (guard or rollback limit); ``str(e)`` is a one-line reason.

    The run directory holds a checkpoint to resume from; ``result`` is the partial :class:`RunResult`.
    """

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result


# ---- non-finite guard -------------------------------------------------------------------------


def skip_stop(consecutive_skips: float, limit: int) -> bool:
    """Stop after ``limit`` consecutive skipped iterations (``limit = 0``: never)."""
    return limit > 0 and consecutive_skips >= limit


# ---- quality rollback ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Rollback:
    """Go back to checkpoint ``step`` (0 = the initial state) because ``trace[crossing]`` crossed."""

    crossing: int  # iteration whose metric crossed the threshold
    value: float  # the metric there
    ratio: float  # value / trace[0]
    step: int  # the checkpoint to restore


def is_bad(value: float, base: float, threshold: float) -> bool:
    """``value`` is past ``threshold x base``: above it for a threshold > 1, below it for one < 1.

    A non-finite value is neither bad nor good (see :func:`is_good`): the non-finite
    guard deals with those. A base that is not a positive finite number disables the check.
    """
    if not (math.isfinite(base) and base > 0 and math.isfinite(value)):
        return False
    limit = threshold * base
    return value > limit if threshold > 1 else value < limit


def is_good(value: float, base: float, threshold: float) -> bool:
    return math.isfinite(value) and math.isfinite(base) and base > 0 and not is_bad(value, base, threshold)


def first_crossing(trace: Sequence[float], threshold: float, base: float | None = None) -> int | None:
    """The first iteration whose metric is past ``threshold x base`` (default base: ``trace[0]``)."""
    if not trace:
        return None
    base = float(trace[0]) if base is None else float(base)
    for i, v in enumerate(trace):
        if is_bad(float(v), base, threshold):
            return i
    return None


def decide_rollback(
    trace: Sequence[float], checkpoints: Sequence[int], threshold: float, base: float | None = None
) -> Rollback | None:
    """Where to roll back to, if the metric ``trace`` crossed ``threshold x base``.

    ``base`` defaults to ``trace[0]``; ``checkpoints`` are the complete checkpoint steps
    available. The target is the newest step ``s <= crossing`` whose ``trace[s]`` is good;
    step 0 (the initial state, rebuilt from the seed) is always a candidate.
    """
    base = float(trace[0]) if base is None and trace else base
    t = first_crossing(trace, threshold, base)
    if t is None:
        return None
    candidates = [int(s) for s in checkpoints if 0 < int(s) <= t]
    good = [s for s in candidates if s < len(trace) and is_good(float(trace[s]), base, threshold)]
    value = float(trace[t])
    return Rollback(crossing=t, value=value, ratio=value / base, step=max(good, default=0))


def rollback_beta(restored: float, current: float, factor: float) -> float:
    """The beta a run continues with after a rollback: ``factor`` times the larger of the restored
    state's beta and the beta in force when the metric crossed.

    Restoring resets beta to the checkpoint's value, so scaling the restored beta alone would make
    every rollback to the same checkpoint retry the same beta; taking the larger of the two makes
    repeated rollbacks compound (``factor``, ``factor**2``, ... times the checkpoint's beta).
    """
    return max(restored, current) * factor


# ---- preemption ---------------------------------------------------------------------------------


class StopSignals:
    """A context manager: SIGTERM/SIGINT set :attr:`received` instead of killing the process.

    The run loop polls it after every iteration, checkpoints and returns. A second SIGINT
    raises ``KeyboardInterrupt`` at once (a user pressing Ctrl-C twice wants out). The
    previous handlers are restored on exit. Outside the main thread nothing is installed.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None] | None = None):
        self.received: int | None = None
        self._log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signum
        self._log(f"{signal.Signals(signum).name}: finishing this iteration, then checkpoint and stop")

    def __enter__(self) -> StopSignals:
        for s in self.SIGNALS:
            try:
                self._previous[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
