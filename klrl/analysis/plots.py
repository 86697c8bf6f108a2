"""Figures of a run or a beta study, for a paper: each function takes one
:class:`~klrl.analysis.results.RunResult` or a list of them and returns a :class:`matplotlib.figure.Figure`.

Runs that differ only in ``train.seed`` are one *setting* (:func:`klrl.analysis.aggregate.seed_groups`):
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

from klrl.analysis.aggregate import (
    first_logged,
    fit_gao,
    gao_curve,
    metric_label,
    stack,
    t_interval,
    window_means,
)
from klrl.analysis.plotkit import (
    BETA,
    ITERATIONS,
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
    label,
    legend,
    log_if_positive,
    series,
    xlabel,
)
from klrl.analysis.plots_diagnostics import controller_comparison, perplexity_diversity
from klrl.analysis.results import RunResult

PROXY = ("reward/proxy", "reward/task")
GOLD = "reward/gold"

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
    beta_smooth: int = 1,
) -> Figure:
    """Beta (top, as set; trailing ``beta_smooth``-iteration means where > 1) and KL (bottom, trailing
    ``smooth``-iteration means) over iterations; the target (``ctrl/target``, else
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
        bname, bline, bmean = curve_into(ax_b, g, beta, beta_smooth, col)
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
        how = "beta: as set" if beta_smooth <= 1 else f"beta: trailing {beta_smooth}-iteration means too"
        legend(ax_b, handles + extra, texts + (["KL", "target [ctrl/target]"] if targets else []),
                band_title(gs, smooth, how), ax is None)  # fmt: skip
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
    (:func:`klrl.analysis.aggregate.window_means`, aligned on the last iteration; default ``window`` = a
    tenth of the longest run): one point per window, ``(mean KL, mean reward)``, joined in
    training order, the last (the final trailing-window means) marked large. A setting shows the
    mean over seeds per window, with 95% t-interval error bars in both directions. ``ax``: one
    Axes per panel.
    """
    rewards = [reward] if isinstance(reward, str) else list(reward)
    if ax is None:  # a panel per reward some run logs (a text task has no gold reward: no empty panel)
        rs = [results] if isinstance(results, RunResult) else list(results)
        rewards = [n for n in rewards if first_logged(rs, n)] or rewards[:1]
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
            rs = [r for g in gs for r in g.runs]
            missing = [n for n in (names, kl) if first_logged(rs, n) is None]
            empty(a, " and ".join(n if isinstance(n, str) else " or ".join(n) for n in missing))
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
    a.set_xlabel(
        f"d = sqrt(KL) [sqrt {', '.join(names)}] (sqrt(nats/sequence))"
        if seq
        else f"d = sqrt({metric_label(names)})"
    )
    a.set_ylabel("reward gain over iteration 0 (a.u.)")
    a.set_title("overoptimization (Gao et al. 2023)")
    legend(a, handles + list(kinds.values()), texts + list(kinds), "every iteration a point", ax is None)
    return fig
