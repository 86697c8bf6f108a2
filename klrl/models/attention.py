"""Pieces shared by the pretrained families (:mod:`klrl.models.llama`, :mod:`klrl.models.gpt2`).

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
