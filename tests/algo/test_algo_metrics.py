"""perplexity and spearman against hand-computed and NumPy values (distinct-n: test_textmetrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo.metrics import perplexity, spearman


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
