"""A GPT-2-style decoder in flax: full teacher-forced forward and KV-cache decoding.

Learned positions, pre-LayerNorm blocks, GELU MLP, optional tied embeddings,
optional scalar head. The same module serves as policy (LM head, optionally a
value head on the trunk), as a separate value model and as a reward model
(scalar head only).

Shapes: tokens ``[B, T]``; ``positions [B, T]`` (left padding shifts them);
``key_mask [B, S]`` marks which cache slots hold real tokens. The KV cache is an
explicit pytree, one ``(k, v)`` pair of ``[B, H, S, Dh]`` arrays per layer, threaded
by the caller, so decoding is a plain ``lax.scan``. Keys and values are kept in the
layout the attention matmuls read (heads before slots) and each layer's pair is its own
leaf, so a decode step writes one slot in place instead of copying or transposing the
whole cache (``benchmarks/NOTES.md``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from klrl.config import ModelConfig

Array = jax.Array
NEG_INF = -1e9
Cache = tuple[tuple[Array, Array], ...]  # per layer (k, v), each [B, H, S, Dh]


class ModelOutput(NamedTuple):
    logits: Array | None  # [B, T, V] float32, None without an LM head
    hidden: Array  # [B, T, D] final (post-LayerNorm) hidden states
    value: Array | None  # [B, T] float32 scalar head, None without one
    cache: Cache | None


class Block(nn.Module):
    d_model: int
    n_heads: int
    mlp_ratio: int
    dtype: Any

    @nn.compact
    def __call__(self, x: Array, mask: Array, cache: tuple[Array, Array] | None, index: Array | None):
        b, t, d = x.shape
        h, dh = self.n_heads, d // self.n_heads
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
        y = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        qkv = dense(3 * d, "qkv")(y).reshape(b, t, 3, h, dh)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, Dh]
        if cache is not None:  # decode: keys and values live in the cache's [B, H, S, Dh]
            ck, cv = cache
            k = jax.lax.dynamic_update_slice_in_dim(ck, jnp.swapaxes(k, 1, 2).astype(ck.dtype), index, 2)
            v = jax.lax.dynamic_update_slice_in_dim(cv, jnp.swapaxes(v, 1, 2).astype(cv.dtype), index, 2)
            new_cache = (k, v)
            scores, mix = "bqhd,bhkd->bhqk", "bhqk,bhkd->bqhd"
        else:  # full forward: [B, T, H, Dh] as projected (measured faster than [B, H, T, Dh] here)
            new_cache = None
            scores, mix = "bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"
        att = jnp.einsum(scores, q, k.astype(q.dtype)).astype(jnp.float32) / jnp.sqrt(dh)
        att = jnp.where(mask[:, None], att, NEG_INF)
        att = jax.nn.softmax(att, axis=-1).astype(self.dtype)
        y = jnp.einsum(mix, att, v.astype(self.dtype)).reshape(b, t, d)
        x = x + dense(d, "proj")(y)
        y = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        y = dense(self.mlp_ratio * d, "fc")(y)
        y = dense(d, "out")(nn.gelu(y, approximate=True))
        return x + y, new_cache


class GPT(nn.Module):
    """Decoder-only transformer. ``lm_head`` and ``scalar_head`` select the heads."""

    cfg: ModelConfig
    vocab_size: int
    max_len: int
    lm_head: bool = True
    scalar_head: bool = False

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array,
        mask: Array,
        cache: Cache | None = None,
        index: Array | int | None = None,
    ) -> ModelOutput:
        """``mask [B, T, S]``: query t may attend key s (causality and padding folded in).

        Without a cache S = T. With a cache the T new tokens are written at slot ``index``.
        """
        cfg = self.cfg
        dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
        wte = nn.Embed(self.vocab_size, cfg.d_model, name="wte")
        wpe = nn.Embed(self.max_len, cfg.d_model, name="wpe")
        x = (wte(tokens) + wpe(positions)).astype(dtype)
        new_cache = []
        for i in range(cfg.n_layers):
            layer_cache = None if cache is None else cache[i]
            x, nc = Block(cfg.d_model, cfg.n_heads, cfg.mlp_ratio, dtype, name=f"h{i}")(
                x, mask, layer_cache, index
            )
            new_cache.append(nc)
        x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
        logits = None
        if self.lm_head:
            if cfg.tie_embeddings:
                logits = wte.attend(x)
            else:
                logits = nn.Dense(self.vocab_size, use_bias=False, dtype=dtype, name="lm")(x)
            logits = logits.astype(jnp.float32)
        value = None
        if self.scalar_head:
            value = nn.Dense(1, dtype=jnp.float32, name="v_head")(x.astype(jnp.float32))[..., 0]
        return ModelOutput(logits, x, value, None if cache is None else tuple(new_cache))


# ---- helpers shared by rollout, scoring and the update ----------------------


def positions_from_mask(mask: Array) -> Array:
    """Position ids for left-padded rows: the first real token gets 0."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(key_mask: Array) -> Array:
    """``[B, S] -> [B, S, S]``: causal attention restricted to real keys.

    A padded query attends to itself so its softmax stays defined.
    """
    s = key_mask.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    m = causal[None] & key_mask.astype(bool)[:, None, :]
    return m | jnp.eye(s, dtype=bool)[None]


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
    """An empty cache of ``length`` slots: per layer ``(k, v)``, each ``[B, H, S, Dh]``."""
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    shape = (batch, cfg.n_heads, length, cfg.d_model // cfg.n_heads)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers))


def forward(model: GPT, params: Any, tokens: Array, key_mask: Array) -> ModelOutput:
    """Teacher-forced forward of whole left-padded sequences ``[B, S]``."""
    return model.apply({"params": params}, tokens, positions_from_mask(key_mask), causal_mask(key_mask))


def token_logprobs(logits: Array, tokens: Array) -> Array:
    """``log softmax(logits)[..., token]`` in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def entropy(logits: Array) -> Array:
    """Entropy of the softmax over the last axis, in nats."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def init_params(model: GPT, key: Array, seq_len: int) -> Any:
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    mask = jnp.ones((1, seq_len), jnp.float32)
    return model.init(key, tokens, positions_from_mask(mask), causal_mask(mask))["params"]


def matmul_flops(cfg: ModelConfig, vocab: int, tokens: int, context: int, lm_head: bool = True) -> int:
    """Matmul FLOPs (2 per multiply-add) of a forward over ``tokens`` positions.

    ``context`` is the number of keys each query attends to (for the attention
    score and mixing matmuls). Counted: qkv, output projection, MLP, attention
    scores and mixing, and the LM head if present. Backward = 2x forward.
    """
    d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    per_token = cfg.n_layers * (2 * d * 3 * d + 2 * d * d + 2 * 2 * d * f + 2 * 2 * context * d)
    if lm_head:
        per_token += 2 * d * vocab
    return int(per_token * tokens)
