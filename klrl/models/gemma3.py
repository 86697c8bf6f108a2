"""Gemma 3 text decoders (transformers' ``Gemma3ForCausalLM``, e.g. Google's Gemma 3 270M) as one
flax module.

Per layer (``modeling_gemma3.Gemma3DecoderLayer``)::

    h = x + post_attn_norm(o(attn(rope(q_norm(q(n))), rope(k_norm(k(n))), v(n))))   n = input_norm(x)
    y = h + post_ffw_norm(down(gelu_tanh(gate(m)) * up(m)))                          m = pre_ffw_norm(h)

with every norm ``x / sqrt(mean(x^2) + eps) * (1 + w)`` computed in float32 (``Gemma3RMSNorm``; the
parameters hold HF's ``w``, zero-centred), q_norm/k_norm over ``head_dim`` before the rotary
embedding, attention scores scaled by ``query_pre_attn_scalar ** -0.5``, grouped-query attention,
embeddings scaled by ``sqrt(hidden_size)`` (in the compute dtype, as transformers casts the scale
to the embedding's dtype), a tied head and, if set, ``final_logit_softcapping`` (``c tanh(z / c)``).

Layers are local or global (``layer_types``): a ``sliding_attention`` layer's query at slot ``t``
attends to slots ``t - sliding_window + 1 .. t`` only (``masking_utils.sliding_window_overlay``:
``kv > q - window``) and its RoPE base is ``rope_local_theta`` (10000); a ``full_attention`` layer
sees the whole causal prefix with base ``rope_theta`` (1e6, optionally ``linear``-scaled). The
layers are one ``nn.scan`` over stacked parameters like :mod:`klrl.models.llama`; each layer picks
its mask and rotary table by its index. The KV cache holds every slot for every layer (a local
layer masks the old ones).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from klrl.models.attention import attention, write_cache
from klrl.models.base import FlaxLM, LMOutput
from klrl.models.gemma3_io import (
    READING,
    Gemma3Config,
    config_from_hf,
    config_to_hf,
    layer_shapes,
    stack_layers,
    unstack_layers,
)
from klrl.models.llama import Llama, apply_rope, rope_tables
from klrl.models.registry import register_family
from klrl.models.remat import remat_block
from klrl.models.sharding import split_rows

Array = jax.Array
_INIT = nn.initializers.normal(0.02)

__all__ = ["Gemma3", "Gemma3Config", "config_from_hf", "config_to_hf"]


def inv_frequencies(dh: int, theta: float, scaling: tuple = ()) -> np.ndarray:
    """``theta^(-2i/Dh)`` in float32 (``compute_default_rope_parameters``), divided by a ``linear``
    scaling's factor."""
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, dh, 2).astype(np.float32) / np.float32(dh)))
    rs = dict(scaling)
    if rs.get("rope_type", "default") == "linear":
        inv = inv / np.float32(rs["factor"])
    return inv.astype(np.float32)


def local_mask(mask: Array, window: int, index: Array) -> Array:
    """``mask [B, T, S]`` restricted to a sliding window: query ``t`` (slot ``index + t``; without a
    cache ``index`` is 0) keeps key slot ``s`` only if ``s > index + t - window``."""
    t, s = mask.shape[-2:]
    q = jnp.arange(t)[:, None] + index
    return mask & (jnp.arange(s)[None, :] > q - window)[None]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + w)`` in float32, cast back to ``x``'s dtype."""

    eps: float

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + w)).astype(x.dtype)


class Block(nn.Module):
    c: Gemma3Config
    dtype: Any

    @nn.compact
    def __call__(self, carry, tables, masks, index):
        x, cache, layer = carry
        c, dt = self.c, self.dtype
        b, t, _ = x.shape
        is_local = jnp.asarray([k == "sliding_attention" for k in c.layer_types])[layer]
        cos, sin = (jnp.where(is_local, loc, glob) for loc, glob in zip(tables[2:], tables[:2], strict=True))
        mask = jnp.where(is_local, masks[1], masks[0])
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=dt, kernel_init=_INIT, name=name)
        norm = lambda name: RMSNorm(c.rms_norm_eps, name=name)
        nq, nkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        y = norm("input_layernorm")(x)
        q = norm("q_norm")(dense(nq * dh, "q_proj")(y).reshape(b, t, nq, dh))
        k = norm("k_norm")(dense(nkv * dh, "k_proj")(y).reshape(b, t, nkv, dh))
        v = dense(nkv * dh, "v_proj")(y).reshape(b, t, nkv, dh)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache, k, v = write_cache(cache, layer, k, v, index)
        a = attention(q, k, v, mask, c.query_pre_attn_scalar**-0.5, cached=cache is not None)
        x = x + norm("post_attention_layernorm")(dense(c.hidden_size, "o_proj")(a))
        y = norm("pre_feedforward_layernorm")(x)
        h = nn.gelu(dense(c.intermediate_size, "gate_proj")(y), approximate=True)
        h = h * dense(c.intermediate_size, "up_proj")(y)
        x = x + norm("post_feedforward_layernorm")(dense(c.hidden_size, "down_proj")(h))
        return (split_rows(x), cache, layer + 1), None


def softcap(logits: Array, cap: float | None) -> Array:
    return logits if cap is None else jnp.tanh(logits / cap) * cap


class Gemma3Module(nn.Module):
    c: Gemma3Config
    dtype: Any
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens, positions, mask, cache=None, index=None, logits=True):
        c = self.c
        embed = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, embedding_init=_INIT, name="embed_tokens"
        )
        x = split_rows(embed(tokens) * jnp.asarray(c.hidden_size**0.5, self.dtype))
        dh = c.head_dim
        tables = (
            *rope_tables(inv_frequencies(dh, c.rope_theta, c.rope_scaling), positions),
            *rope_tables(inv_frequencies(dh, c.rope_local_theta), positions),
        )
        idx = jnp.asarray(0 if index is None else index, jnp.int32)
        masks = (mask, local_mask(mask, c.sliding_window, idx))
        layers = nn.scan(
            remat_block(Block, self.remat),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.num_hidden_layers,
        )(c, self.dtype, name="layers")
        (x, cache, _), _ = layers((x, cache, jnp.zeros((), jnp.int32)), tables, masks, idx)
        x = RMSNorm(c.rms_norm_eps, name="norm")(x)
        out = None
        if logits:
            if c.tie_word_embeddings:
                out = embed.attend(x)
            else:
                out = nn.Dense(
                    c.vocab_size, use_bias=False, dtype=self.dtype, kernel_init=_INIT, name="lm_head"
                )(x)
            out = softcap(out.astype(jnp.float32), c.final_logit_softcapping)
        return LMOutput(out, x, cache)


@register_family("gemma3", hf=("gemma3_text",), hf_config=config_from_hf, gguf=READING)
@dataclasses.dataclass(frozen=True)
class Gemma3(FlaxLM):
    """A Gemma 3 causal LM implementing :class:`klrl.models.base.CausalLM` (module docstring).

    ``dtype`` is the compute dtype (float32 or bfloat16); parameters stay float32.
    """

    MODULE = Gemma3Module
    EMBEDDING = "embed_tokens"  # the tied head: x @ E^T
    LORA_TARGETS = Llama.LORA_TARGETS  # Llama's module names (klrl.models.lora)
    PARTITION_RULES = Llama.PARTITION_RULES

    config: Gemma3Config

    def head(self, params, hidden: Array) -> Array:
        """The LM head alone (final hidden states -> float32 logits, soft-capped), as in :meth:`apply`."""
        return softcap(super().head(params, hidden), self.config.final_logit_softcapping)

    def hf_config(self) -> dict:
        return config_to_hf(self.config)

    # ---- HF tensors <-> parameters ---------------------------------------------------------

    @staticmethod
    def canonical_name(name: str) -> str | None:
        return name

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, with its (torch-layout) shape."""
        c = self.config
        s = {
            "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
            "model.norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            s["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            for name, shape in layer_shapes(c).items():
                s[f"model.layers.{i}.{name}"] = shape
        return s

    def params_from_hf(self, get, put=None) -> dict:
        """``get(name) -> np.ndarray`` (HF names, torch layout) -> float32 parameters."""
        put = put or (lambda a: a)
        c = self.config
        p = {
            "embed_tokens": {"embedding": put(get("model.embed_tokens.weight"))},
            "norm": {"scale": put(get("model.norm.weight"))},
            "layers": stack_layers(c, get, put),
        }
        if not c.tie_word_embeddings:
            p["lm_head"] = {"kernel": put(np.ascontiguousarray(get("lm_head.weight").T))}
        return {"params": p}

    def params_to_hf(self, params) -> dict[str, np.ndarray]:
        p = jax.tree.map(lambda a: np.asarray(a, np.float32), params["params"])
        out = {
            "model.embed_tokens.weight": p["embed_tokens"]["embedding"],
            "model.norm.weight": p["norm"]["scale"],
        }
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = p["lm_head"]["kernel"].T
        out.update(unstack_layers(self.config, p["layers"]))
        return out
