"""The statistics behind :mod:`klrl.analysis.plots` and :mod:`klrl.analysis.report`: seed groups,
t-intervals over seeds, trailing-window means, metric units.

A *setting* is a config up to ``train.seed`` (and the fields that only name a run,
:data:`NOT_SETTING`): runs that differ only in their seed form one :class:`Group`, summarised by
the mean over seeds and the 95% Student-t interval of that mean,
``mean +- t_{0.975, n-1} * s / sqrt(n)`` (``s`` the sample standard deviation, ``ddof=1``; no
interval for ``n < 2``). "Final" values are trailing-window means: the mean of the finite values
over the last ``w`` iterations (:func:`tail_mean`, defined beside the run-result type in
:mod:`klrl.io.results`, which the run loop's final metrics use too). The functions take anything
with ``.config`` (a :class:`~klrl.config.run.RunConfig`) and ``.metrics`` (``{name: array over
iterations}``), i.e. a ``RunResult``, so this module imports no run code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from klrl.io.results import finite_mean, tail_mean
from klrl.registry import CONTROLLERS

LEVEL = 0.95
SEED_FIELD = "train.seed"
# fields that name a run, set what it prints or where a cache lives: runs differing in them are the
# same setting
NOT_SETTING = ("train.name", "train.out_dir", "train.log_every", "train.quiet", "task.cache_dir")

__all__ = [
    "Group",
    "first_logged",
    "fit_gao",
    "gao_curve",
    "label",
    "metric_label",
    "seed_groups",
    "setting_key",
    "stack",
    "t_interval",
    "t_quantile",
    "tail_mean",
    "trailing_mean",
    "unit_of",
    "window_means",
]


# ---- seed groups ---------------------------------------------------------------------------------
def setting_key(cfg: Any) -> str:
    """The config as canonical JSON without ``train.seed`` and the fields that only name or report a
    run (:data:`NOT_SETTING`): equal keys = runs differing only in their seed."""
    d = cfg.to_dict()
    drop = {SEED_FIELD, *NOT_SETTING}
    d = {s: {k: v for k, v in f.items() if f"{s}.{k}" not in drop} for s, f in d.items()}
    return json.dumps(d, sort_keys=True, default=str)


@dataclass(frozen=True)
class Group:
    """Runs of one setting (their configs equal up to ``train.seed``), in the order given."""

    runs: tuple[Any, ...]

    @property
    def config(self) -> Any:
        return self.runs[0].config

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(r.config.train.seed for r in self.runs)

    @property
    def n(self) -> int:
        return len(self.runs)


def seed_groups(results: Sequence[Any]) -> list[Group]:
    """Group runs by setting, groups in the order of their first run."""
    by: dict[str, list[Any]] = {}
    for r in results:
        by.setdefault(setting_key(r.config), []).append(r)
    return [Group(tuple(rs)) for rs in by.values()]


def first_logged(runs: Sequence[Any], names: str | Sequence[str]) -> str | None:
    """The first of ``names`` that some run logs with at least one finite value (one name per group,
    so that all seeds of a group show the same metric)."""
    for n in (names,) if isinstance(names, str) else names:
        for r in runs:
            v = r.metrics.get(n)
            if v is not None and len(v) and np.isfinite(np.asarray(v, float)).any():
                return n
    return None


# ---- statistics ----------------------------------------------------------------------------------
def t_quantile(df: Any, level: float = LEVEL) -> np.ndarray:
    """``t_{(1 + level) / 2, df}``, the two-sided Student-t quantile; NaN for ``df < 1``."""
    from scipy.stats import t

    df = np.asarray(df, float)
    return np.where(df >= 1, t.ppf((1 + level) / 2, np.maximum(df, 1)), np.nan)


def t_interval(x: Any, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean, half, n)`` over axis 0 (seeds) of ``x``, NaN entries being missing values.

    ``half = t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation
    (``ddof=1``): the interval is ``mean +- half``; ``half`` is NaN where ``n < 2`` and ``mean``
    where ``n = 0``.
    """
    x = np.asarray(x, float)
    ok = np.isfinite(x)
    n = ok.sum(axis=0)
    x0 = np.where(ok, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, x0.sum(axis=0) / np.maximum(n, 1), np.nan)
        ss = np.where(ok, (x0 - mean) ** 2, 0.0).sum(axis=0)
        sd = np.sqrt(ss / np.maximum(n - 1, 1))
        half = np.where(n >= 2, t_quantile(n - 1, level) * sd / np.sqrt(np.maximum(n, 1)), np.nan)
    return mean, half, n


def stack(arrays: Sequence[Any]) -> np.ndarray:
    """``[len(arrays), max length]``, shorter arrays padded with NaN (missing)."""
    arrays = [np.asarray(a, float).ravel() for a in arrays]
    out = np.full((len(arrays), max((len(a) for a in arrays), default=0)), np.nan)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out


def trailing_mean(v: Any, w: int) -> np.ndarray:
    """``out[i]`` = mean of the finite values among ``v[max(0, i - w + 1) : i + 1]`` (NaN if none)."""
    v = np.asarray(v, float)
    ok = np.isfinite(v)
    c = np.cumsum(np.insert(np.where(ok, v, 0.0), 0, 0.0))
    k = np.cumsum(np.insert(ok.astype(float), 0, 0.0))
    hi = np.arange(1, len(v) + 1)
    lo = np.maximum(hi - max(int(w), 1), 0)
    cnt = k[hi] - k[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (c[hi] - c[lo]) / np.maximum(cnt, 1), np.nan)


def window_means(v: Any, w: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ends, means)``: means over the non-overlapping ``w``-iteration windows ending at
    ``ends = ..., N - 1 - w, N - 1`` (aligned on the last iteration, so the last mean is
    :func:`tail_mean`); the first ``N mod w`` iterations are left out."""
    v = np.asarray(v, float)
    w = max(int(w), 1)
    ends = np.arange(len(v) - 1, w - 2, -w)[::-1]
    return ends, np.array([finite_mean(v[e - w + 1 : e + 1]) for e in ends])


# ---- Gao et al. (2023) ---------------------------------------------------------------------------
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


# ---- units ---------------------------------------------------------------------------------------
def unit_of(name: str) -> str:
    """The unit of a logged metric, from its name (the KL unit is in the name: ``seq_sum``,
    ``token_mean``); ``a.u.`` (arbitrary units) for rewards and anything unknown."""
    if name.startswith("kl/beta_x_"):
        return "reward a.u."  # beta x nats: the penalty in the reward's units
    if name.endswith("seq_sum"):
        return "nats/sequence"
    if name.endswith("token_mean"):
        return "nats/token"
    if name == "ctrl/beta":
        return "reward a.u. per nat"
    if name.endswith(("_ppl", "_ppl_floored")):
        return "exp(nats/token)"
    if "distinct" in name or name.endswith("_frac"):
        return "fraction"
    if name == "response/length":
        return "tokens"
    return "a.u."


_QUANTITY = {
    "ctrl/beta": "beta",
    "reward/proxy": "proxy reward",
    "reward/task": "task reward",
    "reward/gold": "gold reward",
    "eval/oracle_ppl_floored": "oracle perplexity (floored)",
    "eval/independent_ppl": "independent-LM perplexity",
    "eval/ref_ppl": "reference perplexity",
    "eval/distinct_1": "distinct-1",
    "eval/distinct_2": "distinct-2",
    "response/length": "response length",
}


def metric_label(names: str | Sequence[str | None], quantity: str | None = None) -> str:
    """An axis label ``'<quantity> [<metric names>] (<unit>)'``, the unit the first name's; with a
    ``quantity`` and several names, ``'<quantity> (<unit>)'`` (a legend names the metrics). A long
    label puts the unit on a second line."""
    names = [n for n in ((names,) if isinstance(names, str) else names) if n]
    names = list(dict.fromkeys(names))
    if not names:
        return f"{quantity or 'value'} (a.u.)"
    unit = f"({unit_of(names[0])})"
    if quantity is not None and len(names) > 1:  # the names are in the legend
        text = quantity
    else:
        if quantity is None:
            kl = names[0].startswith(("kl/", "ctrl/kl"))
            quantity = _QUANTITY.get(names[0]) or ("KL" if kl else names[0])
        text = f"{quantity} [{', '.join(names)}]"
    return f"{text}{chr(10) if len(text) + len(unit) > 28 else ' '}{unit}"  # long: the unit on a 2nd line


def label(r: Any) -> str:
    """A short label from the config (of a run result: anything with ``.config``, or a config): the
    controller, its target and gains, or the fixed beta."""
    cfg = getattr(r, "config", r)
    c, beta = cfg.ctrl, cfg.kl.beta
    meta = CONTROLLERS.meta(c.kind)  # the controller registry's label and whether the kind moves beta
    if not meta.get("adaptive", True):
        return f"{c.kind} beta={beta:g}"
    gains = meta.get("label", lambda c: "")(c)
    unit = "/tok" if c.unit == "token_mean" else ""
    warm = f" warmup={c.warmup_iters}@{c.warmup_beta:g}" if c.warmup_iters else ""
    return f"{c.kind} target={c.target:g}{unit} {gains} beta0={beta:g}{warm}".replace("  ", " ")
