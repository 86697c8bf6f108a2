"""What a run leaves, as the run loop writes it and analysis reads it back: :class:`RunResult`, the
metric columns of its rows (:func:`columns`), the names of a sweep's members (:func:`member_names`,
:func:`sweep_axes`), the keys of its summary (:data:`SUMMARY_KEYS`) and a run's final value
(:func:`tail_mean`).

A leaf of io/ (it imports only the config): the loop builds results with it and
:mod:`klrl.analysis.results` reads them back (:func:`~klrl.analysis.results.load_run`) without the
loop importing analysis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from klrl.config import RunConfig
from klrl.config.relevance import unread_fields

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

    def to_frame(self, metrics: list[str] | None = None) -> Any:
        """See :func:`to_frame`."""
        return to_frame(self, metrics)

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


def to_frame(results: RunResult | list[RunResult], metrics: list[str] | None = None) -> Any:
    """A long pandas DataFrame of runs: one row per (member, iteration, metric) with columns
    ``member`` (the member's directory name, else ``member-XX``), ``iteration``, ``metric``,
    ``value``, and one column per config field that differs between the runs (``kl.beta``, ...).
    ``metrics`` keeps only those names. Needs pandas (an optional dependency)."""
    try:
        import pandas as pd
    except ImportError as e:  # pragma: no cover - pandas is installed in the test environment
        raise ImportError("klrl.analysis.results.to_frame needs pandas: pip install pandas") from e
    runs = [results] if isinstance(results, RunResult) else list(results)
    vary = [a for a in varying_fields([r.config for r in runs]) if a != "train.name"]
    parts = []
    for j, r in enumerate(runs):
        member = r.dir.name if r.dir is not None else f"member-{j:02d}"
        for k, v in r.metrics.items():
            if metrics is not None and k not in metrics:
                continue
            v = np.asarray(v, float)
            cols = {"member": member, "iteration": np.arange(len(v)), "metric": k, "value": v}
            cols.update({a: [_get(r.config, a)] * len(v) for a in vary})
            parts.append(pd.DataFrame(cols))
    if not parts:
        return pd.DataFrame(columns=["member", "iteration", "metric", "value", *vary])
    return pd.concat(parts, ignore_index=True)


def _get(cfg: RunConfig, dotted: str) -> Any:
    section, name = dotted.split(".", 1)
    return getattr(getattr(cfg, section), name)


def varying_fields(configs: list[RunConfig]) -> list[str]:
    """The ``section.field`` names whose values differ between ``configs``, sorted."""
    dicts = [c.to_dict() for c in configs]
    if not dicts:
        return []
    first = dicts[0]
    return sorted(
        f"{s}.{k}"
        for s, fields in first.items()
        for k, v in fields.items()
        if any(d[s][k] != v for d in dicts[1:])
    )


_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
MAX_NAME = 120


def _value_text(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def member_names(configs: list[RunConfig]) -> list[str]:
    """A sweep's member directory names after the swept values, ``kl.beta=0.1,train.seed=1``
    (fields in sorted order, ``train.name`` left out, and each member's name only from the fields it
    reads: a fixed-beta member of a study is ``ctrl.kind=fixed,kl.beta=0.01``, without the
    ``ctrl.target`` its controller ignores, :func:`klrl.config.relevance.unread_fields`; characters other than
    ``A-Za-z0-9._=,+-`` become ``_``); ``member-XX`` when no field differs, when two names would be
    equal or when one would be longer than ``MAX_NAME`` characters."""
    axes = [a for a in varying_fields(configs) if a != "train.name"]
    fallback = [f"member-{j:02d}" for j in range(len(configs))]
    if not axes:
        return fallback
    names = []
    for c in configs:
        skip = unread_fields(c)
        names.append(
            _UNSAFE.sub("_", ",".join(f"{a}={_value_text(_get(c, a))}" for a in axes if a not in skip))
        )
    if len(set(names)) < len(names) or any(len(n) > MAX_NAME for n in names):
        return fallback
    return names


def sweep_axes(configs: list[RunConfig]) -> dict[str, list[Any]]:
    """``{'section.field': [distinct values, in member order]}`` of the fields that differ."""
    out: dict[str, list[Any]] = {}
    for a in varying_fields(configs):
        vals: list[Any] = []
        for c in configs:
            v = _get(c, a)
            if v not in vals:
                vals.append(v)
        out[a] = vals
    return out


def finite_mean(v: np.ndarray) -> float:
    """The mean of the finite values of ``v`` (NaN if none)."""
    ok = np.isfinite(v)
    return float(v[ok].mean()) if ok.any() else np.nan


def tail_mean(v: Any, w: int) -> float:
    """The final value of a run: the mean of the finite values over its last ``w`` iterations."""
    v = np.asarray(v, float)
    return finite_mean(v[-max(int(w), 1) :]) if len(v) else np.nan
