"""Advantage estimators on ``[B, T]`` arrays with a response mask.

* GAE (Schulman et al. 2016, "High-dimensional continuous control using
  generalized advantage estimation"), a masked reverse ``lax.scan``.
* GRPO group normalisation (Shao et al. 2024, DeepSeekMath).
* RLOO leave-one-out baseline (Ahmadian et al. 2024, "Back to basics").
* Masked whitening, with statistics over the global batch when an axis name is given.

The trainer reaches them through the :data:`ADVANTAGES` registry, one signature for all:
``estimator(inputs: AdvantageInputs, cfg: PPOConfig) -> (advantages [B, T], returns [B, T])``,
registered with ``critic=True`` when it reads a value function (the trainer then builds one),
``grouped=True`` when it compares the responses to one prompt (the config then asks for
``ppo.group_size >= 2``) and a ``help`` for ``ppo.advantage``'s help string.
A new estimator is one registered function plus its test (``docs/extending.md``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from klrl.registry import ADVANTAGES

Array = jax.Array


class AdvantageInputs(NamedTuple):
    """What an advantage estimator may read (every estimator gets all of it)."""

    rewards: Array  # [B, T] shaped per-token rewards (task reward and KL per kl.placement)
    seq_returns: Array  # [B] the sequence's total shaped return
    values: Array  # [B, T] old values V(s_t) (zeros without a critic)
    mask: Array  # [B, T] response mask
    axis_name: str | None = None  # the mesh axis the batch's rows are split over (statistics across it)


def gae(rewards: Array, values: Array, mask: Array, gamma: float, lam: float) -> tuple[Array, Array]:
    """Generalised advantage estimation over the response tokens.

    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
    A_t     = delta_t + gamma * lam * m_{t+1} * A_{t+1},     A = 0 where m = 0

    The value after the last response token is 0 (the episode ends).
    Returns ``(advantages, returns)``, both ``[B, T]``, with returns = A + V.
    """
    chex.assert_equal_shape([rewards, values, mask])
    mask = mask.astype(jnp.float32)
    values = values * mask
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    next_mask = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
    deltas = rewards + gamma * next_values * next_mask - values

    def step(carry, xs):
        delta, m_next, m = xs
        adv = (delta + gamma * lam * m_next * carry) * m
        return adv, adv

    _, adv = jax.lax.scan(step, jnp.zeros_like(rewards[:, 0]), (deltas.T, next_mask.T, mask.T), reverse=True)
    adv = adv.T
    return adv, (adv + values) * mask


def grpo(returns: Array, group_size: int, use_std: bool = True, eps: float = 1e-6) -> Array:
    """Group-normalised advantages ``[B]`` (Shao et al. 2024).

    Rows are laid out as consecutive groups of ``group_size`` responses to the
    same prompt. A_i = (R_i - mean_g R) / (std_g R + eps) with the population std,
    or without the division when ``use_std`` is false. A group whose rewards are
    all equal gets zero advantages.
    """
    chex.assert_rank(returns, 1)
    g = returns.reshape(-1, group_size)
    adv = g - g.mean(axis=1, keepdims=True)
    if use_std:
        adv = adv / (g.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1)


def rloo(returns: Array, group_size: int) -> Array:
    """Leave-one-out advantages ``[B]`` (Ahmadian et al. 2024; Kool et al. 2019).

    A_i = R_i - (sum_g R - R_i) / (G - 1)  =  G/(G-1) * (R_i - mean_g R).
    """
    chex.assert_rank(returns, 1)
    g = returns.reshape(-1, group_size)
    baseline = (g.sum(axis=1, keepdims=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def masked_moments(x: Array, mask: Array, axis_name: str | None = None) -> tuple[Array, Array]:
    """Mean and (population) variance of ``x`` over ``mask``, across ``axis_name`` if given."""
    mask = mask.astype(jnp.float32)
    s = jnp.stack([jnp.sum(x * mask), jnp.sum(mask)])
    if axis_name is not None:
        s = jax.lax.psum(s, axis_name)
    mean = s[0] / jnp.maximum(s[1], 1.0)
    sq = jnp.sum(jnp.square(x - mean) * mask)
    if axis_name is not None:
        sq = jax.lax.psum(sq, axis_name)
    return mean, sq / jnp.maximum(s[1], 1.0)


def whiten(x: Array, mask: Array, axis_name: str | None = None, shift_mean: bool = True) -> Array:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries; masked entries become 0."""
    mean, var = masked_moments(x, mask, axis_name)
    y = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        y = y + mean
    return y * mask


def whiten_rewards(rewards: Array, mask: Array, axis_name: str | None = None) -> Array:
    """TRL's ``whiten_rewards`` (``masked_whiten(rewards, mask, shift_mean=False)``, its unbiased
    ``masked_var``): ``r' = (r - mu) / sqrt(var + 1e-8) + mu`` over the masked tokens of the shaped
    per-token rewards (task reward and KL penalty), ``var = sum m (r - mu)^2 / (n - 1)``, ``n = sum m``;
    the mean is kept, the scale set to 1, masked entries 0. Statistics over this device's rows, as TRL
    computes them per process, or across ``axis_name``."""
    mask = mask.astype(jnp.float32)
    mean, var = masked_moments(rewards, mask, axis_name)
    n = jnp.sum(mask) if axis_name is None else jax.lax.psum(jnp.sum(mask), axis_name)
    var = var * n / jnp.maximum(n - 1.0, 1.0)  # Bessel's correction, as torch's (TRL's) var
    return ((rewards - mean) * jax.lax.rsqrt(var + 1e-8) + mean) * mask


# ---- the registry: one signature for the trainer --------------------------------------------------


@ADVANTAGES.register("gae")
def gae_estimator(x: AdvantageInputs, cfg: Any) -> tuple[Array, Array]:
    """:func:`gae` of the shaped per-token rewards with ``ppo.gamma``, ``ppo.lam``; with
    ``ppo.whiten_rewards`` the rewards first pass through :func:`whiten_rewards` (TRL's order)."""
    rewards = x.rewards
    if cfg.whiten_rewards:
        rewards = whiten_rewards(rewards, x.mask, x.axis_name)
    return gae(rewards, x.values, x.mask, cfg.gamma, cfg.lam)


@ADVANTAGES.register("grpo")
def grpo_estimator(x: AdvantageInputs, cfg: Any) -> tuple[Array, Array]:
    """:func:`grpo` of the sequence returns, broadcast over the response; no returns (no critic)."""
    a = grpo(x.seq_returns, cfg.group_size, cfg.group_std)
    return a[:, None] * x.mask, jnp.zeros_like(x.mask)


@ADVANTAGES.register("rloo")
def rloo_estimator(x: AdvantageInputs, cfg: Any) -> tuple[Array, Array]:
    """:func:`rloo` of the sequence returns, broadcast over the response; no returns (no critic)."""
    a = rloo(x.seq_returns, cfg.group_size)
    return a[:, None] * x.mask, jnp.zeros_like(x.mask)


def needs_critic(name: str) -> bool:
    """Whether the advantage estimator ``name`` reads a value function."""
    return bool(ADVANTAGES.meta(name)["critic"])
