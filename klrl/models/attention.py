"""Pieces shared by the families (:mod:`klrl.models.gpt`, :mod:`klrl.models.llama`, :mod:`klrl.models.gpt2`).

* :func:`positions_from_mask`, :func:`causal_mask`, :func:`attention_mask`: the position ids and the
  ``[B, T, S]`` attention mask of :class:`klrl.models.base.CausalLM`'s conventions (re-exported there).
* :func:`attention`: grouped-query softmax attention over ``[B, T, H, Dh]`` queries and either
  fresh ``[B, S, Hkv, Dh]`` keys/values or a cache layer's ``[B, Hkv, S, Dh]``;
  ``softmax(q k^T * scale + mask) v``, scores and softmax in float32 as transformers' eager
  attention does (``modeling_llama.eager_attention_forward``); query head ``h`` reads key head
  ``h // (H / Hkv)`` (``repeat_kv``).
* :func:`write_cache`: the KV cache is one ``[L, B, Hkv, S, Dh]`` buffer per k and v, carried
  through the layer scan; layer ``i`` writes its ``T`` new slots at ``index`` with
  ``dynamic_update_slice`` (in place in the carried buffer) and reads its own ``[B, Hkv, S, Dh]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
NEG_INF = -1e9


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


def attention_mask(tokens: Array, positions: Array, mask: Array, cached: bool) -> Array:
    """The ``[B, T, S]`` attention mask of a family's ``apply``, its inputs' shapes checked first (at
    trace time: shapes are static). ``mask [B, T]`` without a cache is a padding mask (1 = real token,
    as transformers' ``attention_mask``): :func:`causal_mask` of it; ``[B, T, S]`` is used as given.
    Any other shape (a ``[B, T]`` mask with a cache, a batch or length that is not the tokens') is a
    ``ValueError`` naming the shapes expected."""
    shape, mask = jnp.shape(tokens), jnp.asarray(mask)
    if len(shape) != 2:
        raise ValueError(f"tokens: shape {shape}, expected [B, T] (a batch of token ids)")
    b, t = shape
    if jnp.shape(positions) != (b, t):
        raise ValueError(
            f"positions: shape {jnp.shape(positions)}, expected [B, T] = {(b, t)} like tokens "
            "(klrl.models.attention.positions_from_mask(mask) for left-padded rows)"
        )
    want = f"[B, T] = {(b, t)} (a padding mask, 1 = real token; no cache) or [B, T, S] = {(b, t)} + (S,)"
    if mask.ndim == 2 and tuple(mask.shape) == (b, t) and not cached:
        return causal_mask(mask)
    if mask.ndim == 3 and tuple(mask.shape[:2]) == (b, t) and (cached or mask.shape[2] == t):
        return mask
    with_cache = " (with a cache: [B, T, S], S the cache length)" if cached else " (S = T without a cache)"
    raise ValueError(f"mask: shape {tuple(mask.shape)}, expected {want}{with_cache}")


def attention(q: Array, k: Array, v: Array, mask: Array, scale: float, *, cached: bool) -> Array:
    """``q [B, T, H, Dh]``; ``k, v [B, S, Hkv, Dh]`` (``cached=False``) or ``[B, Hkv, S, Dh]``
    (``cached=True``); ``mask [B, T, S]`` bool -> ``[B, T, H * Dh]`` in ``q``'s dtype."""
    b, t, h, dh = q.shape
    hkv = k.shape[1] if cached else k.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, dh)
    ks = "bksd" if cached else "bskd"
    scores = jnp.einsum(f"btkgd,{ks}->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * scale, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum(f"bkgts,{ks}->btkgd", probs, v.astype(q.dtype))
    return out.reshape(b, t, h * dh)


def write_cache(cache: dict, layer: Array, k: Array, v: Array, index: Array) -> tuple[dict, Array, Array]:
    """Write ``k, v [B, T, Hkv, Dh]`` into slots ``index..index+T`` of layer ``layer`` of the
    carried ``cache = {'k', 'v': [L, B, Hkv, S, Dh]}``; return the cache and that layer's k, v."""
    out = {}
    for name, new in (("k", k), ("v", v)):
        buf = cache[name]
        new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)[None]  # [1, B, Hkv, T, Dh]
        zero = jnp.zeros((), jnp.int32)
        buf = jax.lax.dynamic_update_slice(buf, new, (layer, zero, zero, jnp.asarray(index, jnp.int32), zero))
        out[name] = buf
    kl = jax.lax.dynamic_index_in_dim(out["k"], layer, 0, keepdims=False)
    vl = jax.lax.dynamic_index_in_dim(out["v"], layer, 0, keepdims=False)
    return out, kl, vl


def empty_cache(layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype) -> dict:
    """A zero KV cache ``{'k', 'v': [L, B, Hkv, S, Dh]}``."""
    shape = (layers, batch, kv_heads, length, head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
