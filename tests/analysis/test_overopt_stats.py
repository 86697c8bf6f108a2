"""klrl.analysis.overopt against independent references: brute force over subsets, Monte Carlo,
hand values and scipy's one-sided t-tests."""

from itertools import combinations

import numpy as np
import pytest
from scipy import stats

from klrl.analysis import overopt


def test_kl_bon_hand_values():
    assert overopt.kl_bon(1) == pytest.approx(0.0)
    assert overopt.kl_bon(2) == pytest.approx(np.log(2) - 0.5)
    assert overopt.kl_bon(64) == pytest.approx(np.log(64) - 63 / 64)
    with pytest.raises(ValueError, match="n must be >= 1"):
        overopt.kl_bon(0)


def test_kl_bon_is_the_kl_of_the_max_of_n_uniforms():
    # best-of-n of a continuous score: the selected quantile u has density n u^(n-1) on [0, 1], so
    # KL = E[log(n u^(n-1))], estimated here by Monte Carlo from the max of n uniforms
    rng = np.random.default_rng(0)
    n = 8
    u = rng.random((200_000, n)).max(axis=1)
    mc = np.mean(np.log(n) + (n - 1) * np.log(u))
    assert overopt.kl_bon(n) == pytest.approx(mc, abs=0.01)


def test_bon_expectation_equals_the_mean_over_every_subset():
    rng = np.random.default_rng(1)
    k = 7
    select, value = rng.normal(size=(3, k)), rng.normal(size=(3, k))
    for n in (1, 2, 4, 7):
        brute = [np.mean([value[p, max(s, key=lambda i: select[p, i])] for s in combinations(range(k), n)])
                 for p in range(3)]  # fmt: skip
        assert overopt.bon_expectation(select, value, n) == pytest.approx(brute, abs=1e-12)
    assert overopt.bon_weights(k, 3).sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        overopt.bon_expectation(select, value, k + 1)


def test_fits_recover_their_coefficients_and_turns():
    d = np.linspace(0.2, 6, 30)
    a, b = overopt.fit_bon(d, d * (1.5 - 0.3 * d))
    assert (a, b) == pytest.approx((1.5, 0.3))
    assert overopt.turn(a, b, "bon") == pytest.approx(2.5)
    # the RL form's peak: R(d) = d (1 - 0.5 log d) peaks where 1 - 0.5 log d - 0.5 = 0, d = e
    r = d * (1.0 - 0.5 * np.log(d))
    assert overopt.turn(1.0, 0.5, "rl") == pytest.approx(np.e)
    assert d[np.argmax(r)] == pytest.approx(np.e, abs=0.2)
    assert overopt.turn(1.0, 0.0, "rl") == float("inf")


def test_tost_matches_two_one_sided_scipy_tests():
    x = np.array([0.05, -0.1, 0.02, 0.08, -0.03])
    margin = 0.3
    lo = stats.ttest_1samp(x + margin, 0.0, alternative="greater").pvalue
    hi = stats.ttest_1samp(x - margin, 0.0, alternative="less").pvalue
    out = overopt.tost(x, margin)
    assert out["p"] == pytest.approx(max(lo, hi))
    assert out["equivalent"] and out["lo90"] > -margin and out["hi90"] < margin
    # an interval that contains 0 but is wide is not equivalence
    wide = overopt.tost(np.array([1.0, -1.2, 0.9]), margin)
    assert not wide["equivalent"]


def test_wilson_hand_value():
    # k=59, n=100 at 95%: (0.4920, 0.6813) to 4 decimals (the score interval by hand: z = 1.959964)
    lo, hi = overopt.wilson(59, 100)
    assert (lo, hi) == pytest.approx((0.4920, 0.6813), abs=1e-4)


def _loop_accuracy(score, gold, prompt) -> tuple[float, int]:
    """Every pair of responses to one prompt with different gold, one at a time (a proxy tie: one half)."""
    k, n = 0.0, 0
    for i in range(len(score)):
        for j in range(i + 1, len(score)):
            if prompt[i] != prompt[j] or gold[i] == gold[j]:
                continue
            n += 1
            if score[i] == score[j]:
                k += 0.5
            elif (score[i] > score[j]) == (gold[i] > gold[j]):
                k += 1
    return k / n, n


def test_pair_accuracy_is_the_python_loop_count_and_its_interval_covers_it():
    from klrl.analysis.overopt import pair_accuracy

    rng = np.random.default_rng(3)
    prompt = np.repeat(np.arange(12), 5)
    gold = rng.integers(0, 4, prompt.size).astype(float)  # ties in the gold are left out
    score = gold + rng.normal(0, 1.5, prompt.size)
    score[:2] = 7.0  # a proxy tie on one pair
    want, n = _loop_accuracy(score, gold, prompt)
    got = pair_accuracy(score, gold, prompt, n_boot=500)
    assert got["pairs"] == n and got["value"] == pytest.approx(want)
    assert got["lo"] < want < got["hi"] and got["n_prompts"] == 12
    assert 0.5 < want < 1  # the proxy is informative and imperfect: the case is not degenerate


def test_prompt_bootstrap_resamples_prompts_not_responses():
    """Two prompts, one all-agreeing and one all-disagreeing: a response-level resample would give an
    interval narrow around 0.5; resampling the 2 prompts gives only 0, 0.5 or 1 (each with its binomial
    weight), so the 95% interval is [0, 1]."""
    from klrl.analysis.overopt import prompt_bootstrap

    groups = [(10.0, 10), (0.0, 10)]
    acc = lambda gs: sum(g[0] for g in gs) / sum(g[1] for g in gs)
    out = prompt_bootstrap(groups, acc, n_boot=400, seed=1)
    assert out["value"] == 0.5 and out["lo"] == 0.0 and out["hi"] == 1.0


def test_accuracy_difference_separates_a_good_proxy_from_noise_and_not_from_itself():
    from klrl.analysis.overopt import accuracy_difference

    rng = np.random.default_rng(0)
    prompt = np.repeat(np.arange(40), 6)
    gold = rng.normal(size=prompt.size)
    good, noise = gold + rng.normal(0, 0.3, gold.size), rng.normal(size=gold.size)
    d = accuracy_difference(good, noise, gold, prompt, n_boot=500)
    assert d["separated"] and d["lo"] > 0
    assert d["value"] == pytest.approx(
        _loop_accuracy(good, gold, prompt)[0] - _loop_accuracy(noise, gold, prompt)[0]
    )
    same = accuracy_difference(good, good, gold, prompt, n_boot=200)
    assert same["value"] == 0 and not same["separated"]
