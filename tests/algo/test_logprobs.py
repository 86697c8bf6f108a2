"""token_logprobs and entropy against NumPy float64 references and hand values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo.logprobs import entropy, token_logprobs


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def test_hand_values() -> None:
    # uniform over 4: log p = -log 4 for every token, entropy log 4
    z = jnp.zeros((1, 4))
    assert float(token_logprobs(z, jnp.array([2]))[0]) == pytest.approx(-np.log(4.0), rel=1e-6)
    assert float(entropy(z)[0]) == pytest.approx(np.log(4.0), rel=1e-6)
    # one overwhelming logit: log p ~ 0 for it, entropy ~ 0
    peaked = jnp.array([[0.0, 100.0, 0.0]])
    assert float(token_logprobs(peaked, jnp.array([1]))[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(entropy(peaked)[0]) == pytest.approx(0.0, abs=1e-6)


def test_against_numpy_on_random_logits() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, (3, 5, 11)).astype(np.float32)
    tok = rng.integers(0, 11, (3, 5))
    ref = _log_softmax(z)
    want_lp = np.take_along_axis(ref, tok[..., None], -1)[..., 0]
    want_h = -(np.exp(ref) * ref).sum(-1)
    got_lp, got_h = token_logprobs(jnp.asarray(z), jnp.asarray(tok)), entropy(jnp.asarray(z))
    assert got_lp.shape == (3, 5) and got_h.shape == (3, 5)
    np.testing.assert_allclose(np.asarray(got_lp), want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_h), want_h, rtol=1e-5, atol=1e-5)


def test_bfloat16_logits_are_read_in_float32() -> None:
    z = jnp.asarray(np.random.default_rng(1).normal(0, 2, (4, 7)), jnp.bfloat16)
    tok = jnp.arange(4)
    lp, h = token_logprobs(z, tok), entropy(z)
    assert lp.dtype == jnp.float32 and h.dtype == jnp.float32
    ref = _log_softmax(np.asarray(z.astype(jnp.float32)))  # the bf16 values, exactly, in float64
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(4), np.arange(4)], rtol=1e-5, atol=1e-5)
