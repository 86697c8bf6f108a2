"""Per-token KL estimators and masked reductions, as small pure functions.

Shapes are explicit: per-token inputs are ``[B, T]`` (``B`` sequences, ``T``
response positions), with a ``mask`` of the same shape (bool, or float where
nonzero means "a response token"). Every estimator returns ``[B, T]`` float32
with masked positions exactly ``0`` (inputs there are ignored, even if they are
``nan`` or ``inf``), and computes in float32 whatever the input dtype (bf16
included).

Notation: ``logp = log pi(y_t | x, y_<t)`` is the log-probability of the sampled
token under the policy, ``ref_logp`` the same under the reference, and the
log-ratio ``lr = logp - ref_logp``. Samples come from ``pi``, so the estimators
below are estimators of ``KL(pi || pi_ref) = E_pi[lr]``
(Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html).

Clamping (``clamp > 0``): the log-ratio is clipped to ``[-clamp, clamp]``
before the estimator and the estimate after it, as verl and OpenRLHF do
(with clamp 10). ``clamp`` may be a Python number (0 = off, decided at trace
time) or a traced scalar (``<= 0`` = off, decided with ``jnp.where``).

Reductions name their unit: :func:`seq_sum` gives nats per sequence,
:func:`token_mean` nats per token (per sequence). Both are per-sequence
(``[B]``), so they are local to a shard under ``shard_map``; take the batch mean
(and ``lax.pmean`` over the data axis) yourself.

Everything here is free of Python branching on array values, so it works
under ``jit``, ``vmap`` and ``shard_map``.

The estimators are entries of the :data:`ESTIMATORS` registry (``kl.estimator``,
``kl.loss_estimator`` and ``ctrl.estimator`` name them), each registered with ``inputs``: ``"logp"``
(from the sampled tokens' log-probs, which both logit paths give) or ``"logits"`` (from the full
``[B, T, V]`` logits). The chunked path (:mod:`klrl.step.chunked`, ``model.logits``; the default for
vocabularies of 32768 or more) never forms those, so an estimator of the logits declares its
chunked form as ``chunked=``, the name of the :func:`klrl.step.chunked.head_terms` term that computes
it chunk by chunk: ``full`` is ``chunked="kl"`` (:func:`full_kl` of each chunk's logits). One without
a chunked form is refused there by name (:func:`klrl.step.chunked.check_estimators`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from klrl.config import KL_UNITS
from klrl.registry import ESTIMATORS

Array = jax.Array
ArrayLike = jax.typing.ArrayLike

__all__ = [
    "ESTIMATORS",
    "KL_UNITS",
    "log_ratio",
    "k1",
    "k2",
    "k3",
    "kl_abs",
    "full_kl",
    "estimate",
    "seq_sum",
    "token_mean",
    "masked_mean",
    "reduce",
]


def _f32(x: ArrayLike) -> Array:
    return jnp.asarray(x).astype(jnp.float32)


def _valid(mask: ArrayLike) -> Array:
    """Boolean validity from a bool or float mask (nonzero = valid)."""
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def _clip(x: Array, clamp: ArrayLike) -> Array:
    """Clip to ``[-clamp, clamp]`` when ``clamp > 0``; identity otherwise."""
    if isinstance(clamp, int | float):
        return jnp.clip(x, -clamp, clamp) if clamp > 0 else x
    c = _f32(clamp)
    return jnp.where(c > 0, jnp.clip(x, -c, c), x)


def _masked_log_ratio(logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike, clamp: ArrayLike) -> Array:
    """Log-ratio with masked positions set to 0 *before* any nonlinearity.

    Zeroing the inputs first (not only the output) keeps ``nan``/``inf`` at
    padded positions out of the values and out of the gradients.
    """
    valid = _valid(mask)
    lr = jnp.where(valid, _f32(logp) - _f32(ref_logp), 0.0)
    return _clip(lr, clamp)


def _finish(value: Array, mask: ArrayLike, clamp: ArrayLike) -> Array:
    return jnp.where(_valid(mask), _clip(value, clamp), 0.0)


def log_ratio(logp: ArrayLike, ref_logp: ArrayLike, clamp: ArrayLike = 0.0) -> Array:
    """``lr = log pi(y) - log pi_ref(y)`` in float32, clipped to ``[-clamp, clamp]`` if ``clamp > 0``.

    Args:
      logp: ``[B, T]`` log-probabilities of the sampled tokens under the policy.
      ref_logp: ``[B, T]`` the same under the reference.
      clamp: clip bound (0 = off).

    Returns:
      ``[B, T]`` float32 (no masking: see the estimators for masked versions).
    """
    return _clip(_f32(logp) - _f32(ref_logp), clamp)


@ESTIMATORS.register("k1")
def k1(logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike, clamp: ArrayLike = 0.0) -> Array:
    """k1 = lr = log(pi / pi_ref).

    Unbiased for ``KL(pi || pi_ref)`` under samples from ``pi``, high variance,
    can be negative per sample (Schulman 2020). The estimator of Ziegler et al.
    2019 (lm-human-preferences) in the per-token reward. As a loss term with
    samples from ``pi`` its expected gradient is zero (``E_pi[grad log pi] = 0``).

    Returns ``[B, T]`` float32, 0 where ``mask`` is 0.
    """
    return _finish(_masked_log_ratio(logp, ref_logp, mask, clamp), mask, clamp)


@ESTIMATORS.register("k2")
def k2(logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike, clamp: ArrayLike = 0.0) -> Array:
    """k2 = 0.5 * lr^2.

    Biased, low variance, never negative (Schulman 2020; verl's ``mse``). As a
    loss term (samples from ``pi``, no gradient through sampling) its expected
    gradient ``E_pi[lr * grad log pi]`` equals ``grad KL(pi || pi_ref)``.

    Returns ``[B, T]`` float32, 0 where ``mask`` is 0.
    """
    lr = _masked_log_ratio(logp, ref_logp, mask, clamp)
    return _finish(0.5 * jnp.square(lr), mask, clamp)


@ESTIMATORS.register("k3")
def k3(logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike, clamp: ArrayLike = 0.0) -> Array:
    """k3 = (rho - 1) - log rho, rho = pi_ref / pi = exp(-lr).

    Unbiased for ``KL(pi || pi_ref)`` (``E_pi[rho] = 1``), never negative since
    ``log rho <= rho - 1`` (Schulman 2020; verl's ``low_var_kl``, the GRPO loss term).
    ``k3 = k1 + (rho - 1)`` adds a zero-mean control variate: its variance is lower
    than k1's when ``pi`` is close to ``pi_ref`` (``k3 ~ lr^2 / 2``, variance
    ``O(lr^4)`` against k1's ``O(lr^2)``), but not once they differ: ``rho`` is
    unbounded where ``pi`` is small, and on random 16-token pairs with logits of
    standard deviation 1 k3's variance is the higher in about half the pairs, at 3
    in all (``tests/algo/test_kl.py`` measures both regimes). As a loss term its expected gradient is
    ``E_pi[(1 - rho) grad log pi] = grad KL(pi_ref || pi)``: the gradient of the
    *forward* KL, not of ``KL(pi || pi_ref)``.

    Returns ``[B, T]`` float32, 0 where ``mask`` is 0.
    """
    lr = _masked_log_ratio(logp, ref_logp, mask, clamp)
    # (rho - 1) - log rho with log rho = -lr; expm1 keeps precision for small |lr|.
    return _finish(jnp.expm1(-lr) + lr, mask, clamp)


@ESTIMATORS.register("abs")
def kl_abs(logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike, clamp: ArrayLike = 0.0) -> Array:
    """|lr| = |log(pi / pi_ref)|.

    Biased upward (``E_pi|lr| >= KL``), never negative; verl's ``abs`` estimator.

    Returns ``[B, T]`` float32, 0 where ``mask`` is 0.
    """
    return _finish(jnp.abs(_masked_log_ratio(logp, ref_logp, mask, clamp)), mask, clamp)


@ESTIMATORS.register("full")
def full_kl(logits: ArrayLike, ref_logits: ArrayLike, mask: ArrayLike, clamp: ArrayLike = 0.0) -> Array:
    """Exact per-position KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)).

    Computed from the full ``[B, T, V]`` logits with ``log_softmax`` in float32
    (no sampling, so no estimator variance; verl's ``full``). Vocabulary
    entries with ``pi(v) = 0`` contribute 0. With ``clamp > 0`` the per-entry
    log-ratio is clipped before the sum and the result after it. Unclipped, each
    position's sum is floored at 0: a KL is >= 0 (Gibbs' inequality), and the
    float32 sum of ``pi (log pi - log pi_ref)`` over the vocabulary of two equal
    distributions is ``+-1e-7``-size rounding, not a negative KL (a LoRA run's
    first iteration printed ``-3.5e-07``). The floor's gradient is 0 only where the
    rounded sum is negative, where the true KL's gradient is 0 as well.

    Args:
      logits: ``[B, T, V]`` policy logits (at the sampling temperature).
      ref_logits: ``[B, T, V]`` reference logits (same temperature).
      mask: ``[B, T]``.
      clamp: clip bound (0 = off).

    Returns:
      ``[B, T]`` float32, 0 where ``mask`` is 0.
    """
    valid = _valid(mask)
    # zero the logits of masked positions first, so nan/inf there reach neither values nor gradients
    logp = jax.nn.log_softmax(jnp.where(valid[..., None], _f32(logits), 0.0), axis=-1)
    logq = jax.nn.log_softmax(jnp.where(valid[..., None], _f32(ref_logits), 0.0), axis=-1)
    lr = jnp.where(valid[..., None], logp - logq, 0.0)
    lr = _clip(lr, clamp)
    p = jnp.exp(logp)
    terms = jnp.where(p > 0, p * lr, 0.0)
    total = jnp.sum(terms, axis=-1)
    total = jnp.where(jnp.asarray(clamp) > 0, total, jnp.maximum(total, 0.0))
    return _finish(total, mask, clamp)


def estimate(
    name: str,
    logp: ArrayLike,
    ref_logp: ArrayLike,
    mask: ArrayLike,
    logits: ArrayLike | None = None,
    ref_logits: ArrayLike | None = None,
    clamp: ArrayLike = 0.0,
) -> Array:
    """Per-token estimate ``[B, T]`` by the estimator ``name`` (static).

    ``name`` is a name of the :data:`ESTIMATORS` registry: k1, k2, k3, abs (``inputs="logp"``: from
    the sampled tokens' log-probs ``[B, T]``) or full (``inputs="logits"``: exact, from ``logits``
    and ``ref_logits`` ``[B, T, V]``; ``logp`` and ``ref_logp`` are then unused). A new estimator
    is one function ``(a, ref_a, mask, clamp) -> [B, T]`` registered with its ``inputs`` (and, for
    ``inputs="logits"``, its ``chunked`` form: module docstring).
    """
    fn, meta = ESTIMATORS.entry(name)
    if meta["inputs"] == "logits":
        if logits is None or ref_logits is None:
            raise ValueError(f"estimator {name!r} needs logits and ref_logits ([B, T, V])")
        chex.assert_rank(logits, 3)
        chex.assert_equal_shape([logits, ref_logits])
        chex.assert_equal_shape([logits[..., 0], mask])
        return fn(logits, ref_logits, mask, clamp)
    chex.assert_equal_shape([logp, ref_logp, mask])
    return fn(logp, ref_logp, mask, clamp)


def seq_sum(x: ArrayLike, mask: ArrayLike) -> Array:
    """Per-sequence sum over valid positions: ``sum_t m_t x_t`` -> ``[B]`` (nats per sequence)."""
    return jnp.sum(jnp.where(_valid(mask), _f32(x), 0.0), axis=-1)


def token_mean(x: ArrayLike, mask: ArrayLike) -> Array:
    """Per-sequence mean over valid positions: ``sum_t m_t x_t / max(sum_t m_t, 1)`` -> ``[B]``.

    Nats per token, one value per sequence; a sequence with no valid token gives 0.
    """
    count = jnp.sum(_valid(mask), axis=-1).astype(jnp.float32)
    return seq_sum(x, mask) / jnp.maximum(count, 1.0)


def masked_mean(x: ArrayLike, mask: ArrayLike, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(m x) / max(sum(m), 1)`` over ``axis`` (all axes if None); 0 where nothing is valid.

    Local to the arrays given: under ``shard_map`` psum numerator and count yourself
    for a global mean.
    """
    valid = _valid(mask)
    num = jnp.sum(jnp.where(valid, _f32(x), 0.0), axis=axis)
    count = jnp.sum(valid, axis=axis).astype(jnp.float32)
    return num / jnp.maximum(count, 1.0)


def reduce(x: ArrayLike, mask: ArrayLike, unit: str) -> Array:
    """Per-sequence aggregate ``[B]`` in ``unit`` (static): ``seq_sum`` or ``token_mean``."""
    if unit == "seq_sum":
        return seq_sum(x, mask)
    if unit == "token_mean":
        return token_mean(x, mask)
    raise ValueError(f"unknown KL unit {unit!r}; expected one of {', '.join(KL_UNITS)}")
