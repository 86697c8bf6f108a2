"""PPO losses on ``[B, T]`` token arrays with a response mask.

All functions return *per-token* values; :func:`masked_sum` with a
normaliser chosen by the caller turns them into a loss, so the caller controls
whether a mean is over this device's tokens or over the global minibatch.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def masked_sum(x: Array, mask: Array) -> Array:
    return jnp.sum(x * mask)


def clipped_surrogate(logp: Array, old_logp: Array, adv: Array, clip: float) -> tuple[Array, Array]:
    """PPO's clipped policy objective, as a loss (Schulman et al. 2017, eq. 7).

    rho = exp(logp - old_logp);  L_t = max(-A_t * rho, -A_t * clip(rho, 1 - eps, 1 + eps)).
    Returns ``(loss_t, clipped_t)`` where ``clipped_t`` is 1 where the clipped
    branch is the active (larger) one, the usual clip-fraction indicator.
    """
    chex.assert_equal_shape([logp, old_logp, adv])
    ratio = jnp.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip, 1.0 + clip)
    return jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)


def clipped_value_loss(value: Array, old_value: Array, returns: Array, clip: float) -> tuple[Array, Array]:
    """Clipped value loss (PPO2 baselines; Ziegler et al. 2019).

    v_c = old_v + clip(v - old_v, -eps, eps);  L_t = 0.5 * max((v - G)^2, (v_c - G)^2).
    Returns ``(loss_t, clipped_t)``; ``clipped_t`` is 1 where the clip is active
    (|v - old_v| > eps) and the clipped branch is the larger one. (Comparing the
    two branches alone would count float ties where v ~ old_v.)
    """
    chex.assert_equal_shape([value, old_value, returns])
    v_clipped = old_value + jnp.clip(value - old_value, -clip, clip)
    a = jnp.square(value - returns)
    b = jnp.square(v_clipped - returns)
    active = (jnp.abs(value - old_value) > clip) & (b > a)
    return 0.5 * jnp.maximum(a, b), active.astype(jnp.float32)


def approx_kl(logp: Array, old_logp: Array) -> Array:
    """k3 estimate of KL(pi_old || pi) per token: (rho - 1) - log rho, rho = pi/pi_old."""
    log_ratio = logp - old_logp
    return jnp.expm1(log_ratio) - log_ratio


def explained_variance(pred: Array, target: Array, mask: Array) -> Array:
    """1 - Var[target - pred] / Var[target] over the masked entries."""
    n = jnp.maximum(jnp.sum(mask), 1.0)

    def var(x):
        m = jnp.sum(x * mask) / n
        return jnp.sum(jnp.square(x - m) * mask) / n

    return 1.0 - var(target - pred) / (var(target) + 1e-8)
