"""Per-token log-probabilities and entropy from logits: pure maths on ``[..., V]`` arrays.

Both work in float32 whatever the logits' dtype (a bf16 log-softmax loses the small
probabilities the KL and the policy ratio are made of). They are shared by the policy
update, the chunked head, the rollout's scoring and the tasks, so they live with the
algorithm rather than with a model family.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def token_logprobs(logits: Array, tokens: Array) -> Array:
    """``log softmax(logits)[..., token]`` in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def entropy(logits: Array) -> Array:
    """Entropy of the softmax over the last axis, in nats."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
