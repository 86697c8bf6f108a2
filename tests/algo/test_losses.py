"""Tests of klrl.losses against hand-computed values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from klrl.algo import losses as L


def test_clipped_surrogate_hand_values() -> None:
    # ratios and advantages, clip 0.2:
    #   rho=0.5, A= 1: unclipped -0.5, clipped -0.8 -> loss -0.5, clip branch inactive
    #   rho=0.5, A=-1: unclipped  0.5, clipped  0.8 -> loss  0.8, clip active
    #   rho=1.5, A= 1: unclipped -1.5, clipped -1.2 -> loss -1.2, clip active
    #   rho=1.5, A=-1: unclipped  1.5, clipped  1.2 -> loss  1.5, inactive
    #   rho=1.1, A= 2: inside the range -> loss -2.2, inactive
    #   rho=3.0, A= 5: masked out (would be loss -6, active)
    ratio = np.array([[0.5, 0.5, 1.5], [1.5, 1.1, 3.0]])
    adv = jnp.array([[1.0, -1.0, 1.0], [-1.0, 2.0, 5.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = jnp.array([[-1.0, -2.0, -0.5], [-3.0, -0.2, -1.0]])
    logp = old + jnp.log(jnp.asarray(ratio, jnp.float32))
    loss_t, clipped = L.clipped_surrogate(logp, old, adv, 0.2)
    np.testing.assert_allclose(np.asarray(loss_t), [[-0.5, 0.8, -1.2], [1.5, -2.2, -6.0]], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(clipped), [[0, 1, 1], [0, 0, 1]])
    n = float(jnp.sum(mask))
    # masked mean loss: (-0.5 + 0.8 - 1.2 + 1.5 - 2.2) / 5 = -0.32; clip fraction 2/5
    assert abs(float(L.masked_sum(loss_t, mask)) / n - (-0.32)) < 1e-5
    assert abs(float(L.masked_sum(clipped, mask)) / n - 0.4) < 1e-6


def test_clipped_surrogate_gradient_vanishes_when_clipped() -> None:
    import jax

    old = jnp.zeros(4)
    adv = jnp.array([1.0, 1.0, -1.0, -1.0])
    logp = jnp.log(jnp.array([1.5, 1.1, 0.5, 0.9]))
    g = jax.grad(lambda lp: jnp.sum(L.clipped_surrogate(lp, old, adv, 0.2)[0]))(logp)
    # d(-A rho)/d logp = -A rho where the unclipped branch is active, 0 where clipped
    np.testing.assert_allclose(np.asarray(g), [0.0, -1.1, 0.0, 0.9], rtol=1e-5)


def test_clipped_value_loss_hand_values() -> None:
    # clip 0.2:
    #   v=1.0, old=0.5, G=2: v_c=0.7; (1-2)^2=1, (0.7-2)^2=1.69 -> 0.845, clipped branch active
    #   v=0.5, old=0.5, G=0: v_c=0.5; both 0.25 -> 0.125, inactive
    #   v=2.0, old=1.0, G=1: v_c=1.2; (2-1)^2=1, (1.2-1)^2=0.04 -> 0.5, inactive
    #   v=0.0, old=1.0, G=3: v_c=0.8; 9 vs 4.84 -> 4.5, inactive
    v = jnp.array([1.0, 0.5, 2.0, 0.0])
    old = jnp.array([0.5, 0.5, 1.0, 1.0])
    ret = jnp.array([2.0, 0.0, 1.0, 3.0])
    loss, clipped = L.clipped_value_loss(v, old, ret, 0.2)
    np.testing.assert_allclose(np.asarray(loss), [0.845, 0.125, 0.5, 4.5], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(clipped), [1, 0, 0, 0])


def test_explained_variance_hand_value() -> None:
    # target - pred = [0, 1, 0, 1]: var 0.25; target [1, 3, 3, 5]: var 2 -> 1 - 0.25/2 = 0.875
    pred = jnp.array([[1.0, 2.0, 3.0], [4.0, 100.0, 0.0]])
    target = jnp.array([[1.0, 3.0, 3.0], [5.0, -100.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(float(L.explained_variance(pred, target, mask)), 0.875, rtol=1e-6)
    # a perfect prediction explains everything; predicting the mean explains nothing
    assert abs(float(L.explained_variance(target, target, mask)) - 1.0) < 1e-6
    assert abs(float(L.explained_variance(jnp.full_like(target, 3.0), target, mask))) < 1e-6


def test_approx_kl_hand_value() -> None:
    # log rho = log 2: (2 - 1) - log 2 = 0.306853; log rho = 0 -> 0
    out = L.approx_kl(jnp.array([np.log(2.0), 0.0]), jnp.zeros(2))
    np.testing.assert_allclose(np.asarray(out), [1 - np.log(2.0), 0.0], rtol=1e-5, atol=1e-7)
