"""What a run leaves, read back: :class:`RunResult`, :func:`load_run`, :func:`load_sweep`.

A leaf module (it imports only the config, the metrics-file reader and the run-result type of
:mod:`klrl.io.results`, whose names it also gives: :class:`RunResult`, :func:`columns`,
:func:`to_frame`, :func:`member_names`, :func:`sweep_axes`, :func:`varying_fields`,
:data:`SUMMARY_KEYS`, :data:`LEGACY_NAMES`), so the run loop, the sweep, the plots and the report all
read results without importing each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from klrl.io import readers
from klrl.io.results import (
    LEGACY_NAMES,
    MAX_NAME,
    SUMMARY_KEYS,
    RunResult,
    columns,
    member_names,
    sweep_axes,
    to_frame,
    varying_fields,
)
from klrl.registry import is_adaptive

__all__ = [
    "LEGACY_NAMES",
    "MAX_NAME",
    "SUMMARY_KEYS",
    "RunResult",
    "Sweep",
    "columns",
    "load_run",
    "load_sweep",
    "member_names",
    "sweep_axes",
    "to_frame",
    "varying_fields",
]


def load_run(run_dir: str | Path) -> RunResult:
    """Read a finished or running run from disk (config and metrics; no state).

    A damaged ``config.json`` or ``metrics.jsonl`` raises :class:`klrl.io.readers.RunDirError` (a
    ``ValueError``) naming the file; only a torn last line of ``metrics.jsonl`` is skipped."""
    d = Path(run_dir)
    cfg, rows = readers.read_run(d)
    metrics = columns(rows)
    tgt = metrics.get("ctrl/target")
    if not is_adaptive(cfg.ctrl.kind) and tgt is not None and np.isfinite(tgt).any():
        del metrics["ctrl/target"]  # runs before issue 12 logged a meaningless target for a fixed beta
    return RunResult(cfg, d, metrics)


class Sweep(list):
    """The results of a sweep (a ``list`` of :class:`RunResult`), with :meth:`to_frame`."""

    def to_frame(self, metrics: list[str] | None = None) -> Any:
        """See :func:`to_frame`."""
        return to_frame(self, metrics)


def load_sweep(sweep_dir: str | Path) -> Sweep:
    """Read a sweep from disk: one :class:`RunResult` per member (config and metrics; no state).

    Members are those ``sweep.json`` lists, else the ``member-XX/`` sub-directories in order;
    ``load_sweep(d).to_frame()`` is the long DataFrame of :func:`to_frame`.
    """
    d = Path(sweep_dir)
    return Sweep(load_run(d / n) for n in readers.read_sweep_members(d))
