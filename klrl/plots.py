"""Figures of a run or a beta study, for a paper: each function takes one
:class:`~klrl.results.RunResult` or a list of them and returns a :class:`matplotlib.figure.Figure`.

Runs that differ only in ``train.seed`` are one *setting* (:func:`klrl.aggregate.seed_groups`):
one colour, the mean over seeds as a line and, with two or more seeds, its 95% Student-t interval
over seeds as a band (error bars on the frontier); the legend's title says so. Curves over
iterations are trailing means over ``smooth`` iterations (per seed, before averaging; beta is drawn
as the controller set it). Legends sit outside the data, right of the (top) axes; every axis label
is ``quantity [metric] (unit)``.

Every function takes ``ax=``: ``None`` makes a new figure; else one :class:`~matplotlib.axes.Axes`
(one-panel figures) or a sequence of them, one per panel, and the figure drawn into is returned.
Metric-name arguments (``kl=``, ``reward=``, ...) take a name or a tuple of alternatives (the first
that a run logs is used). Figures are built with matplotlib's object API (``Figure``, not
``pyplot``): nothing is shown and no GUI backend is touched, so they work headless (``savefig``
renders with Agg) and in notebooks. A metric no run logs leaves its panel saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from klrl.aggregate import first_logged, fit_gao, gao_curve, metric_label, stack, t_interval, window_means
from klrl.plotkit import (
    ITERATIONS,
    Group,
    adaptive,
    axes_for,
    band_title,
    curve_into,
    empty,
    groups,
    label,
    legend,
    log_if_positive,
    series,
    xlabel,
)
from klrl.results import RunResult

KL_SEQ = ("kl/exact_seq_sum", "kl/k1_seq_sum")
KL_TOKEN = ("kl/exact_token_mean", "kl/k1_seq_token_mean")
PROXY = ("reward/proxy", "reward/task")
GOLD = "reward/gold"
BETA = "ctrl/beta"
TARGET = "ctrl/target"
PERPLEXITIES = ("eval/oracle_ppl_floored", "eval/independent_ppl", "eval/ref_ppl")
DIVERSITY = ("eval/distinct_1", "eval/distinct_2")
SMOOTH = 10
_STYLES = ("-", "--", ":", "-.")

__all__ = [
    "beta_kl",
    "controller_comparison",
    "curve",
    "fit_gao",
    "frontier",
    "gao_curve",
    "label",
    "overoptimization",
    "perplexity_diversity",
]


# ---- figures -------------------------------------------------------------------------------------
def curve(
    results: RunResult | Sequence[RunResult],
    metric: str | Sequence[str],
    *,
    smooth: int = SMOOTH,
    ax: Axes | None = None,
    log: bool | None = None,
) -> Figure:
    """Any logged metric over iterations: per setting the mean over seeds (trailing means over
    ``smooth`` iterations) and its 95% t-interval band. ``log=None`` picks a log scale for a
    positive metric spanning more than a factor 20."""
    fig, (a,) = axes_for(ax, 1, 4.0, "curve")
    gs, labels, colors = groups(results)
    names, lines, texts, arrays = [], [], [], []
    for g, lab, col in zip(gs, labels, colors, strict=True):
        name, line, mean = curve_into(a, g, metric, smooth, col)
        if line is not None:
            names.append(name)
            lines.append(line)
            texts.append(lab)
            arrays.append(mean)
    if not lines:
        empty(a, metric if isinstance(metric, str) else " or ".join(metric))
        return fig
    if log is None:
        log_if_positive(a, arrays)
    elif log:
        a.set_yscale("log")
    a.set_ylabel(metric_label(names))
    a.set_xlabel(ITERATIONS)
    legend(a, lines, texts, band_title(gs, smooth), ax is None)
    return fig


def _kl_names(gs: list[Group]) -> tuple[tuple[str, ...], bool]:
    """KL names for a figure: per token only if every adaptive setting targets nats/token."""
    ad = [g for g in gs if adaptive(g)]
    token = bool(ad) and all(g.config.ctrl.unit == "token_mean" for g in ad)
    return (KL_TOKEN if token else KL_SEQ), token


def beta_kl(
    results: RunResult | Sequence[RunResult],
    *,
    kl: str | Sequence[str] | None = None,
    beta: str = BETA,
    smooth: int = SMOOTH,
    ax: Sequence[Axes] | None = None,
) -> Figure:
    """Beta (top, as set) and KL (bottom) over iterations; the target (``ctrl/target``, else
    ``config.ctrl.target``) dashed for adaptive settings whose target is in the KL's unit.

    ``kl=None`` shows KL per token when every adaptive setting targets nats/token
    (``ctrl.unit='token_mean'``), else per sequence, the exact KL where logged. ``ax``: 2 Axes.
    """
    fig, (ax_b, ax_k) = axes_for(ax, 2, 3.4, "beta_kl")
    gs, labels, colors = groups(results)
    auto, token = _kl_names(gs)
    names = auto if kl is None else kl
    handles, texts, betas, kl_seen, targets = [], [], [], [], False
    for g, lab, col in zip(gs, labels, colors, strict=True):
        bname, bline, bmean = curve_into(ax_b, g, beta, 1, col)
        kname, kline, _ = curve_into(ax_k, g, names, smooth, col)
        if bline is None and kline is None:
            continue
        handles.append(bline or kline)
        texts.append(lab)
        if bmean is not None:
            betas.append(bmean)
        if kname is None:
            continue
        kl_seen.append(kname)
        if adaptive(g) and kname.endswith("token_mean") == (g.config.ctrl.unit == "token_mean"):
            fill = lambda r, v: v
            tgt = TARGET if first_logged(g.runs, TARGET) else None
            if tgt is None:  # no logged target: the config's, constant
                tgt, fill = kname, lambda r, v: np.full(len(v), r.config.ctrl.target)
            mean, _, _ = t_interval(series(g, tgt, 1, fill))
            ax_k.plot(np.arange(len(mean)), mean, color=col, ls="--", lw=1)
            targets = True
    if betas:
        log_if_positive(ax_b, betas)
        ax_b.set_ylabel(metric_label(beta))
        extra = []
        if targets:
            extra = [Line2D([], [], color="k", ls="-", lw=1.5), Line2D([], [], color="k", ls="--", lw=1)]
        legend(ax_b, handles + extra, texts + (["KL", "target [ctrl/target]"] if targets else []),
                band_title(gs, smooth, "beta: as set"), ax is None)  # fmt: skip
    else:
        empty(ax_b, beta)
        if kl_seen:
            legend(ax_k, handles, texts, band_title(gs, smooth), ax is None)
    if kl_seen:
        ax_k.set_ylabel(metric_label(kl_seen))
    else:
        empty(ax_k, "KL")
    xlabel([ax_b, ax_k], ax is not None)
    ax_b.set_title("beta and KL")
    return fig


def frontier(
    results: RunResult | Sequence[RunResult],
    *,
    kl: str | Sequence[str] = KL_SEQ,
    reward: Sequence[str | Sequence[str]] | str = (PROXY, GOLD),
    window: int | None = None,
    ax: Axes | Sequence[Axes] | None = None,
) -> Figure:
    """Reward against KL, one panel per entry of ``reward`` (default: proxy, gold).

    Each run contributes the means over its non-overlapping ``window``-iteration windows
    (:func:`klrl.aggregate.window_means`, aligned on the last iteration; default ``window`` = a
    tenth of the longest run): one point per window, ``(mean KL, mean reward)``, joined in
    training order, the last (the final trailing-window means) marked large. A setting shows the
    mean over seeds per window, with 95% t-interval error bars in both directions. ``ax``: one
    Axes per panel.
    """
    rewards = [reward] if isinstance(reward, str) else list(reward)
    fig, axes = axes_for(ax, len(rewards), 3.6, "frontier")
    gs, labels, colors = groups(results)
    n_max = max((len(v) for g in gs for r in g.runs for v in r.metrics.values()), default=0)
    w = window if window is not None else max(1, n_max // 10)
    legend_done, xl = False, None
    for a, names in zip(axes, rewards, strict=True):
        handles, texts, kl_seen, r_seen = [], [], [], []
        for g, lab, col in zip(gs, labels, colors, strict=True):
            kname, rname = first_logged(g.runs, kl), first_logged(g.runs, names)
            if kname is None or rname is None:
                continue
            xs = stack([window_means(r.metrics.get(kname, []), w)[1] for r in g.runs])
            ys = stack([window_means(r.metrics.get(rname, []), w)[1] for r in g.runs])
            (x, xh, _), (y, yh, _) = t_interval(xs), t_interval(ys)
            (line,) = a.plot(x, y, color=col, marker="o", ms=3, lw=1.2)
            a.plot(x[-1:], y[-1:], color=col, marker="o", ms=8, mec="k", ls="none")
            if g.n > 1:
                a.errorbar(x, y, xerr=xh, yerr=yh, fmt="none", ecolor=col, elinewidth=0.8, alpha=0.6)
            handles.append(line)
            texts.append(lab)
            kl_seen.append(kname)
            r_seen.append(rname)
        if not handles:
            empty(a, f"{names if isinstance(names, str) else ' or '.join(names)} or KL")
            continue
        xl = metric_label(kl_seen)
        a.set_ylabel(metric_label(r_seen))
        if not legend_done:
            title = f"points: means over {w}-iteration windows\nlarge: last {w} iterations"
            title += (
                "\nbars: 95% t-interval over seeds" if any(g.n > 1 for g in gs) else "\none seed per setting"
            )
            legend(a, handles, texts, title, ax is None)
            legend_done = True
    if xl:
        xlabel(axes, ax is not None, xl)
    axes[0].set_title("reward-KL frontier")
    return fig


def overoptimization(
    results: RunResult | Sequence[RunResult],
    fit: bool = True,
    *,
    kl: str | Sequence[str] = KL_SEQ,
    gold: str | Sequence[str] = GOLD,
    proxy: str | Sequence[str] | None = PROXY,
    ax: Axes | None = None,
) -> Figure:
    """Gold (circles) and proxy (crosses) reward gain against ``d = sqrt(KL)``: every iteration of
    every run a point, a setting's seeds in its colour.

    Rewards are relative to each run's first iteration (the initial policy), as in Gao et al. (2023).
    With ``fit`` the RL form ``R(d) = d (alpha - b log d)`` is fitted to the pooled gold points
    (:func:`fit_gao`) and drawn, its coefficients in the legend. ``proxy=None`` leaves it out.
    """
    fig, (a,) = axes_for(ax, 1, 5.0, "overoptimization")
    gs, labels, colors = groups(results)
    kl_seen, d_all, g_all, handles, texts, kinds = [], [], [], [], [], {}
    for g, lab, col in zip(gs, labels, colors, strict=True):
        kname, gname = first_logged(g.runs, kl), first_logged(g.runs, gold)
        pname = first_logged(g.runs, proxy) if proxy is not None else None
        if kname is None or (gname is None and pname is None):
            continue
        kl_seen.append(kname)
        handles.append(Patch(color=col))  # colour swatch: the setting (markers: the reward)
        texts.append(lab)
        for r in g.runs:
            d = np.sqrt(np.maximum(np.asarray(r.metrics[kname], float), 0.0))
            for name, marker, pool in ((gname, "o", True), (pname, "x", False)):
                v = np.asarray(r.metrics.get(name, []), float) if name else np.array([])
                if len(v) != len(d) or not np.isfinite(v).any():
                    continue
                gain = v - v[np.isfinite(v)][0]
                a.scatter(d, gain, s=10 if pool else 14, color=col, marker=marker, lw=0.8)
                kinds[f"{'gold' if pool else 'proxy'} [{name}]"] = Line2D(
                    [], [], color="k", marker=marker, ls="none"
                )
                if pool:
                    d_all.append(d)
                    g_all.append(gain)
    if not handles:
        empty(a, "reward or KL")
        return fig
    if fit and d_all:
        d, gn = np.concatenate(d_all), np.concatenate(g_all)
        try:
            alpha, b = fit_gao(d, gn)
        except ValueError:
            pass
        else:
            xs = np.linspace(0.0, float(np.nanmax(d)), 200)
            (fl,) = a.plot(xs, gao_curve(xs, alpha, b), color="k", lw=1.5)
            kinds[f"gold fit d(alpha - b log d):\nalpha={alpha:.3g}, b={b:.3g}"] = fl
    a.axhline(0.0, color="grey", lw=0.5)
    names = list(dict.fromkeys(kl_seen))
    seq = all(n.endswith("seq_sum") for n in names)
    a.set_xlabel(f"d = sqrt(KL) [sqrt {', '.join(names)}] (sqrt(nats/sequence))" if seq else
                 f"d = sqrt({metric_label(names)})")  # fmt: skip
    a.set_ylabel("reward gain over iteration 0 (a.u.)")
    a.set_title("overoptimization (Gao et al. 2023)")
    legend(a, handles + list(kinds.values()), texts + list(kinds), "every iteration a point", ax is None)
    return fig


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
