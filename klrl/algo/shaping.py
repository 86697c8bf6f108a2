"""Scored rollout -> per-token rewards: the task reward and the KL penalty.

Placements (``KLConfig.placement``):

* ``reward`` (Ziegler et al. 2019; TRL PPO, OpenRLHF, verl ``use_kl_in_reward``):
  r_t = -beta * kl_t for every response token, plus the task reward R at the
  last response token.
* ``sequence`` (RLOO-style sequence penalty): r_T = R - beta * sum_t kl_t at the
  last token, 0 elsewhere. Same total, different credit assignment.
* ``loss`` (GRPO-style): the reward carries R alone; the KL enters the policy
  loss (see :mod:`klrl.algo.losses`).
* ``reward+loss``: both.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def last_token_onehot(mask: Array) -> Array:
    """``[B, T]`` one-hot of each row's last unmasked position (responses are contiguous)."""
    length = jnp.sum(mask, axis=-1).astype(jnp.int32)
    idx = jnp.maximum(length - 1, 0)
    return jax.nn.one_hot(idx, mask.shape[-1], dtype=jnp.float32) * (length > 0)[:, None]


def shaped_rewards(task_reward: Array, kl_tok: Array, mask: Array, beta: Array, placement: str) -> Array:
    """Per-token rewards ``[B, T]``.

    Args:
      task_reward: ``[B]`` sequence-level reward R.
      kl_tok: ``[B, T]`` per-token KL estimate (0 at masked positions).
      mask: ``[B, T]`` response mask.
      beta: scalar coefficient (a traced array: no Python branching on it).
      placement: one of ``reward``, ``sequence``, ``loss``, ``reward+loss``.
    """
    chex.assert_equal_shape([kl_tok, mask])
    chex.assert_shape(task_reward, mask.shape[:1])
    last = last_token_onehot(mask)
    kl_tok = kl_tok * mask
    if placement in ("reward", "reward+loss"):
        return (task_reward[:, None] * last - beta * kl_tok) * mask
    if placement == "sequence":
        return (task_reward - beta * jnp.sum(kl_tok, axis=-1))[:, None] * last
    if placement == "loss":
        return task_reward[:, None] * last
    raise ValueError(f"kl.placement: unknown placement {placement!r}")


def sequence_returns(task_reward: Array, kl_tok: Array, mask: Array, beta: Array, placement: str) -> Array:
    """``[B]`` undiscounted sum of shaped rewards: the scalar a critic-free estimator sees."""
    return jnp.sum(shaped_rewards(task_reward, kl_tok, mask, beta, placement), axis=-1)


def missing_eos_penalty(
    reward: chex.Array, response: chex.Array, mask: chex.Array, stop_ids: tuple[int, ...], penalty: float
) -> chex.Array:
    """``R_b - penalty * [no valid token of response b is a stop id]`` (``[B]``).

    TRL's ``missing_eos_penalty`` (PPO/RLOO trainers: ``scores[~contain_eos_token] -=
    missing_eos_penalty``): a response that ran out of ``sampling.response_len`` without a stop token
    is penalised; ``response [B, R]`` int, ``mask [B, R]`` (a kept stop token has mask 1).
    """
    hit = jnp.zeros(response.shape, bool)
    for i in stop_ids:
        hit = hit | (response == i)
    stopped = jnp.any(hit & (mask > 0), axis=-1)
    return reward - jnp.where(stopped, 0.0, penalty).astype(reward.dtype)
