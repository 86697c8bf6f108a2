"""What a run leaves, read back: :class:`RunResult`, :func:`load_run`, :func:`load_sweep`.

A leaf module (it imports only the config and the metrics-file reader), so the run loop, the
sweep, the plots and the report all read results without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from klrl.config import RunConfig
from klrl.io import readers

SUMMARY_KEYS = (
    "reward/task",
    "kl/seq_sum",
    "kl/token_mean",
    "kl/exact_seq_sum",
    "ctrl/beta",
    "response/length",
)


@dataclass
class RunResult:
    """What a run leaves: ``metrics[name]`` is a NumPy array over iterations."""

    config: RunConfig
    dir: Path | None
    metrics: dict[str, np.ndarray]
    state: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for k in SUMMARY_KEYS:
            if k in self.metrics and len(self.metrics[k]):
                v = self.metrics[k]
                n = max(1, min(5, len(v) // 5))
                out[k] = {"start": float(np.mean(v[:n])), "end": float(np.mean(v[-n:]))}
        return out


def columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Metric rows -> ``{name: array over iterations}``; a name missing from a row is NaN there."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "iteration"))
    return {k: np.array([float(r.get(k, np.nan)) for r in rows]) for k in keys}


def load_run(run_dir: str | Path) -> RunResult:
    """Read a finished or running run from disk (config and metrics; no state).

    A damaged ``config.json`` or ``metrics.jsonl`` raises :class:`klrl.io.readers.RunDirError` (a
    ``ValueError``) naming the file; only a torn last line of ``metrics.jsonl`` is skipped."""
    d = Path(run_dir)
    cfg, rows = readers.read_run(d)
    return RunResult(cfg, d, columns(rows))


def load_sweep(sweep_dir: str | Path) -> list[RunResult]:
    """Read a sweep from disk: one :class:`RunResult` per member (config and metrics; no state).

    Members are those ``sweep.json`` lists, else the ``member-XX/`` sub-directories in order.
    """
    d = Path(sweep_dir)
    return [load_run(d / n) for n in readers.read_sweep_members(d)]
