"""Small heads on top of any trunk's final hidden states (:attr:`klrl.models.base.LMOutput.hidden`).

* :class:`ValueHead`: ``V(s_t) = w . h_t + b`` per position ``[B, T]`` (PPO's critic, on the
  policy's trunk or on a separate value trunk).
* :class:`ScalarHead`: the same linear map read at the last real response token ``[B]``
  (a reward model, sequence-classification style).

Both are one ``Dense(1)`` in float32 whose parameters are ``{'kernel': [D, 1], 'bias': [1]}``.
A trunk and its head share one parameter dict in the train state: the trunk's entries plus the
head's under :data:`HEAD_KEY` (:func:`attach`, :func:`detach`), the layout klrl's checkpoints
have always had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
HEAD_KEY = "v_head"


class _Root(nn.Module):
    # the head as flax's child ``v_head``: its initial values depend only on (key, path), so a head
    # initialised here equals the one a trunk module with a ``v_head`` child would have drawn
    @nn.compact
    def __call__(self, x: Array) -> Array:
        return nn.Dense(1, dtype=jnp.float32, name=HEAD_KEY)(x)


@dataclass(frozen=True)
class ValueHead:
    """``[B, T, D] -> [B, T]`` float32: one scalar per position."""

    hidden_size: int

    def init(self, key: Array) -> Any:
        return _Root().init(key, jnp.zeros((1, 1, self.hidden_size), jnp.float32))["params"][HEAD_KEY]

    def apply(self, params: Any, hidden: Array) -> Array:
        return _Root().apply({"params": {HEAD_KEY: params}}, hidden.astype(jnp.float32))[..., 0]


@dataclass(frozen=True)
class ScalarHead(ValueHead):
    """``[B, T, D]`` and the response ``mask [B, R]`` (the last ``R`` positions) -> ``[B]``: the
    head's value at the last real response token (0 for an empty response)."""

    def score(self, params: Any, hidden: Array, mask: Array) -> Array:
        value = self.apply(params, hidden)[:, hidden.shape[1] - mask.shape[1] :]
        n = jnp.sum(mask, axis=-1).astype(jnp.int32)
        last = jax.nn.one_hot(jnp.maximum(n - 1, 0), mask.shape[-1], dtype=jnp.float32) * (n > 0)[:, None]
        return jnp.sum(value * last, axis=-1)


def attach(trunk_params: Any, head_params: Any) -> dict:
    """One dict: the trunk's parameters plus the head's under :data:`HEAD_KEY`."""
    return {**trunk_params, HEAD_KEY: head_params}


def detach(params: Any) -> tuple[dict, Any]:
    """``(trunk parameters, head parameters or None)`` of an :func:`attach`-ed dict."""
    return {k: v for k, v in params.items() if k != HEAD_KEY}, params.get(HEAD_KEY)
