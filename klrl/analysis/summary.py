"""The summary table of a sweep: one markdown row per member, start -> end of the summary metrics
(:data:`klrl.analysis.results.SUMMARY_KEYS`, as :meth:`klrl.analysis.results.RunResult.summary` averages
them); ``klrl sweep`` prints it. Under it, :func:`cannot_differ_note` where the members cannot differ
yet (their KL never left zero, so the beta they differ in has had nothing to act on)."""

from __future__ import annotations

from typing import Any

import numpy as np

from klrl.analysis.results import SUMMARY_KEYS, RunResult
from klrl.config import RunConfig
from klrl.io.results import varying_fields

__all__ = ["KL_AT_ZERO", "cannot_differ_note", "summary_table"]

KL_AT_ZERO = 1e-2  # nats per sequence: below this in every member, beta has had (almost) nothing to act on
# the fields whose effect goes through the KL penalty (beta, its controller): members differing only in
# these run the same until the KL moves away from zero
_THROUGH_KL = ("kl.beta", "ctrl.")
_KL_NAMES = ("kl/exact_seq_sum", "kl/k1_seq_sum")


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
    note = cannot_differ_note(results)
    return "\n".join(lines + ([f"\n{note}"] if note else []))


def cannot_differ_note(results: list[RunResult]) -> str | None:
    """One line when a sweep's members differ only in fields that act through the KL penalty
    (``kl.beta``, ``ctrl.*``) and the KL (``kl/exact_seq_sum``, else ``kl/k1_seq_sum``; its absolute
    value) stayed below :data:`KL_AT_ZERO` nats/sequence at every iteration of every member: the
    penalty ``beta * KL`` has been ~0 whatever beta is, so the members are (nearly) the same run so far;
    None otherwise."""
    vary = [v for v in varying_fields([r.config for r in results]) if v != "train.name"]
    if len(results) < 2 or not vary or not all(v.startswith(_THROUGH_KL) for v in vary):
        return None
    name = next((n for n in _KL_NAMES if all(n in r.metrics for r in results)), None)
    if name is None:
        return None
    values = np.concatenate([np.abs(np.asarray(r.metrics[name], float)) for r in results])
    values = values[np.isfinite(values)]
    if not len(values) or values.max() >= KL_AT_ZERO:
        return None
    n = max(len(r.metrics[name]) for r in results)
    return (
        f"Members cannot differ yet: they differ only in {', '.join(vary)}, which act through the KL "
        f"penalty beta * KL, and the KL stayed below {KL_AT_ZERO:g} nats/sequence in every member over "
        f"{n} iteration{'s' if n != 1 else ''} (largest |{name}| {values.max():.2g}): beta has had "
        "nothing to act on yet; run more iterations (or a larger optim.lr) before comparing them."
    )


def _get(cfg: RunConfig, dotted: str) -> Any:
    section, field = dotted.split(".", 1)
    return getattr(getattr(cfg, section), field)
