"""Evaluation metrics in JAX (batched, jit-able, no Python branching on array values)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------------------------------
# Text-quality and ranking metrics: distinct_n, perplexity, spearman.
# ---------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("n",))
def distinct_n(tokens: jax.Array, mask: jax.Array, n: int) -> jax.Array:
    """Distinct-n: ``#distinct n-grams / #n-grams`` over the whole batch (0 if there are none).

    An n-gram is ``tokens[b, i : i + n]`` with ``mask[b, i : i + n]`` all non-zero (it never crosses
    rows). Counting is exact (no hashing): the n-grams, as rows of an ``[B * (T - n + 1), n]``
    table, are sorted lexicographically (``jnp.lexsort``) with invalid ones replaced by a sentinel
    row of -1 that sorts first; a valid sorted row is new if it differs from its predecessor.
    ``n`` is static.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    on = jnp.asarray(mask) > 0
    b, t = tokens.shape
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if n > t:
        return jnp.zeros((), jnp.float32)
    w = t - n + 1
    grams = jnp.stack([tokens[:, j : j + w] for j in range(n)], axis=-1).reshape(b * w, n)
    valid = jnp.stack([on[:, j : j + w] for j in range(n)], axis=-1).all(-1).reshape(b * w)
    grams = jnp.where(valid[:, None], grams, -1)
    order = jnp.lexsort(tuple(grams[:, j] for j in reversed(range(n))))  # last key is primary
    g, v = grams[order], valid[order]
    differs = jnp.concatenate([jnp.ones((1,), bool), (g[1:] != g[:-1]).any(-1)])
    distinct = (v & differs).sum()
    total = v.sum()
    return (distinct / jnp.maximum(total, 1)).astype(jnp.float32)


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
