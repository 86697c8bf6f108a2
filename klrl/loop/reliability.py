"""Guards of a long run: preemption signals, the non-finite stop and the quality rollback.

The decisions are pure functions over plain Python data, so they are tested
without training anything:

* :func:`skip_stop`: the non-finite guard in the step keeps the state when
  anything is NaN/inf and counts consecutive skips; after ``K`` in a row the run
  stops (:class:`RunStopped`), its last good state checkpointed.
* :func:`decide_rollback`: a quality metric (e.g. ``eval/oracle_ppl_floored``) traced
  over iterations crosses ``threshold x`` its value at iteration 0; the run
  goes back to the newest checkpoint whose metric was still on the good side,
  multiplies beta by ``rollback_factor`` and continues, at most
  ``max_rollbacks`` times.

Metric ``trace[i]`` is the metric of iteration ``i``, measured on the rollout of
the state after ``i`` updates, which is exactly the state a checkpoint at step
``i`` holds. So checkpoint ``s`` is *good* iff ``trace[s]`` is on the good side.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from klrl.io import checkpoint as ckpt
from klrl.io.lock import RunLock


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


def rollback_betas(restored: Any, current: Any, members: Sequence[int], factor: float) -> Any:
    """The restored state's beta (``[]`` or ``[members]`` float32) with :func:`rollback_beta` applied
    to the ``members`` whose metric crossed (``current``: the beta in force when it crossed)."""
    old = np.asarray(restored, np.float32).reshape(-1)
    now = np.asarray(current, np.float32).reshape(-1)
    beta = old.copy()
    for j in members:
        beta[j] = rollback_beta(float(old[j]), float(now[j]), factor)
    return beta.reshape(np.shape(restored)).astype(np.float32)


# ---- preemption ---------------------------------------------------------------------------------


class StopSignals:
    """A context manager: SIGTERM/SIGINT set :attr:`received` instead of killing the process.

    The run loop polls it before every iteration, checkpoints and returns (a signal that came
    before the first iteration, e.g. during the task build or the compile, stops the run there,
    with checkpoint 0). A second SIGINT exits at once: one line on stderr, then
    ``os._exit(130)`` (no unwinding through JAX or orbax; the last complete checkpoint is intact,
    since orbax writes a step to a temporary directory and renames it when done). In an
    interactive interpreter (REPL, Jupyter) it raises ``KeyboardInterrupt`` instead, so the
    session survives. The previous handlers are restored on exit; entering again while installed
    is a no-op (a loop may re-enter the guard's instance). Outside the main thread nothing is
    installed.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None] | None = None):
        self.received: int | None = None
        self.note = ""  # appended to the second-SIGINT line (e.g. where the last checkpoint is)
        self._log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self._previous: dict[int, Any] = {}
        self._depth = 0

    @property
    def name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                if _interactive():
                    raise KeyboardInterrupt
                _exit_now(f"SIGINT again: exiting now{self.note}", 130)
            return
        self.received = signum
        again = " (Ctrl-C again: quit at once)" if signum == signal.SIGINT else ""
        self._log(f"{signal.Signals(signum).name}: stopping after this iteration and a checkpoint{again}")

    def __enter__(self) -> StopSignals:
        self._depth += 1
        if self._depth > 1:
            return self
        for s in self.SIGNALS:
            try:
                self._previous[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


def _interactive() -> bool:
    return hasattr(sys, "ps1") or "ipykernel" in sys.modules


def _exit_now(line: str, status: int) -> None:
    """Flush, print ``line`` on stderr and end the process at once (no atexit, no finalizers)."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    with contextlib.suppress(Exception):
        os.write(2, (line + "\n").encode())
    os._exit(status)


class RunGuard:
    """The whole life of a writing run, as one context manager (enter it before anything is built):

    * :attr:`signals`, a :class:`StopSignals` installed from the start, so SIGTERM/SIGINT during
      the task build, the pretraining or the compile stop the run at its first iteration
      boundary (checkpoint 0) instead of killing it;
    * :meth:`hold` takes the run directory's lock (:mod:`klrl.io.lock`) once the directory is
      known and keeps it until the guard exits, on every way out;
    * a full disk anywhere in the run (the lock, ``config.json``, orbax, ``metrics.jsonl``,
      TensorBoard, summaries), seen as ENOSPC in the exception chain, leaves as one
      :class:`~klrl.io.checkpoint.DiskFull` naming the directory, the file that could not be written
      when the error names it, and the last complete checkpoint.
    """

    def __init__(self, log: Callable[[str], None] | None = None, signals: bool = True):
        self.signals = StopSignals(log)
        self._with_signals = signals  # False: a caller that never polls them (a sweep)
        self.dir: Any = None
        self._lock: Any = None

    def hold(self, run_dir: Any) -> None:
        """Lock ``run_dir`` (an existing directory) for the rest of the guard's life."""
        self.dir = run_dir  # (first: a full disk that fails the lock's write is named after it)
        if self._lock is None:
            self._lock = RunLock(run_dir).acquire()
        self.signals.note = f"; the last complete checkpoint in {run_dir} is intact (--resume {run_dir})"

    def __enter__(self) -> RunGuard:
        if self._with_signals:
            self.signals.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if isinstance(exc, Exception):
                if not isinstance(exc, ckpt.DiskFull) and ckpt.is_disk_full(exc):
                    if self.dir is not None:
                        raise ckpt.disk_full_error(self.dir, exc) from exc
                    file = ckpt.failed_file(exc)
                    why = f"writing {file}" if file else " ".join(str(exc).split())[:200]
                    raise ckpt.DiskFull(f"disk full (no space left on device): {why}") from exc
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if self._with_signals:
                self.signals.__exit__(exc_type, exc, tb)
