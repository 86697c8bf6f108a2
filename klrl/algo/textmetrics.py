"""Diversity and degeneration metrics of sampled responses, on token ids ``[B, R]`` + ``mask``.

An n-gram is ``n`` consecutive positions that are all valid (``mask > 0``); it never crosses rows.

- ``distinct_n`` (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural
  Conversation Models"): the number of distinct n-grams over the whole batch divided by the number
  of n-grams in it; 0 when there are none.
- ``rep_n`` (seq-rep-n of Welleck et al. 2019, "Neural Text Generation with Unlikelihood
  Training"): per response ``1 - distinct / total`` n-grams *within* that response, the fraction
  of its n-grams that repeat an earlier one; the batch value averages over responses that have at
  least one n-gram (0 when none has).
- ``response_length``: valid tokens per response (``mask.sum(-1)``); ``stop_rate``: the fraction
  of responses whose last valid token is a stop id (the rest ran out of budget).

``distinct_n``, ``rep_n`` and ``response_length`` are JAX (jit/vmap-safe) and exact: the n-grams
are sorted lexicographically with ``lax.sort`` over ``n`` keys, no hashing; they are the one
implementation the train step, the evaluators and the host share. ``text_metrics`` returns the
flat ``text/...`` metric dict of one batch as Python floats.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _ngrams(tokens: jax.Array, mask: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """``grams [..., R-n+1, n]`` and ``valid [..., R-n+1]`` (all ``n`` positions valid); ``R >= n``."""
    r = tokens.shape[-1]
    grams = jnp.stack([tokens[..., k : r - n + 1 + k] for k in range(n)], axis=-1)
    valid = jnp.stack([mask[..., k : r - n + 1 + k] > 0 for k in range(n)], axis=-1).all(-1)
    return grams, valid


def _count_distinct(grams: jax.Array, valid: jax.Array) -> jax.Array:
    """Distinct valid rows of ``grams [M, n]``: sort by (invalid, k_1..k_n), count changes."""
    keys = (jnp.logical_not(valid).astype(jnp.int32), *(grams[:, k] for k in range(grams.shape[1])))
    s = jax.lax.sort(keys, num_keys=len(keys))
    inv, cols = s[0], s[1:]
    new = jnp.zeros(inv.shape, bool).at[0].set(True)
    for c in cols:
        new = new | jnp.concatenate([jnp.ones((1,), bool), c[1:] != c[:-1]])
    return jnp.sum(new & (inv == 0))


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")


def distinct_n(tokens: jax.Array, mask: jax.Array, n: int) -> jax.Array:
    """Distinct n-grams in the batch / n-grams in the batch, a float32 scalar (0 if there are none,
    as when ``R < n``). ``n`` is static."""
    _check_n(n)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    if tokens.shape[-1] < n:
        return jnp.zeros((), jnp.float32)
    grams, valid = _ngrams(tokens, mask, n)
    total = jnp.sum(valid)
    d = _count_distinct(grams.reshape(-1, n), valid.reshape(-1))
    return jnp.where(total > 0, d / jnp.maximum(total, 1), 0.0).astype(jnp.float32)


def rep_n(tokens: jax.Array, mask: jax.Array, n: int = 4) -> jax.Array:
    """Mean seq-rep-n over responses with at least one n-gram, a float32 scalar (0 if none has, as
    when ``R < n``). ``n`` is static."""
    _check_n(n)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    if tokens.shape[-1] < n:
        return jnp.zeros((), jnp.float32)
    grams, valid = _ngrams(tokens, mask, n)
    total = jnp.sum(valid, axis=-1)
    d = jax.vmap(_count_distinct)(grams, valid)
    has = total > 0
    rep = jnp.where(has, 1.0 - d / jnp.maximum(total, 1), 0.0)
    return (jnp.sum(rep) / jnp.maximum(jnp.sum(has), 1)).astype(jnp.float32)


def response_length(mask: jax.Array) -> jax.Array:
    """Valid tokens per response, ``[B]`` float32."""
    return jnp.sum(jnp.asarray(mask) > 0, axis=-1).astype(jnp.float32)


def stop_rate(tokens, mask, stop_ids: Sequence[int]) -> float:
    """Fraction of responses whose last valid token is one of ``stop_ids`` (host, NumPy)."""
    tokens, valid = np.asarray(tokens), np.asarray(mask) > 0
    n = valid.sum(-1)
    last = tokens[np.arange(len(tokens)), np.maximum(n - 1, 0)]
    return float(np.mean((n > 0) & np.isin(last, list(stop_ids)))) if len(tokens) else 0.0


def text_metrics(tokens, mask, *, stop_ids: Sequence[int] = (), rep: int = 4) -> dict[str, float]:
    """``text/distinct_1``, ``text/distinct_2``, ``text/rep_<rep>``, ``text/length_{mean,min,max}``
    and (with ``stop_ids``) ``text/stop_rate`` of one batch of responses, as Python floats."""
    lengths = np.asarray(response_length(mask))
    out = {
        "text/distinct_1": float(distinct_n(tokens, mask, 1)),
        "text/distinct_2": float(distinct_n(tokens, mask, 2)),
        f"text/rep_{rep}": float(rep_n(tokens, mask, rep)),
        "text/length_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "text/length_min": float(lengths.min()) if len(lengths) else 0.0,
        "text/length_max": float(lengths.max()) if len(lengths) else 0.0,
    }
    if stop_ids:
        out["text/stop_rate"] = stop_rate(tokens, mask, stop_ids)
    return out
