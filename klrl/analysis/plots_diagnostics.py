"""The diagnostic figures of :mod:`klrl.analysis.plots` (re-exported there; the conventions are in its
docstring): sample perplexity and diversity over iterations, and the controller comparison
(KL over its own target, beta as set)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from klrl.analysis.aggregate import first_logged, metric_label
from klrl.analysis.plotkit import (
    BETA,
    KL_SEQ,
    KL_TOKEN,
    SMOOTH,
    TARGET,
    Group,
    adaptive,
    axes_for,
    band_title,
    curve_into,
    empty,
    groups,
    legend,
    log_if_positive,
    xlabel,
)
from klrl.analysis.results import RunResult

PERPLEXITIES = ("eval/oracle_ppl_floored", "eval/independent_ppl", "eval/ref_ppl")
DIVERSITY = ("eval/distinct_1", "eval/distinct_2")
_STYLES = ("-", "--", ":", "-.")

__all__ = ["controller_comparison", "perplexity_diversity"]


def perplexity_diversity(
    results: RunResult | Sequence[RunResult],
    *,
    ppl: Sequence[str] = PERPLEXITIES,
    diversity: Sequence[str] = DIVERSITY,
    smooth: int = SMOOTH,
    ax: Sequence[Axes] | None = None,
) -> Figure:
    """Perplexities of policy samples (log scale where they span > x20) and distinct-n over
    iterations: colour the setting, line style the metric. ``ax=None`` leaves out a panel whose
    metrics no run logs; else 2 Axes."""
    panels = [(tuple(ppl), "sample perplexity"), (tuple(diversity), "distinct n-grams")]
    if ax is None:
        rs = [results] if isinstance(results, RunResult) else list(results)
        panels = [p for p in panels if any(first_logged(rs, (n,)) for n in p[0])] or panels[:1]
    fig, axes = axes_for(ax, len(panels), 3.2, "perplexity_diversity")
    gs, labels, colors = groups(results)
    for i, (a, (names, quantity)) in enumerate(zip(axes, panels, strict=True)):
        arrays, handles, texts, kinds = [], [], [], {}
        for g, lab, col in zip(gs, labels, colors, strict=True):
            drawn = False
            for name, ls in zip(names, _STYLES, strict=False):
                _, line, mean = curve_into(a, g, (name,), smooth, col, ls)
                if line is not None:
                    arrays.append(mean)
                    kinds[name] = Line2D([], [], color="k", ls=ls, lw=1.5)
                    drawn = True
            if drawn and i == 0:
                handles.append(Line2D([], [], color=col, ls="-", lw=1.5))
                texts.append(lab)
        if not kinds:
            empty(a, " or ".join(names))
            continue
        if names == tuple(ppl):
            log_if_positive(a, arrays)
        a.set_ylabel(metric_label(list(kinds), quantity if len(kinds) > 1 else None))
        styles = list(kinds) if len(kinds) > 1 else []  # the line-style key, with the settings on top
        legend(
            a,
            handles + [kinds[k] for k in styles],
            texts + styles,
            band_title(gs, smooth) if i == 0 else None,
            ax is None and i == 0,
        )
    xlabel(axes, ax is not None)
    axes[0].set_title("perplexity and diversity")
    return fig


def controller_comparison(
    results: RunResult | Sequence[RunResult],
    *,
    kl: str | Sequence[str] | None = None,
    beta: str = BETA,
    smooth: int = SMOOTH,
    ax: Sequence[Axes] | None = None,
) -> Figure:
    """Adaptive settings: KL over their own target (top; 1 is on target); every setting's beta
    (middle, as set); fixed-beta settings' KL in its own panel (bottom, where there are any).

    The KL is the one the controller sees (``ctrl/kl_observed_<ctrl.unit>``: its estimator, its
    unit), else the exact/sampled KL in that unit, unless ``kl`` names others (it must then be in
    the target's unit); the target is the run's ``ctrl/target`` (else its
    ``config.ctrl.target``). Adaptive settings are solid lines, fixed-beta ones dotted. ``ax``: 2
    Axes, 3 when there are fixed-beta settings.
    """
    gs, labels, colors = groups(results)
    fixed = [g for g in gs if not adaptive(g)]
    fig, axes = axes_for(ax, 2 + bool(fixed), 3.4, "controller_comparison")
    ax_r, ax_b = axes[0], axes[1]
    ax_f = axes[2] if fixed else None
    ratios, betas, fixed_kl, handles, texts = [], [], [], [], []

    def observed(g: Group) -> str | Sequence[str]:
        u = g.config.ctrl.unit
        if kl is not None:
            return kl
        return (f"ctrl/kl_observed_{u}", *(KL_TOKEN if u == "token_mean" else KL_SEQ))

    def over_target(r: RunResult, v: np.ndarray) -> np.ndarray:
        t = np.asarray(r.metrics.get(TARGET, []), float)
        t = t if len(t) == len(v) and np.isfinite(t).any() else np.full(len(v), r.config.ctrl.target)
        return v / np.where(t > 0, t, np.nan)

    for g, lab, col in zip(gs, labels, colors, strict=True):
        ls = "-" if adaptive(g) else ":"
        if adaptive(g):
            kname, kline, mean = curve_into(ax_r, g, observed(g), smooth, col, ls, over_target)
            ratios += [] if mean is None else [mean]
        else:
            kname, kline, mean = curve_into(ax_f, g, observed(g), smooth, col, ls)
            fixed_kl += [] if kname is None else [kname]
        _, bline, bmean = curve_into(ax_b, g, beta, 1, col, ls)
        betas += [] if bmean is None else [bmean]
        if kline is not None or bline is not None:
            handles.append(bline or kline)
            texts.append(lab)
    if ratios:
        ax_r.axhline(1.0, color="k", lw=0.8, ls="--")
        log_if_positive(ax_r, ratios)
        ax_r.set_ylabel("KL / own target (ratio)")
    else:
        empty(ax_r, "adaptive controller's KL")
    if betas:
        log_if_positive(ax_b, betas)
        ax_b.set_ylabel(metric_label(beta))
    else:
        empty(ax_b, beta)
    if ax_f is not None:
        ax_f.set_ylabel(metric_label(fixed_kl)) if fixed_kl else empty(ax_f, "KL of fixed-beta runs")
    xlabel(axes, ax is not None)
    style = "solid: adaptive, dotted: fixed beta; " if fixed and len(fixed) < len(gs) else ""
    legend(ax_r, handles, texts, band_title(gs, smooth, style + "beta: as set"), ax is None)
    ax_r.set_title("controller comparison" + ("" if not fixed else ": fixed-beta KL in the bottom panel"))
    return fig
