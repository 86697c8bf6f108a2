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
    "kl/k1_seq_sum",
    "kl/k1_seq_token_mean",
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


# metric names of runs stored before issue 12 -> today's names (same values; read by :func:`columns`)
LEGACY_NAMES = {
    "kl/seq_sum": "kl/k1_seq_sum",
    "kl/token_mean": "kl/k1_seq_token_mean",
    "eval/oracle_ppl": "eval/oracle_ppl_floored",
    "eval/oracle_impossible_frac": "eval/oracle_floored_frac",
}


def columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Metric rows -> ``{name: array over iterations}``; a name missing from a row is NaN there.
    Legacy names (:data:`LEGACY_NAMES`) are read under today's name (a row's own value first: a run
    resumed across the rename has both, row by row)."""
    keys = list(dict.fromkeys(LEGACY_NAMES.get(k, k) for r in rows for k in r if k != "iteration"))
    old = {v: k for k, v in LEGACY_NAMES.items()}
    return {k: np.array([float(r.get(k, r.get(old.get(k, k), np.nan))) for r in rows]) for k in keys}


def load_run(run_dir: str | Path) -> RunResult:
    """Read a finished or running run from disk (config and metrics; no state).

    A damaged ``config.json`` or ``metrics.jsonl`` raises :class:`klrl.io.readers.RunDirError` (a
    ``ValueError``) naming the file; only a torn last line of ``metrics.jsonl`` is skipped."""
    d = Path(run_dir)
    cfg, rows = readers.read_run(d)
    metrics = columns(rows)
    tgt = metrics.get("ctrl/target")
    if cfg.ctrl.kind == "fixed" and tgt is not None and np.isfinite(tgt).any():
        del metrics["ctrl/target"]  # runs before issue 12 logged a meaningless target for a fixed beta
    return RunResult(cfg, d, metrics)


def load_sweep(sweep_dir: str | Path) -> list[RunResult]:
    """Read a sweep from disk: one :class:`RunResult` per member (config and metrics; no state).

    Members are those ``sweep.json`` lists, else the ``member-XX/`` sub-directories in order.
    """
    d = Path(sweep_dir)
    return [load_run(d / n) for n in readers.read_sweep_members(d)]
