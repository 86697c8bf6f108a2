"""Regime diagnosis from a run's own metrics over a trailing window (host side, between iterations).

Regimes (thresholds are fields of :class:`klrl.config.run.DiagnosisConfig`):

* ``frozen``: the mean KL over the window is under ``kl_floor`` (nats per sequence) and the proxy
  reward improved by less than ``proxy_min_gain`` across the window: beta is too large.
* ``hacking``: two signals agree that the proxy is being optimised at the expense of what it stands
  for (one signal alone, e.g. a perplexity near its threshold, is batch noise or fluency drift as
  often as it is hacking):

  - with a gold reward (the testbed), gold decides: the proxy rises while gold falls over the
    window (both changes beyond ``trend_min`` and ``trend_t`` standard errors), or gold is past its
    peak: its window mean is below the best window mean so far by more than ``gold_drop`` of its
    rise (best minus baseline), more than ``trend_min`` and ``trend_t`` standard errors, while the
    proxy has not fallen with it (Gao et al. 2023's overoptimisation: the proxy holds or climbs, gold
    turns down). While gold is not falling a run is not hacking, whatever its perplexity says.
  - without gold (text runs): two of three: the perplexity of the samples (oracle, else the
    independent evaluator LM; text runs: else the reference model, ``eval/ref_ppl``) over the window
    more than ``ppl_margin`` above its baseline; distinct-2 (``text/distinct_2``, else
    ``eval/distinct_2``) more than ``distinct_drop`` below its baseline (repeating what the reward
    likes); the proxy (task reward) above its baseline by more than ``trend_min`` and ``trend_t``
    standard errors.
* ``healthy``: neither.

Baselines are the median of the first ``baseline`` iterations (the policy is still near the
reference there), not the mean of a few batches: one lucky or unlucky batch moves a median little.

Hysteresis: a reported regime is kept while its evidence still holds at ``exit_frac`` of the
thresholds that entered it (enter and exit thresholds differ), and a new regime is reported only
once it has held ``persist`` consecutive iterations, so a signal hovering near its threshold does not
flip the label back and forth.

Under an adaptive controller the beta trend is read too, once the controller has settled: beta
falling steadily means the KL target is looser than the reward needs; rising steadily means it is
tighter. While the controller is still bringing the KL to its target (from the hand-over, after any
warm-up, until the observed KL ``ctrl/kl_observed_*`` first reaches ``ctrl/target``, at most
``settle`` iterations) beta moves because the controller is converging, which says nothing about the
reward; after that a trend must hold over ``trend_window`` iterations (longer than the controller's
time constant, ~16 iterations for the proportional rule at horizon 1000 and batch 64) to count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from klrl.config import DiagnosisConfig

REGIMES = ("healthy", "frozen", "hacking")


def _first(history: dict[str, np.ndarray], *names: str) -> np.ndarray | None:
    for n in names:
        if n in history and len(history[n]) and np.isfinite(np.asarray(history[n], float)).any():
            return np.asarray(history[n], float)
    return None


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


def _gain(x: np.ndarray) -> float:
    """Mean of the second half of ``x`` minus the mean of the first half."""
    h = max(len(x) // 2, 1)
    return float(np.mean(x[-h:]) - np.mean(x[:h]))


def _tstat(x: np.ndarray) -> float:
    """:func:`_gain` over its standard error (Welch), so batch noise alone rarely counts as a trend."""
    h = max(len(x) // 2, 1)
    a, b = x[:h], x[-h:]
    se = np.sqrt(np.var(a) / len(a) + np.var(b) / len(b)) + 1e-12
    return _gain(x) / se


def _baseline(x: np.ndarray, cfg: DiagnosisConfig) -> float:
    """The median of the first ``cfg.baseline`` finite values: the run's own start, robust to one batch."""
    v = _finite(x[: cfg.baseline])
    return float(np.median(v)) if len(v) else float("nan")


def _window_means(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing means of ``w`` values: element j is the mean of ``x[j : j + w]``."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    return (c[w:] - c[:-w]) / w


def _gold_hacking(win: dict, hist: dict, t: int, cfg: DiagnosisConfig, s: float) -> str | None:
    """The reason gold says hacking at iteration ``t``, thresholds scaled by ``s`` (``1`` to enter,
    ``cfg.exit_frac`` to stay), or ``None``."""
    proxy, gold = _first(win, "reward/proxy", "reward/task"), win["reward/gold"]
    g_proxy, g_gold = _gain(proxy), _gain(gold)
    if (g_proxy > s * cfg.trend_min and g_gold < -s * cfg.trend_min
            and _tstat(proxy) > s * cfg.trend_t and _tstat(gold) < -s * cfg.trend_t):  # fmt: skip
        return f"proxy {g_proxy:+.3g} while gold {g_gold:+.3g} over {len(proxy)} iterations"
    w = len(gold)
    gold_all = np.asarray(hist["reward/gold"], float)[: t + 1]
    proxy_all = _first(hist, "reward/proxy", "reward/task")[: t + 1]
    if not (np.isfinite(gold_all).all() and np.isfinite(proxy_all).all()):
        return None
    means = _window_means(gold_all, w)
    best = int(np.argmax(means))
    drop, rise = float(means[best] - means[-1]), float(means[best] - _baseline(gold_all, cfg))
    se = float(np.std(gold) * np.sqrt(2.0 / w))
    p_gain = float(np.mean(proxy) - _window_means(proxy_all, w)[best])
    if drop > s * max(cfg.trend_min, cfg.gold_drop * rise, cfg.trend_t * se) and p_gain > s * cfg.trend_min:
        return (
            f"gold {means[-1]:+.3g} is {drop:.3g} below its peak ({means[best]:+.3g}, iteration "
            f"{best + w - 1}) while the proxy rose {p_gain:+.3g} since"
        )
    return None


def _fluency_hacking(win: dict, hist: dict, t: int, cfg: DiagnosisConfig, s: float) -> str | None:
    """Without gold: two of perplexity up, diversity down, proxy up (each against its baseline)."""
    text = "text/distinct_2" in hist
    ppl_names = ("eval/oracle_ppl_floored", "eval/independent_ppl") + (("eval/ref_ppl",) if text else ())
    signals = []
    ppl = _first(hist, *ppl_names)
    if ppl is not None:
        base, now = _baseline(ppl, cfg), _finite(ppl[max(0, t + 1 - cfg.window) : t + 1])
        if len(now) and base > 0 and np.mean(now) > base * (1 + s * cfg.ppl_margin):
            signals.append(
                f"perplexity {np.mean(now):.3g} is {100 * (np.mean(now) / base - 1):.0f}% above "
                f"its start ({base:.3g})"
            )
    distinct = _first(hist, "text/distinct_2", "eval/distinct_2")
    if distinct is not None:
        base, now = _baseline(distinct, cfg), _finite(distinct[max(0, t + 1 - cfg.window) : t + 1])
        if len(now) and base > 0 and np.mean(now) < base * (1 - s * cfg.distinct_drop):
            drop = 100 * (1 - np.mean(now) / base)
            signals.append(f"distinct-2 {np.mean(now):.3g} is {drop:.0f}% below its start ({base:.3g})")
    proxy = _first(win, "reward/proxy", "reward/task")
    p_all = _first(hist, "reward/proxy", "reward/task")[: t + 1]
    start = _finite(p_all[: cfg.baseline])
    if not len(start):
        return None
    gain = float(np.mean(proxy) - np.median(start))
    se = float(np.sqrt(np.var(proxy) / len(proxy) + np.var(start) / len(start))) + 1e-12
    if gain > s * cfg.trend_min and gain / se > s * cfg.trend_t:
        signals.append(f"proxy {gain:+.3g} above its start")
    return " and ".join(signals) if len(signals) >= 2 else None


def _evidence(history: dict[str, Any], t: int, cfg: DiagnosisConfig, s: float) -> dict[str, str]:
    """Every regime whose evidence holds at iteration ``t`` with thresholds scaled by ``s``: its reason."""
    lo = max(0, t + 1 - cfg.window)
    win = {k: np.asarray(v, float)[lo : t + 1] for k, v in history.items()}
    kl = _first(win, "kl/exact_seq_sum", "kl/k1_seq_sum")
    proxy = _first(win, "reward/proxy", "reward/task")
    if kl is None or proxy is None:  # e.g. a window of skipped (non-finite) iterations
        return {"healthy": "no finite KL or proxy reward in the window"}
    out = {}
    gold = _first(win, "reward/gold")
    hist = {k: np.asarray(v, float) for k, v in history.items()}
    why = (_gold_hacking if gold is not None else _fluency_hacking)(win, hist, t, cfg, s)
    if why:
        out["hacking"] = why
    g_proxy = _gain(proxy)
    kl_mean = float(np.mean(_finite(kl))) if len(_finite(kl)) else float("nan")
    if kl_mean < cfg.kl_floor / s and g_proxy < cfg.proxy_min_gain / s:
        out["frozen"] = f"KL {kl_mean:.3g} nats/seq under {cfg.kl_floor}, proxy gain {g_proxy:+.3g}"
    out["healthy"] = f"KL {kl_mean:.3g} nats/seq, proxy gain {g_proxy:+.3g}"
    return out


def diagnose(history: dict[str, Any], t: int, cfg: DiagnosisConfig, current: str = "") -> tuple[str, str]:
    """The regime at iteration ``t`` (0-based) from ``history[name][: t + 1]``, and a reason.

    ``current`` (the regime reported so far) is kept while its evidence holds at ``cfg.exit_frac`` of
    the thresholds that enter it (hysteresis); otherwise the regimes are read at full thresholds,
    hacking before frozen."""
    if _first(history, "kl/exact_seq_sum", "kl/k1_seq_sum") is None or t + 1 < cfg.window:
        return "healthy", "warming up"
    if _first(history, "reward/proxy", "reward/task") is None:
        return "healthy", "warming up"
    if current in ("hacking", "frozen"):
        held = _evidence(history, t, cfg, cfg.exit_frac)
        if current in held:
            return current, held[current]
    ev = _evidence(history, t, cfg, 1.0)
    regime = next(r for r in ("hacking", "frozen", "healthy") if r in ev)
    return regime, ev[regime]


def settled_at(history: dict[str, Any], t: int, cfg: DiagnosisConfig) -> int | None:
    """The iteration from which an adaptive controller has settled, or ``None`` while it is settling.

    The hand-over is the last iteration before beta first moves (after a warm-up at fixed beta, the
    warm-up's end); the controller has settled once the 10-iteration mean of its observed KL
    (``ctrl/kl_observed_*``) has crossed its target (``ctrl/target``) after the hand-over, or
    ``cfg.settle`` iterations after it."""
    beta = np.asarray(history["ctrl/beta"], float)[: t + 1]
    moved = np.flatnonzero(np.diff(beta) != 0)
    if not len(moved):
        return None
    handover = int(moved[0])
    end = handover + cfg.settle
    kl_name = next((k for k in history if k.startswith("ctrl/kl_observed_")), None)
    if kl_name is not None and "ctrl/target" in history:
        err = (np.asarray(history[kl_name], float) - np.asarray(history["ctrl/target"], float))[: t + 1]
        err = _window_means(err[handover:], min(10, len(err) - handover))  # 10-iteration means: not one batch
        crossed = np.flatnonzero(np.sign(err) != np.sign(err[0]))
        if len(crossed):
            end = min(end, handover + int(crossed[0]) + min(10, t + 1 - handover) - 1)
    return end if end <= t else None


def beta_trend(history: dict[str, Any], t: int, cfg: DiagnosisConfig) -> str:
    """``'falling'``, ``'rising'`` or ``''``: a steady trend of log beta over the ``cfg.trend_window``
    iterations up to ``t``, read only once the controller has settled (:func:`settled_at`)."""
    beta = _first(history, "ctrl/beta")
    if beta is None:
        return ""
    start = settled_at(history, t, cfg)
    if start is None or t + 1 - start < cfg.trend_window:
        return ""
    b = np.log(np.maximum(beta[t + 1 - cfg.trend_window : t + 1], 1e-12))
    change = np.polyfit(np.arange(len(b)), b, 1)[0] * (len(b) - 1)  # least-squares, not two noisy ends
    d = np.diff(b)
    if change < -cfg.beta_trend and np.mean(d < 0) > 0.7:
        return "falling"
    if change > cfg.beta_trend and np.mean(d > 0) > 0.7:
        return "rising"
    return ""


TREND_NOTES = {
    "falling": "beta falling steadily: the KL target is looser than the reward needs",
    "rising": "beta rising steadily: the KL target is tighter than the reward needs",
}


class Tracker:
    """Feeds iterations one by one; returns events when the regime changes.

    A new regime is reported once it has held for ``cfg.persist`` consecutive iterations, and the
    regime reported is kept while its evidence holds at ``cfg.exit_frac`` of its thresholds
    (hysteresis: batch noise near a threshold does not flicker the diagnosis).
    """

    def __init__(self, cfg: DiagnosisConfig, adaptive: bool = False):
        self.cfg, self.adaptive = cfg, adaptive
        self.history: dict[str, list[float]] = {}
        self.regime, self.trend = "", ""
        self.candidate, self.count = "", 0
        self.t_candidate, self.t_count = "", 0
        self.events: list[dict[str, Any]] = []

    def update(self, t: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
        for k, v in metrics.items():
            self.history.setdefault(k, []).append(float(v))
        new = []
        regime, why = diagnose(self.history, t, self.cfg, current=self.regime)
        self.count = self.count + 1 if regime == self.candidate else 1
        self.candidate = regime
        if regime != self.regime and (self.count >= self.cfg.persist or not self.regime):
            new.append({"iteration": t, "event": "regime", "regime": regime, "message": f"{regime}: {why}"})
            self.regime = regime
        if self.adaptive:
            new += self._trend(t)
        self.events.extend(new)
        return new

    def _trend(self, t: int) -> list[dict[str, Any]]:
        trend = beta_trend(self.history, t, self.cfg)
        self.t_count = self.t_count + 1 if trend == self.t_candidate else 1
        self.t_candidate = trend
        if trend == self.trend or self.t_count < self.cfg.persist:
            return []
        self.trend = trend
        if not trend:
            return []
        return [{"iteration": t, "event": "beta_trend", "regime": self.regime, "message": TREND_NOTES[trend]}]


def timeline(history: dict[str, Any], cfg: DiagnosisConfig, adaptive: bool = False) -> list[dict[str, Any]]:
    """Replay a finished run's metrics through a :class:`Tracker`: the list of change events."""
    tr = Tracker(cfg, adaptive)
    n = len(next(iter(history.values()))) if history else 0
    for t in range(n):
        tr.update(t, {k: v[t] for k, v in history.items()})
    return tr.events


def final_regime(history: dict[str, Any], cfg: DiagnosisConfig) -> str:
    """The regime the tracker reports at the end of the run (with hysteresis)."""
    events = [e for e in timeline(history, cfg) if e["event"] == "regime"]
    return events[-1]["regime"] if events else "healthy"
