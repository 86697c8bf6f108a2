"""distinct_n, perplexity and spearman against hand-computed and NumPy values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo.metrics import distinct_n, perplexity, spearman


def _distinct_ref(tokens: np.ndarray, mask: np.ndarray, n: int) -> float:
    grams = [tuple(r[i : i + n]) for r, m in zip(tokens, mask, strict=True)
             for i in range(len(r) - n + 1) if np.all(m[i : i + n] > 0)]  # fmt: skip
    return len(set(grams)) / len(grams) if grams else 0.0


def test_distinct_n_hand_computed():
    tok = jnp.array([[1, 2, 1, 2, 9], [1, 2, 3, 0, 0]])
    mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], jnp.float32)
    # unigrams 1 2 1 2 | 1 2 3 -> {1, 2, 3} / 7; bigrams 12 21 12 | 12 23 -> 3 / 5; trigrams 3 / 3
    assert float(distinct_n(tok, mask, 1)) == pytest.approx(3 / 7)
    assert float(distinct_n(tok, mask, 2)) == pytest.approx(3 / 5)
    assert float(distinct_n(tok, mask, 3)) == pytest.approx(1.0)
    assert float(distinct_n(tok, mask, 5)) == 0.0  # no complete 5-gram inside the mask
    assert float(distinct_n(tok, mask, 6)) == 0.0  # longer than the sequences
    # a masked hole breaks n-grams; n-grams never cross rows
    hole = jnp.array([[5, 6, 7, 5, 6]])
    assert float(distinct_n(hole, jnp.array([[1, 1, 0, 1, 1]]), 2)) == pytest.approx(1 / 2)
    rows = jnp.array([[4, 4], [4, 4]])
    assert float(distinct_n(rows, jnp.ones((2, 2)), 2)) == pytest.approx(1 / 2)
    assert float(distinct_n(rows, jnp.zeros((2, 2)), 1)) == 0.0


def test_distinct_n_matches_reference_on_random_batches():
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 4, size=(6, 12))
    mask = (rng.random((6, 12)) < 0.8).astype(np.float32)
    f = jax.jit(distinct_n, static_argnums=2)
    for n in (1, 2, 3, 4):
        assert float(f(tok, mask, n)) == pytest.approx(_distinct_ref(tok, mask, n), abs=1e-6)


def test_perplexity_hand_computed():
    logp = jnp.array([[-1.0, -2.0], [-3.0, -jnp.inf]])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    assert float(perplexity(logp, mask)) == pytest.approx(np.exp(2.0), rel=1e-6)
    assert float(perplexity(jnp.full((3, 4), -np.log(7.0)), jnp.ones((3, 4)))) == pytest.approx(7.0, rel=1e-5)
    assert float(perplexity(logp, jnp.zeros((2, 2)))) == 1.0


def _avg_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):  # average the ranks of ties
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def test_spearman_with_ties():
    x = np.array([1.0, 2.0, 2.0, 3.0])
    y = np.array([1.0, 3.0, 2.0, 4.0])
    # ranks x: 1, 2.5, 2.5, 4; y: 1, 3, 2, 4 -> Pearson of the ranks = 4.5 / sqrt(4.5 * 5)
    assert float(spearman(x, y)) == pytest.approx(4.5 / np.sqrt(4.5 * 5.0), rel=1e-6)
    assert float(spearman(x, -y)) == pytest.approx(-4.5 / np.sqrt(4.5 * 5.0), rel=1e-6)
    assert float(spearman(np.arange(5.0), np.exp(np.arange(5.0)))) == pytest.approx(1.0)
    assert np.isnan(float(spearman(np.ones(4), y)))
    rng = np.random.default_rng(1)
    for _ in range(5):
        a, b = rng.integers(0, 5, 30).astype(float), rng.integers(0, 5, 30).astype(float)
        ref = np.corrcoef(_avg_ranks(a), _avg_ranks(b))[0, 1]
        assert float(jax.jit(spearman)(a, b)) == pytest.approx(ref, abs=1e-5)
