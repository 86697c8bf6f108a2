"""Regime diagnosis from a run's own metrics over a trailing window (host side, between iterations).

Regimes (thresholds are fields of :class:`klrl.config.run.DiagnosisConfig`):

* ``frozen``: the mean KL over the window is under ``kl_floor`` (nats per sequence) and the proxy
  reward improved by less than ``proxy_min_gain`` across the window: beta is too large.
* ``hacking``: the proxy rises while gold falls over the window (both trends beyond
  ``trend_min``), or the oracle perplexity (else the independent-LM one) over the window is more
  than ``ppl_margin`` above the reference's (its mean over the first 5 iterations, when the policy
  is still the reference): beta is too small for this reward model.
* ``healthy``: neither.

Text runs (the ``text`` task logs ``text/distinct_2``) have no gold reward and usually no oracle:
then hacking is read from the independent evaluator LM's perplexity of the samples
(``eval/independent_ppl``, with ``model.eval_path``), else the reference model's
(``eval/ref_ppl``), rising more than ``ppl_margin`` above its start, or from the samples' diversity
collapsing: ``text/distinct_2`` over the window more than ``distinct_drop`` below its start
(repeating the words the reward likes). Frozen is read as everywhere, from the KL and the task reward.

Under an adaptive controller the beta trend is read too: beta falling steadily means the KL target
is looser than the reward needs; rising steadily means it is tighter.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from klrl.config import DiagnosisConfig

REGIMES = ("healthy", "frozen", "hacking")


def _first(history: dict[str, np.ndarray], *names: str) -> np.ndarray | None:
    for n in names:
        if n in history and len(history[n]):
            return np.asarray(history[n], float)
    return None


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


def diagnose(history: dict[str, Any], t: int, cfg: DiagnosisConfig) -> tuple[str, str]:
    """The regime at iteration ``t`` (0-based) from ``history[name][: t + 1]``, and a reason."""
    lo = max(0, t + 1 - cfg.window)
    win = {k: np.asarray(v, float)[lo : t + 1] for k, v in history.items()}
    kl = _first(win, "kl/exact_seq_sum", "kl/k1_seq_sum")
    proxy = _first(win, "reward/proxy", "reward/task")
    gold = _first(win, "reward/gold")
    text = "text/distinct_2" in history
    ppl_names = ("eval/oracle_ppl_floored", "eval/independent_ppl") + (("eval/ref_ppl",) if text else ())
    ppl_all = _first(history, *ppl_names)
    if kl is None or proxy is None or t + 1 < cfg.window:
        return "healthy", "warming up"
    g_proxy = _gain(proxy)
    if gold is not None:
        g_gold = _gain(gold)
        significant = _tstat(proxy) > cfg.trend_t and _tstat(gold) < -cfg.trend_t
        if g_proxy > cfg.trend_min and g_gold < -cfg.trend_min and significant:
            return "hacking", f"proxy {g_proxy:+.3g} while gold {g_gold:+.3g} over {len(proxy)} iterations"
    if ppl_all is not None:
        base = float(np.mean(ppl_all[: min(5, len(ppl_all))]))  # the reference's: the first iterations
        now = float(np.mean(ppl_all[lo : t + 1]))
        if np.isfinite(base) and now > base * (1 + cfg.ppl_margin):
            return (
                "hacking",
                f"perplexity {now:.3g} is {100 * (now / base - 1):.0f}% above the reference's ({base:.3g})",
            )
    distinct = _first(history, "text/distinct_2") if text else None
    if distinct is not None:
        base = float(np.mean(distinct[: min(5, len(distinct))]))
        now = float(np.mean(distinct[lo : t + 1]))
        if np.isfinite(base) and base > 0 and now < base * (1 - cfg.distinct_drop):
            return (
                "hacking",
                f"distinct-2 {now:.3g} is {100 * (1 - now / base):.0f}% below its start ({base:.3g})",
            )
    if float(np.mean(kl)) < cfg.kl_floor and g_proxy < cfg.proxy_min_gain:
        return "frozen", f"KL {np.mean(kl):.3g} nats/seq under {cfg.kl_floor}, proxy gain {g_proxy:+.3g}"
    return "healthy", f"KL {np.mean(kl):.3g} nats/seq, proxy gain {g_proxy:+.3g}"


def beta_trend(history: dict[str, Any], t: int, cfg: DiagnosisConfig) -> str:
    """``'falling'``, ``'rising'`` or ``''``: a steady trend of log beta over the window."""
    beta = _first(history, "ctrl/beta")
    if beta is None or t + 1 < cfg.window:
        return ""
    b = np.log(np.maximum(beta[max(0, t + 1 - cfg.window) : t + 1], 1e-12))
    d = np.diff(b)
    change = b[-1] - b[0]
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

    A new regime is reported once it has held for ``cfg.persist`` consecutive iterations
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
        regime, why = diagnose(self.history, t, self.cfg)
        self.count = self.count + 1 if regime == self.candidate else 1
        self.candidate = regime
        if regime != self.regime and (self.count >= self.cfg.persist or not self.regime):
            new.append({"iteration": t, "event": "regime", "regime": regime, "message": f"{regime}: {why}"})
            self.regime = regime
        if self.adaptive:
            trend = beta_trend(self.history, t, self.cfg)
            self.t_count = self.t_count + 1 if trend == self.t_candidate else 1
            self.t_candidate = trend
            if trend != self.trend and self.t_count >= self.cfg.persist:
                if trend:
                    new.append(
                        {
                            "iteration": t,
                            "event": "beta_trend",
                            "regime": regime,
                            "message": TREND_NOTES[trend],
                        }
                    )
                self.trend = trend
        self.events.extend(new)
        return new


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
