"""klrl.analysis.aggregate: t-intervals against hand t-table values, trailing and window means against Python
loops, seed groups, units and axis labels."""

from __future__ import annotations

import math

import numpy as np
import pytest

import klrl
from klrl.analysis import aggregate as A
from klrl.analysis.results import RunResult

# two-sided 95% Student-t quantiles t_{0.975, df}, from a printed t-table
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 9: 2.2622}


def ref_interval(col: list[float]) -> tuple[float, float]:
    """mean and half-width t * s / sqrt(n), s with n - 1 in the denominator, by Python loops."""
    xs = [x for x in col if math.isfinite(x)]
    n = len(xs)
    m = sum(xs) / n
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, T975[n - 1] * s / math.sqrt(n)


def test_t_quantile_matches_the_table():
    for df, t in T975.items():
        assert A.t_quantile(df) == pytest.approx(t, abs=1e-4)
    assert np.isnan(A.t_quantile(0))


def test_t_interval_per_column_with_missing_values():
    x = np.array(
        [[1.0, 2.0, 0.5, 7.0], [3.0, 4.0, np.nan, 7.0], [5.0, 9.0, 1.5, np.nan], [2.0, 1.0, 2.0, np.nan]]
    )
    mean, half, n = A.t_interval(x)
    np.testing.assert_array_equal(n, [4, 4, 3, 2])
    for j in range(4):
        m, h = ref_interval(list(x[:, j]))
        assert mean[j] == pytest.approx(m, rel=1e-12) and half[j] == pytest.approx(h, rel=1e-4)
    mean, half, n = A.t_interval(np.array([[1.0, np.nan], [np.nan, np.nan]]))
    assert mean[0] == 1.0 and np.isnan(half[0]) and np.isnan(mean[1]) and list(n) == [1, 0]


def test_trailing_tail_and_window_means_against_loops():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(23)
    v[[3, 10]] = np.nan
    w = 4
    tm = A.trailing_mean(v, w)
    for i in range(len(v)):
        win = [x for x in v[max(0, i - w + 1) : i + 1] if not math.isnan(x)]
        assert tm[i] == pytest.approx(sum(win) / len(win), rel=1e-12)
    ends, means = A.window_means(v, 5)
    assert list(ends) == [7, 12, 17, 22]  # aligned on the last iteration: 23 mod 5 = 3 left out
    for e, m in zip(ends, means, strict=True):
        win = [x for x in v[e - 4 : e + 1] if not math.isnan(x)]
        assert m == pytest.approx(sum(win) / len(win), rel=1e-12)
    assert A.tail_mean(v, 5) == pytest.approx(means[-1], rel=1e-12)
    assert np.isnan(A.tail_mean([], 5)) and len(A.window_means(v[:3], 5)[0]) == 0


def test_seed_groups_ignore_only_the_seed_and_the_run_name():
    cfg = klrl.RunConfig()
    runs = [
        RunResult(cfg.replace(train={"seed": s, "name": f"s{s}"}, kl={"beta": b}), None, {})
        for b in (0.1, 0.01)
        for s in (0, 1, 2)
    ]
    runs.append(RunResult(cfg.replace(kl={"beta": 0.1}, ppo={"epochs": 2}), None, {}))
    gs = A.seed_groups(runs)
    assert [g.n for g in gs] == [3, 3, 1]
    assert gs[0].seeds == (0, 1, 2) and gs[1].config.kl.beta == 0.01
    longer = RunResult(cfg.replace(train={"seed": 5, "iterations": 7}, kl={"beta": 0.1}), None, {})
    assert [g.n for g in A.seed_groups([*runs[:3], longer])] == [3, 1]
    # where the pretrained models are cached names no setting (stored runs used /tmp/klrlcache)
    cached = RunResult(cfg.replace(train={"seed": 5}, kl={"beta": 0.1}, task={"cache_dir": "/x"}), None, {})
    other_task = RunResult(cfg.replace(train={"seed": 6}, kl={"beta": 0.1}, task={"seed": 1}), None, {})
    assert [g.n for g in A.seed_groups([*runs[:3], cached, other_task])] == [4, 1]


def test_units_and_labels():
    assert A.unit_of("kl/exact_seq_sum") == "nats/sequence" and A.unit_of("kl/k1_token_mean") == "nats/token"
    assert A.unit_of("kl/beta_x_k1_seq_sum") == "reward a.u."
    assert A.unit_of("eval/oracle_ppl_floored") == "exp(nats/token)"
    assert A.unit_of("reward/gold") == "a.u." and A.unit_of("eval/distinct_2") == "fraction"
    assert A.metric_label("reward/gold") == "gold reward [reward/gold]\n(a.u.)"
    assert A.metric_label("reward/task", "reward") == "reward [reward/task] (a.u.)"  # short: one line
    assert A.metric_label(["kl/exact_seq_sum", None]) == "KL [kl/exact_seq_sum]\n(nats/sequence)"
    label = A.metric_label(["eval/oracle_ppl_floored", "eval/ref_ppl"], "perplexity")
    assert label == "perplexity (exp(nats/token))"
