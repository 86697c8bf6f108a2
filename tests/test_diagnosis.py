"""The regime diagnosis on synthetic metric traces built to show each regime."""

import numpy as np

from klrl.analysis.diagnosis import Tracker, beta_trend, diagnose, final_regime, timeline
from klrl.config import DiagnosisConfig

CFG = DiagnosisConfig(window=20)
T = 100
t = np.arange(T, dtype=float)


def trace(kl, proxy, gold=None, ppl=None, beta=None):
    h = {"kl/exact_seq_sum": kl, "reward/proxy": proxy}
    if gold is not None:
        h["reward/gold"] = gold
    if ppl is not None:
        h["eval/oracle_ppl_floored"] = ppl
    if beta is not None:
        h["ctrl/beta"] = beta
    return h


def test_frozen():
    h = trace(kl=np.full(T, 0.02), proxy=0.5 + 1e-4 * t, gold=0.1 + 0 * t, ppl=np.full(T, 10.0))
    assert final_regime(h, CFG) == "frozen"
    regime, why = diagnose(h, T - 1, CFG)
    assert "KL" in why


def test_hacking_by_gold_falling_while_proxy_rises():
    gold = np.where(t < 50, 0.01 * t, 0.5 - 0.02 * (t - 50))
    h = trace(kl=1 + t, proxy=0.05 * t, gold=gold, ppl=np.full(T, 10.0))
    assert diagnose(h, 40, CFG)[0] == "healthy"  # gold still rising with the proxy
    assert diagnose(h, T - 1, CFG)[0] == "hacking"
    events = timeline(h, CFG)
    regimes = [e["regime"] for e in events]
    assert regimes[0] == "healthy" and regimes[-1] == "hacking"
    assert 50 < events[-1]["iteration"] < 75  # fires once the window sees gold falling


def test_hacking_by_perplexity():
    ppl = 10 * (1 + 0.01 * t)  # twice the start at the end; the window mean passes +50% near t = 60
    h = trace(kl=1 + t, proxy=0.01 * t, gold=0.01 * t, ppl=ppl)
    assert diagnose(h, 30, CFG)[0] == "healthy"
    assert diagnose(h, T - 1, CFG)[0] == "hacking"


def test_healthy():
    h = trace(kl=2 + 0.01 * t, proxy=0.01 * t, gold=0.008 * t, ppl=10 + 0.001 * t)
    assert final_regime(h, CFG) == "healthy"
    assert [e["regime"] for e in timeline(h, CFG)] == ["healthy"]


def test_beta_trend():
    assert beta_trend({"ctrl/beta": 0.1 * np.exp(-0.02 * t)}, T - 1, CFG) == "falling"
    assert beta_trend({"ctrl/beta": 0.1 * np.exp(0.02 * t)}, T - 1, CFG) == "rising"
    assert beta_trend({"ctrl/beta": np.full(T, 0.1)}, T - 1, CFG) == ""
    tr = Tracker(CFG, adaptive=True)
    for i in range(T):
        tr.update(i, {"kl/exact_seq_sum": 3.0, "reward/proxy": 0.0, "ctrl/beta": 0.1 * np.exp(-0.02 * i)})
    assert any(e["event"] == "beta_trend" and "looser" in e["message"] for e in tr.events)


def text_trace(kl, reward, ref_ppl, distinct, independent=None):
    """A text run's metrics: no gold, no oracle; the task reward, the samples' reference perplexity
    and distinct-2 (and an evaluator LM's perplexity when given)."""
    h = {"kl/exact_seq_sum": kl, "reward/task": reward, "eval/ref_ppl": ref_ppl, "text/distinct_2": distinct}
    if independent is not None:
        h["eval/independent_ppl"] = independent
    return h


def test_text_run_frozen_healthy_and_hacking_without_gold():
    flat = np.full(T, 0.8)
    frozen = text_trace(np.full(T, 0.01), np.full(T, 0.2), np.full(T, 12.0), flat)
    assert final_regime(frozen, CFG) == "frozen"
    healthy = text_trace(2 + 0 * t, 0.2 + 0.002 * t, 12 + 0.02 * t, 0.8 - 0.001 * t)
    assert final_regime(healthy, CFG) == "healthy"
    # reward up while distinct-2 collapses (0.8 -> 0.2): repeating the rewarded words
    collapse = text_trace(1 + t, 0.01 * t, np.full(T, 12.0), 0.8 - 0.006 * t)
    regime, why = diagnose(collapse, T - 1, CFG)
    assert regime == "hacking" and "distinct-2" in why
    # the reference's perplexity of the samples rising 12 -> 36 (> 1.5x its start)
    drift = text_trace(1 + t, 0.01 * t, 12 + 0.24 * t, flat)
    regime, why = diagnose(drift, T - 1, CFG)
    assert regime == "hacking" and "perplexity 3" in why
    # an evaluator LM, when given, is read before the reference: flat, so no perplexity hacking
    assert diagnose({**drift, "eval/independent_ppl": np.full(T, 20.0)}, T - 1, CFG)[0] == "healthy"


def test_reference_perplexity_is_not_read_outside_text_runs():
    h = trace(kl=1 + t, proxy=0.01 * t)
    h["eval/ref_ppl"] = 12 + 0.24 * t  # every run logs it; without text metrics it is not a signal
    assert final_regime(h, CFG) == "healthy"
