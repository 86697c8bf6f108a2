"""The summary table of a sweep: one markdown row per member, start -> end of the summary metrics
(:data:`klrl.analysis.results.SUMMARY_KEYS`, as :meth:`klrl.analysis.results.RunResult.summary` averages
them); ``klrl sweep`` prints it."""

from __future__ import annotations

from typing import Any

from klrl.analysis.results import SUMMARY_KEYS, RunResult
from klrl.config import RunConfig

__all__ = ["summary_table"]


def summary_table(results: list[RunResult], axes: list[str] | None = None) -> str:
    """One markdown table: a row per member (its index, its values of the ``axes`` fields, e.g.
    ``kl.beta``), start -> end of each summary metric the first member logged."""
    axes = axes or []
    keys = [k for k in SUMMARY_KEYS if results and k in results[0].metrics]
    head = ["member", *axes, *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results):
        s = r.summary()
        vals = [str(_get(r.config, a)) for a in axes]
        vals += [f"{s[k]['start']:.3g} -> {s[k]['end']:.3g}" for k in keys]
        lines.append("| " + " | ".join([f"{i:02d}", *vals]) + " |")
    return "\n".join(lines)


def _get(cfg: RunConfig, dotted: str) -> Any:
    section, field = dotted.split(".", 1)
    return getattr(getattr(cfg, section), field)
