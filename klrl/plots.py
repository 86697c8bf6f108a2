"""Figures of a run or a beta study: each function takes one :class:`~klrl.runner.RunResult` or a list
of them and returns a :class:`matplotlib.figure.Figure`.

Figures are built with matplotlib's object API (``Figure``, not ``pyplot``): nothing is shown, no
GUI backend is touched and nothing is kept alive by a figure manager, so the functions work
headless (``fig.savefig`` renders with Agg) and in notebooks alike. A metric a run does not log is
skipped; a panel with nothing to show says so.

KL is in nats per sequence (the exact KL ``kl/exact_seq_sum`` where the run logs it, else the
sampled ``kl/seq_sum``), unless stated otherwise in the axis label.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from klrl.config import RunConfig
from klrl.registry import CONTROLLERS
from klrl.results import RunResult

KL_SEQ = ("kl/exact_seq_sum", "kl/seq_sum")
KL_TOKEN = ("kl/exact_token_mean", "kl/token_mean")
PROXY = ("reward/proxy", "reward/task")
GOLD = "reward/gold"
PERPLEXITIES = ("eval/oracle_ppl", "eval/independent_ppl", "eval/ref_ppl")
DIVERSITY = ("eval/distinct_1", "eval/distinct_2")
_STYLES = ("-", "--", ":", "-.")

__all__ = [
    "beta_kl",
    "controller_comparison",
    "fit_gao",
    "frontier",
    "gao_curve",
    "label",
    "overoptimization",
    "perplexity_diversity",
]


# ---- helpers -------------------------------------------------------------------------------------
def _as_list(results: RunResult | Sequence[RunResult]) -> list[RunResult]:
    return [results] if isinstance(results, RunResult) else list(results)


def _first(r: RunResult, names: Sequence[str]) -> tuple[str, np.ndarray] | tuple[None, None]:
    """The first of ``names`` the run logs (with at least one finite value)."""
    for n in names:
        v = r.metrics.get(n)
        if v is not None and len(v) and np.isfinite(np.asarray(v, float)).any():
            return n, np.asarray(v, float)
    return None, None


def _adaptive(r: RunResult) -> bool:
    return r.config.ctrl.kind != "fixed"


def label(r: RunResult | RunConfig) -> str:
    """A short label from the config: the controller, its target and gains, or the fixed beta."""
    cfg = r.config if isinstance(r, RunResult) else r
    c, beta = cfg.ctrl, cfg.kl.beta
    if c.kind == "fixed":
        return f"fixed beta={beta:g}"
    gains = CONTROLLERS.meta(c.kind).get("label", lambda c: "")(c)  # the controller registry's label
    unit = "/tok" if c.unit == "token_mean" else ""
    warm = f" warmup={c.warmup_iters}@{c.warmup_beta:g}" if c.warmup_iters else ""
    return f"{c.kind} target={c.target:g}{unit} {gains} beta0={beta:g}{warm}"


def _labels(results: list[RunResult]) -> list[str]:
    """:func:`label` per run; the seed is added where seeds differ, an index where labels still collide."""
    out = [label(r) for r in results]
    if len({r.config.train.seed for r in results}) > 1:
        out = [f"{s} seed={r.config.train.seed}" for s, r in zip(out, results, strict=True)]
    if len(set(out)) < len(out):
        out = [f"{i:02d}: {s}" for i, s in enumerate(out)]
    return out


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "viridis"]
    return [cmap(i if n <= 10 else i / max(n - 1, 1)) for i in range(n)]


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _legend(ax: Axes, runs: Sequence[tuple[str, Any]] = (), kinds: Sequence[tuple[str, dict]] = ()) -> None:
    """A legend of the runs (colour) and of the kinds of line (style, marker), one entry each,
    plus any labelled artists; outside the axes on the right when it is long."""
    from matplotlib.lines import Line2D

    handles, texts = ax.get_legend_handles_labels()
    for text, col in runs:
        handles.append(Line2D([], [], color=col, lw=2))
        texts.append(text)
    if len(kinds) > 1:
        for text, style in kinds:
            handles.append(Line2D([], [], color="k", **{"lw": 1, **style}))
            texts.append(text)
    if not handles:
        return
    if len(handles) > 4:
        ax.legend(handles, texts, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(handles, texts, fontsize="small")


def _log_if_positive(ax: Axes, arrays: list[np.ndarray]) -> None:
    vals = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.array([])
    if len(vals) and np.all(vals > 0) and vals.max() / vals.min() > 20:
        ax.set_yscale("log")


def _kl_unit(results: list[RunResult]) -> tuple[tuple[str, ...], str]:
    """KL names and unit for a figure: per token only if every adaptive run targets nats/token."""
    adaptive = [r for r in results if _adaptive(r)]
    if adaptive and all(r.config.ctrl.unit == "token_mean" for r in adaptive):
        return KL_TOKEN, "nats/token"
    return KL_SEQ, "nats/sequence"


def _kl_label(names: list[str | None], unit: str) -> str:
    seen = sorted({n for n in names if n})
    return f"KL ({', '.join(seen) or 'none'}) [{unit}]"


def _iters(v: np.ndarray) -> np.ndarray:
    return np.arange(len(v))


# ---- figures -------------------------------------------------------------------------------------
def beta_kl(results: RunResult | Sequence[RunResult]) -> Figure:
    """Beta (top) and KL against the controller's target (bottom) over iterations, one colour per run.

    The target (``ctrl/target``, else ``config.ctrl.target``) is drawn dashed for adaptive
    controllers; KL is per token instead of per sequence when every adaptive run targets
    nats/token (``ctrl.unit='token_mean'``), so that KL and target share a unit.
    """
    rs = _as_list(results)
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax_b, ax_k = fig.subplots(2, 1, sharex=True)
    names, unit = _kl_unit(rs)
    betas, kl_names, runs, targets = [], [], [], False
    for r, lab, col in zip(rs, _labels(rs), _colors(len(rs)), strict=True):
        _, beta = _first(r, ("ctrl/beta",))
        name, kl = _first(r, names)
        if beta is None and kl is None:
            continue
        runs.append((lab, col))
        if beta is not None:
            ax_b.plot(_iters(beta), beta, color=col)
            betas.append(beta)
        kl_names.append(name)
        if kl is None:
            continue
        ax_k.plot(_iters(kl), kl, color=col)
        if _adaptive(r) and (unit == "nats/token") == (r.config.ctrl.unit == "token_mean"):
            _, tgt = _first(r, ("ctrl/target",))
            tgt = tgt if tgt is not None else np.full(len(kl), r.config.ctrl.target)
            ax_k.plot(_iters(tgt), tgt, color=col, ls="--", lw=1)
            targets = True
    if betas:
        _log_if_positive(ax_b, betas)
        ax_b.set_ylabel("beta (ctrl/beta)")
        _legend(ax_b, runs)
    else:
        _empty(ax_b, "ctrl/beta")
    if any(kl_names):
        ax_k.set_ylabel(_kl_label(kl_names, unit))
        ax_k.set_xlabel("iteration")
        _legend(ax_k, kinds=[("KL", {}), ("target (ctrl/target)", {"ls": "--"})] if targets else ())
    else:
        _empty(ax_k, "KL")
    ax_b.set_title("beta and KL")
    return fig


def frontier(results: RunResult | Sequence[RunResult]) -> Figure:
    """Reward against KL, one curve per run: proxy (``reward/proxy``, else ``reward/task``) solid,
    gold (``reward/gold``, where logged) dashed in the same colour."""
    rs = _as_list(results)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    kl_names, runs, kinds = [], [], {}
    for r, lab, col in zip(rs, _labels(rs), _colors(len(rs)), strict=True):
        kname, kl = _first(r, KL_SEQ)
        pname, proxy = _first(r, PROXY)
        _, gold = _first(r, (GOLD,))
        if kl is None or (proxy is None and gold is None):
            continue
        kl_names.append(kname)
        runs.append((lab, col))
        if proxy is not None:
            ax.plot(kl, proxy, color=col, marker=".", ms=3, lw=1)
            kinds[pname] = {"marker": "."}
        if gold is not None:
            ax.plot(kl, gold, color=col, ls="--", marker=".", ms=3, lw=1)
            kinds[GOLD] = {"ls": "--", "marker": "."}
    if not runs:
        _empty(ax, "reward or KL")
        return fig
    ax.set_xlabel(_kl_label(kl_names, "nats/sequence"))
    ax.set_ylabel(" / ".join(kinds) if len(kinds) > 1 else next(iter(kinds)))
    ax.set_title("reward-KL frontier")
    _legend(ax, runs, list(kinds.items()))
    return fig


def fit_gao(d: Any, r: Any) -> tuple[float, float]:
    """Least-squares ``(alpha, b)`` of the Gao et al. (2023) RL form ``R(d) = d (alpha - b log d)``.

    ``d = sqrt(KL)`` and ``R`` the gold reward gain over the initial policy (``R(0) = 0``). The form
    is linear in the coefficients, ``R = alpha d - b d log d`` (with ``d log d = 0`` at ``d = 0``),
    so this is one linear least-squares solve. Non-finite pairs and ``d < 0`` are dropped; fewer
    than two usable points raise :class:`ValueError`.
    """
    d = np.asarray(d, float).ravel()
    r = np.asarray(r, float).ravel()
    if d.shape != r.shape:
        raise ValueError(f"fit_gao: d and r differ in length ({len(d)} != {len(r)})")
    ok = np.isfinite(d) & np.isfinite(r) & (d >= 0)
    d, r = d[ok], r[ok]
    if len(d) < 2 or np.count_nonzero(d) < 2:
        raise ValueError(f"fit_gao: needs at least two points with d > 0 (got {np.count_nonzero(d)})")
    dlogd = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    a = np.stack([d, -dlogd], axis=1)
    (alpha, b), *_ = np.linalg.lstsq(a, r, rcond=None)
    return float(alpha), float(b)


def gao_curve(d: Any, alpha: float, b: float) -> np.ndarray:
    """``R(d) = d (alpha - b log d)``, with ``R(0) = 0``."""
    d = np.asarray(d, float)
    return np.where(d > 0, d * (alpha - b * np.log(np.where(d > 0, d, 1.0))), 0.0)


def overoptimization(results: RunResult | Sequence[RunResult], fit: bool = True) -> Figure:
    """Gold (circles) and proxy (crosses) reward gain against ``d = sqrt(KL)``, pooled over runs.

    Rewards are relative to each run's first iteration (the initial policy), as in Gao et al. (2023).
    With ``fit`` the RL form ``R(d) = d (alpha - b log d)`` is fitted to the pooled gold points
    (:func:`fit_gao`) and drawn, its coefficients in the legend.
    """
    rs = _as_list(results)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    kl_names, d_all, g_all, runs, kinds = [], [], [], [], {}
    for r, lab, col in zip(rs, _labels(rs), _colors(len(rs)), strict=True):
        kname, kl = _first(r, KL_SEQ)
        _, gold = _first(r, (GOLD,))
        pname, proxy = _first(r, PROXY)
        if kl is None or (gold is None and proxy is None):
            continue
        kl_names.append(kname)
        runs.append((lab, col))
        d = np.sqrt(np.maximum(kl, 0.0))
        if gold is not None:
            g = gold - gold[0]
            ax.scatter(d, g, s=10, color=col, marker="o")
            d_all.append(d)
            g_all.append(g)
            kinds[GOLD] = {"marker": "o", "ls": "none"}
        if proxy is not None:
            ax.scatter(d, proxy - proxy[0], s=14, color=col, marker="x", lw=0.8)
            kinds[pname] = {"marker": "x", "ls": "none"}
    if not runs:
        _empty(ax, "reward or KL")
        return fig
    if fit and d_all:
        d, g = np.concatenate(d_all), np.concatenate(g_all)
        try:
            alpha, b = fit_gao(d, g)
        except ValueError:
            pass
        else:
            xs = np.linspace(0.0, float(np.nanmax(d)), 200)
            ax.plot(xs, gao_curve(xs, alpha, b), color="k", lw=1.5,
                    label=f"gold fit d(alpha - b log d):\nalpha={alpha:.3g}, b={b:.3g}")  # fmt: skip
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel(f"d = sqrt({_kl_label(kl_names, 'nats/sequence')})")
    ax.set_ylabel("reward - reward at iteration 0")
    ax.set_title("overoptimization (Gao et al. 2023)")
    _legend(ax, runs, list(kinds.items()))
    return fig


def perplexity_diversity(results: RunResult | Sequence[RunResult]) -> Figure:
    """Perplexities (oracle, independent LM, reference; log scale) and distinct-n over iterations.

    Colour is the run, line style the metric; a panel whose metrics no run logs is left out.
    """
    rs = _as_list(results)
    groups = [(PERPLEXITIES, "perplexity of policy samples"), (DIVERSITY, "distinct n-grams (fraction)")]
    logged = lambda names: any(_first(r, (n,))[1] is not None for r in rs for n in names)
    present = [(names, ylabel) for names, ylabel in groups if logged(names)]
    fig = Figure(figsize=(8, 3.2 * max(len(present), 1)), layout="constrained")
    if not present:
        _empty(fig.subplots(), "perplexity or distinct-n")
        return fig
    axes = np.atleast_1d(fig.subplots(len(present), 1, sharex=True))
    labels, colors = _labels(rs), _colors(len(rs))
    for ax, (names, ylabel) in zip(axes, present, strict=True):
        arrays, runs, kinds = [], [], {}
        for r, lab, col in zip(rs, labels, colors, strict=True):
            drawn = False
            for name, ls in zip(names, _STYLES, strict=False):
                _, v = _first(r, (name,))
                if v is not None:
                    ax.plot(_iters(v), v, color=col, ls=ls)
                    arrays.append(v)
                    kinds[name] = {"ls": ls}
                    drawn = True
            if drawn:
                runs.append((lab, col))
        if names is PERPLEXITIES:
            _log_if_positive(ax, arrays)
        ax.set_ylabel(ylabel if len(kinds) > 1 else f"{ylabel}\n({next(iter(kinds))})")
        _legend(ax, runs, list(kinds.items()))
    axes[-1].set_xlabel("iteration")
    axes[0].set_title("perplexity and diversity")
    return fig


def controller_comparison(results: RunResult | Sequence[RunResult]) -> Figure:
    """KL / target (top; 1 is on target) and beta (bottom) over iterations, one line per run.

    The KL is the one the controller sees (``ctrl/kl_observed_<ctrl.unit>``: its estimator, its
    unit), else the exact/sampled KL in that unit; the target is ``ctrl/target`` (else the config's).
    Fixed-beta runs are drawn dotted against the target their config names.
    """
    rs = _as_list(results)
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax_r, ax_b = fig.subplots(2, 1, sharex=True)
    ratios, betas, runs = [], [], []
    for r, lab, col in zip(rs, _labels(rs), _colors(len(rs)), strict=True):
        c = r.config.ctrl
        ls = "-" if _adaptive(r) else ":"
        names = (f"ctrl/kl_observed_{c.unit}", *(KL_TOKEN if c.unit == "token_mean" else KL_SEQ))
        _, kl = _first(r, names)
        _, beta = _first(r, ("ctrl/beta",))
        if kl is None and beta is None:
            continue
        runs.append((lab, col))
        if kl is not None:
            _, tgt = _first(r, ("ctrl/target",))
            tgt = tgt if tgt is not None and len(tgt) == len(kl) else np.full(len(kl), c.target)
            ratio = kl / np.where(tgt > 0, tgt, np.nan)
            ax_r.plot(_iters(ratio), ratio, color=col, ls=ls)
            ratios.append(ratio)
        if beta is not None:
            ax_b.plot(_iters(beta), beta, color=col, ls=ls)
            betas.append(beta)
    if ratios:
        ax_r.axhline(1.0, color="k", lw=0.8, ls="--")
        _log_if_positive(ax_r, ratios)
        ax_r.set_ylabel("KL / target (controller's unit)")
        _legend(ax_r, runs)
    else:
        _empty(ax_r, "KL")
    if betas:
        _log_if_positive(ax_b, betas)
        ax_b.set_ylabel("beta (ctrl/beta)")
        ax_b.set_xlabel("iteration")
        if not ratios:
            _legend(ax_b, runs)
    else:
        _empty(ax_b, "ctrl/beta")
    ax_r.set_title("controller comparison (dotted: fixed beta)")
    return fig
