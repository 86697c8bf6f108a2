"""Drawing pieces shared by the :mod:`klrl.analysis.plots` figures: run labels, seed groups with colours,
axes from ``ax=``, mean-and-band curves, legends outside the data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from klrl.analysis.aggregate import Group, first_logged, label, seed_groups, stack, t_interval, trailing_mean
from klrl.analysis.results import RunResult
from klrl.registry import CONTROLLERS

ITERATIONS = "iteration (PPO iterations)"
BAND_ALPHA = 0.2
KL_SEQ = ("kl/exact_seq_sum", "kl/k1_seq_sum")
KL_TOKEN = ("kl/exact_token_mean", "kl/k1_seq_token_mean")
BETA = "ctrl/beta"
TARGET = "ctrl/target"
SMOOTH = 10  # the figures' default trailing mean (iterations)


# ---- helpers -------------------------------------------------------------------------------------
def adaptive(g: Group | RunResult) -> bool:
    """Whether the run's controller moves beta (the registry's ``adaptive``, true unless declared)."""
    return CONTROLLERS.meta(g.config.ctrl.kind).get("adaptive", True)


def groups(results: RunResult | Sequence[RunResult]) -> tuple[list[Group], list[str], list[Any]]:
    """Seed groups, their legend labels (``n=K seeds`` where K > 1, an index where labels collide)
    and colours."""
    from matplotlib import colormaps

    gs = seed_groups([results] if isinstance(results, RunResult) else list(results))
    labels = [label(g.config) + (f" (n={g.n} seeds)" if g.n > 1 else "") for g in gs]
    if len(set(labels)) < len(labels):
        labels = [f"{i:02d}: {s}" for i, s in enumerate(labels)]
    cmap = colormaps["tab10" if len(gs) <= 10 else "viridis"]
    colors = [cmap(i if len(gs) <= 10 else i / max(len(gs) - 1, 1)) for i in range(len(gs))]
    return gs, labels, colors


def axes_for(ax: Axes | Sequence[Axes] | None, n: int, height: float, what: str) -> tuple[Figure, list[Axes]]:
    if ax is None:
        fig = Figure(figsize=(9, height * n), layout="constrained")
        return fig, list(np.atleast_1d(fig.subplots(n, 1, sharex=n > 1)))
    axes = [ax] if isinstance(ax, Axes) else list(ax)
    if len(axes) != n or not all(isinstance(a, Axes) for a in axes):
        raise ValueError(f"{what}: ax= needs {n} Axes here, got {len(axes)}")
    try:
        return axes[0].get_figure(root=True), axes
    except TypeError:  # matplotlib < 3.10: no subfigure/root distinction
        return axes[0].get_figure(), axes


def empty(ax: Axes, what: str) -> None:
    """Say so in the panel (its x axis may be shared: left alone)."""
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_yticks([])


def xlabel(axes: list[Axes], given: bool, text: str = ITERATIONS) -> None:
    """On every panel for Axes given by the caller, else on the bottom one (the x axis is shared)."""
    for a in axes if given else axes[-1:]:
        a.set_xlabel(text)


def band_title(groups: Sequence[Group], smooth: int = 1, extra: str = "") -> str:
    lines = [extra] if extra else []
    if smooth > 1:  # the statistic, named: the last point is the report's "final" of the same window
        lines.append(f"curves: trailing {smooth}-iteration means\n(last point: mean of the last {smooth})")
    else:
        lines.append("curves: each iteration's value")
    if any(g.n > 1 for g in groups):
        lines.append("line: mean over seeds; band: 95% t-interval")
    else:
        lines.append("one seed per setting (no interval)")
    return "\n".join(lines)


def legend(
    ax: Axes, handles: list[Any], texts: list[str], title: str | None = None, own: bool = False
) -> None:
    """Legend outside the data: right of ``ax`` beside its top; for a figure of our own (``own``)
    whose labels are long, a figure legend below the axes instead (two columns)."""
    if not handles:
        return
    kw = dict(fontsize="small", title=title, title_fontsize="small", frameon=False)
    if own and max(len(t) for t in texts) > 32:
        fig = ax.get_figure()
        fig.legend(handles, texts, loc="outside lower center", ncols=2, **kw)
    else:
        ax.legend(handles, texts, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kw)


def log_if_positive(ax: Axes, arrays: list[np.ndarray]) -> None:
    vals = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.array([])
    if len(vals) and np.all(vals > 0) and vals.max() / vals.min() > 20:
        ax.set_yscale("log")


def series(g: Group, name: str, smooth: int, transform: Any = None) -> np.ndarray:
    """``[seeds, iterations]`` of ``name`` (NaN where a seed lacks it), each seed smoothed."""
    rows = []
    for r in g.runs:
        v = np.asarray(r.metrics.get(name, []), float)
        v = transform(r, v) if transform is not None and len(v) else v
        rows.append(trailing_mean(v, smooth) if smooth > 1 else v)
    return stack(rows)


def draw_band(ax: Axes, x: Any, mean: np.ndarray, half: np.ndarray, color: Any, ls: str = "-") -> Line2D:
    (line,) = ax.plot(x, mean, color=color, ls=ls, lw=1.5)
    if np.isfinite(half).any():
        ax.fill_between(x, mean - half, mean + half, color=color, alpha=BAND_ALPHA, lw=0)
    return line


def curve_into(ax: Axes, g: Group, names: str | Sequence[str], smooth: int, color: Any, ls: str = "-",
                transform: Any = None) -> tuple[str | None, Line2D | None, np.ndarray | None]:  # fmt: skip
    name = first_logged(g.runs, names)
    if name is None:
        return None, None, None
    mean, half, _ = t_interval(series(g, name, smooth, transform))
    return name, draw_band(ax, np.arange(len(mean)), mean, half, color, ls), mean
