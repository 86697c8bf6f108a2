"""Evaluation metrics in JAX (batched, jit-able, no Python branching on array values).

Text diversity (distinct-n, seq-rep-n) lives in :mod:`klrl.algo.textmetrics`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------------------------------
# Quality and ranking metrics: perplexity, spearman.
# ---------------------------------------------------------------------------------------------------


@jax.jit
def perplexity(token_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """``exp(-sum(logp * mask) / sum(mask))`` over all positions (1 if the mask is empty).

    Masked positions are excluded with ``where`` so a ``-inf`` there does not give NaN.
    """
    mask = jnp.asarray(mask, jnp.float32)
    total = jnp.where(mask > 0, token_logp * mask, 0.0).sum()
    return jnp.exp(-total / jnp.maximum(mask.sum(), 1e-12))


def _average_ranks(x: jax.Array) -> jax.Array:
    """1-based ranks, ties get the mean of their ranks: ``#{x_j < x_i} + (#{x_j = x_i} + 1) / 2``."""
    s = jnp.sort(x)
    below = jnp.searchsorted(s, x, side="left")
    upto = jnp.searchsorted(s, x, side="right")
    return (below + upto + 1).astype(jnp.float32) / 2.0


@jax.jit
def spearman(x: jax.Array, y: jax.Array) -> jax.Array:
    """Spearman rank correlation of 1-D ``x`` and ``y``: the Pearson correlation of their average
    ranks (ties share the mean rank, as ``scipy.stats.spearmanr``). NaN if either is constant."""
    rx = _average_ranks(jnp.ravel(jnp.asarray(x, jnp.float32)))
    ry = _average_ranks(jnp.ravel(jnp.asarray(y, jnp.float32)))
    dx, dy = rx - rx.mean(), ry - ry.mean()
    return (dx * dy).sum() / jnp.sqrt((dx * dx).sum() * (dy * dy).sum())
