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


def test_perplexity_alone_does_not_make_hacking_while_gold_rises():
    """Gold decides where it is logged: a perplexity 2x its start with gold still rising is healthy."""
    ppl = 10 * (1 + 0.01 * t)
    h = trace(kl=1 + t, proxy=0.01 * t, gold=0.01 * t, ppl=ppl)
    assert final_regime(h, CFG) == "healthy"


def test_hacking_by_gold_past_its_peak_while_the_proxy_climbs():
    """Gold rose to +0.3 by t = 30 and sank back to -0.1 (more than half its rise, far beyond the
    noise) while the proxy kept rising: hacking, and still hacking once both flatten at the end."""
    gold = np.where(t < 30, 0.01 * t, np.maximum(0.3 - 0.02 * (t - 30), -0.1))
    proxy = np.minimum(0.01 * t, 0.6)
    h = trace(kl=1 + t, proxy=proxy, gold=gold)
    assert diagnose(h, 25, CFG)[0] == "healthy"
    regime, why = diagnose(h, T - 1, CFG)  # t = 80-99: gold and proxy both flat
    assert regime == "hacking" and "below its peak" in why
    # a dip of gold while the proxy is flat (saturated) is not the proxy being exploited
    assert diagnose(trace(kl=1 + t, proxy=np.full(T, 0.5), gold=gold), T - 1, CFG)[0] == "healthy"


def test_healthy():
    h = trace(kl=2 + 0.01 * t, proxy=0.01 * t, gold=0.008 * t, ppl=10 + 0.001 * t)
    assert final_regime(h, CFG) == "healthy"
    assert [e["regime"] for e in timeline(h, CFG)] == ["healthy"]


def test_beta_trend():
    cfg = DiagnosisConfig(window=20, settle=0)  # no settling phase: the trend over the last 50 iterations
    assert beta_trend({"ctrl/beta": 0.1 * np.exp(-0.02 * t)}, T - 1, cfg) == "falling"
    assert beta_trend({"ctrl/beta": 0.1 * np.exp(0.02 * t)}, T - 1, cfg) == "rising"
    assert beta_trend({"ctrl/beta": np.full(T, 0.1)}, T - 1, cfg) == ""
    tr = Tracker(cfg, adaptive=True)
    for i in range(T):
        tr.update(i, {"kl/exact_seq_sum": 3.0, "reward/proxy": 0.0, "ctrl/beta": 0.1 * np.exp(-0.02 * i)})
    assert any(e["event"] == "beta_trend" and "looser" in e["message"] for e in tr.events)


def test_no_beta_trend_while_the_controller_is_settling():
    """beta falls from its start while the KL climbs to its target (reached at t = 120, after a
    warm-up of 50 at fixed beta); the same fall after the KL is at its target is a trend."""
    n = 300
    i = np.arange(n)
    beta = np.where(i < 50, 0.1, 0.1 * np.exp(-0.01 * np.maximum(i - 50, 0)))
    kl = np.where(i < 120, 3.0 * i / 120, 3.0 + 0.1 * np.sin(i))
    h = {"ctrl/beta": beta, "ctrl/kl_observed_seq_sum": kl, "ctrl/target": np.full(n, 3.0)}
    assert [beta_trend(h, k, CFG) for k in range(20, 170)] == [""] * 150  # settling, then < 50 settled
    assert beta_trend(h, 200, CFG) == "falling"
    # never reaching the target: settled after diag.settle iterations at most
    far = {**h, "ctrl/kl_observed_seq_sum": np.full(n, 0.5)}
    assert beta_trend(far, 50 + 200 + 40, CFG) == "" and beta_trend(far, 299, CFG) == "falling"


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


def test_baseline_is_a_median_of_the_start_not_one_lucky_window():
    """The reference perplexity of the first 5 batches happens to be low (15), the next ones sit at
    24 +- 2: against a 5-batch mean (15) the window (24) looks 60% up; against the median of the
    first ``diag.baseline`` (20) iterations it is flat, so the rising reward alone is not hacking."""
    rng = np.random.default_rng(0)
    ppl = np.where(t < 5, 15.0, 24 + 2 * rng.standard_normal(T))
    h = text_trace(1 + 0 * t, 0.01 * t, ppl, np.full(T, 0.8))
    assert final_regime(h, CFG) == "healthy"
    assert diagnose({**h, "eval/ref_ppl": np.where(t < 60, 24.0, 40.0)}, T - 1, CFG)[0] == "hacking"


def test_hysteresis_keeps_a_regime_between_its_exit_and_entry_thresholds():
    """Reward rising throughout; the reference perplexity 10 -> 16 (60% up: enters hacking), back to
    13.5 (35% up: under the 50% that enters, over the 25% (``exit_frac`` 0.5) that keeps it), then
    10.5: one episode, no flicker."""
    n = 200
    i = np.arange(n, dtype=float)
    ppl = np.select([i < 20, i < 60, i < 120], [10.0, 16.0, 13.5], 10.5)
    h = text_trace(np.full(n, 2.0), 0.01 * i, ppl, np.full(n, 0.8))
    events = timeline(h, CFG)
    assert [e["regime"] for e in events] == ["healthy", "hacking", "healthy"]
    assert events[1]["iteration"] < 60 and events[2]["iteration"] > 120


def test_non_finite_windows_are_healthy_not_a_crash():
    """Skipped iterations log NaN: a window without one finite KL or proxy value says so."""
    h = trace(kl=np.where(t < 50, 1.0, np.nan), proxy=np.where(t < 50, 0.01 * t, np.nan), gold=0.01 * t)
    assert diagnose(h, T - 1, CFG) == ("healthy", "no finite KL or proxy reward in the window")
    text = text_trace(1 + t, np.where(t < 30, np.nan, 0.01 * t), 12 + 0.24 * t, np.full(T, 0.8))
    assert diagnose(text, T - 1, CFG)[0] == "healthy"  # no proxy start to compare with: one signal


def test_reference_perplexity_is_not_read_outside_text_runs():
    h = trace(kl=1 + t, proxy=0.01 * t)
    h["eval/ref_ppl"] = 12 + 0.24 * t  # every run logs it; without text metrics it is not a signal
    assert final_regime(h, CFG) == "healthy"


# ---- stored and fresh runs of several seeds (tests/data/diagnosis/runs.json.gz, make_fixture.py) ----
def _runs(**match):
    import gzip
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "data" / "diagnosis" / "runs.json.gz"
    with gzip.open(path, "rt") as f:
        runs = json.load(f)["runs"]
    out = [r for r in runs if all(r[k] == v for k, v in match.items())]
    assert out, match
    return out


def _events(run, adaptive=None):
    adaptive = run["ctrl"] != "fixed" if adaptive is None else adaptive
    return timeline(
        {k: np.asarray(v) for k, v in run["metrics"].items()}, DiagnosisConfig(), adaptive=adaptive
    )


def _name(run):
    return " ".join(f"{k}={run[k]}" for k in ("source", "ctrl", "beta", "kp", "warmup_iters", "task", "seed"))


def test_stored_runs_change_regime_at_most_a_few_times():
    """49 runs of 100-500 iterations: at most one episode (into a regime and back out of it), or on
    beta = 0.001, train seed 6, a second entry after gold climbed to a new peak (iteration 91) in
    between; the diagnosis before issue 30 flipped up to 11 times (a perplexity hovering at its
    threshold)."""
    flips = {_name(r): len([e for e in _events(r) if e["event"] == "regime"]) - 1 for r in _runs()}
    assert max(flips.values()) <= 3, {k: v for k, v in flips.items() if v > 3}
    assert sum(v > 2 for v in flips.values()) <= 1, {k: v for k, v in flips.items() if v > 2}


def test_main_job_proportional_member_is_not_hacking_while_its_gold_rises():
    """The default main job (``python experiments/run.py --study --train.seed S``, seeds 0, 1, 3, 4):
    the proportional member's gold rises to its last window on every seed, so it is never hacking."""
    members = _runs(source="main", ctrl="proportional")
    assert sorted(r["seed"] for r in members) == [0, 1, 3, 4]
    for r in members:
        gold = np.asarray(r["metrics"]["reward/gold"])
        assert gold[-20:].mean() > gold[40:60].mean() > gold[:20].mean()  # rising, by hand
        assert all(e["regime"] != "hacking" for e in _events(r)), _name(r)
        assert not [e for e in _events(r) if e["event"] == "beta_trend"]  # 100 iterations: settling


def test_small_beta_is_hacking_and_large_beta_frozen_on_every_seed():
    """beta = 0.001 (gold falls below its start, KL past 30 nats/seq) ends hacking on train seeds 0, 1,
    2, 5, 6, 7 and task seed 3; beta = 1 (KL under 0.1) ends frozen on seeds 0, 1, 2."""
    small = [r for r in _runs(beta=0.001) if r["source"] != "overoptimization"]
    assert sorted((r["task"], r["seed"]) for r in small) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 5),
        (0, 6),
        (0, 7),
        (3, 0),
    ]
    large = _runs(source="beta_grid", beta=1.0)
    assert sorted(r["seed"] for r in large) == [0, 1, 2]
    for runs, want in ((small, "hacking"), (large, "frozen")):
        for r in runs:
            h = {k: np.asarray(v) for k, v in r["metrics"].items()}
            assert final_regime(h, DiagnosisConfig()) == want, _name(r)
            if want == "hacking":
                assert h["reward/gold"][-10:].mean() < h["reward/gold"][:10].mean()
                assert h["kl/exact_seq_sum"][-10:].mean() > 30


def test_no_beta_trend_message_while_the_stored_controllers_settle():
    """Every stored adaptive run: no beta-trend event before its 10-iteration mean KL has first
    reached the target after the hand-over (found here by a plain loop) and 50 more iterations have
    passed; the diagnosis before issue 30 said "beta falling" at iteration 28 (222 after a warm-up)."""
    runs = [r for r in _runs() if r["ctrl"] != "fixed"]
    assert len(runs) >= 15
    for r in runs:
        m = {k: np.asarray(v) for k, v in r["metrics"].items()}
        handover = (
            next(i for i in range(1, len(m["ctrl/beta"])) if m["ctrl/beta"][i] != m["ctrl/beta"][i - 1]) - 1
        )
        err = m["ctrl/kl_observed_seq_sum"] - m["ctrl/target"]
        mean10 = [err[i : i + 10].mean() for i in range(handover, len(err) - 9)]
        reached = next(
            (handover + j + 9 for j, e in enumerate(mean10) if np.sign(e) != np.sign(mean10[0])), None
        )
        settled = min(reached if reached is not None else len(err), handover + DiagnosisConfig().settle)
        for e in _events(r):
            if e["event"] == "beta_trend":
                assert e["iteration"] >= settled + 49, (_name(r), e, settled)
