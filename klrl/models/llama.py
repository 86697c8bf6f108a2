"""Llama-family decoders (transformers' ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``) as one flax module with flags.

Per layer (``modeling_llama.LlamaDecoderLayer``)::

    h = x + o(attn(rope(q(rms(x))), rope(k(rms(x))), v(rms(x))))
    y = h + down(silu(gate(rms(h))) * up(rms(h)))

with ``rms(x) = w * x / sqrt(mean(x^2) + eps)`` (computed in float32, ``LlamaRMSNorm``),
half-split rotary embeddings (``rotate_half``) with base ``rope_theta`` and the ``linear`` or
``llama3`` frequency scaling (``modeling_rope_utils``), grouped-query attention, and a tied
(``x @ E^T``) or separate head. Qwen2 is Llama with biases on q, k and v (``qkv_bias``).

The layers are one ``nn.scan`` over stacked parameters (leading axis ``L``), so a 30-layer model
compiles as one layer; the KV cache ``{'k', 'v': [L, B, Hkv, S, Dh]}`` is carried through the
scan and written in place (:func:`klrl.models.attention.write_cache`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from klrl.models.attention import attention, attention_mask, write_cache
from klrl.models.base import FlaxLM, LMOutput, PeftLayout
from klrl.models.llama_gguf import READING
from klrl.models.llama_hf import (  # noqa: F401  (re-exported: the family's config API)
    LlamaConfig,
    config_from_hf,
    config_to_hf,
    layer_shapes,
    stack_layers,
    unstack_layers,
)
from klrl.models.registry import register_family
from klrl.models.remat import remat_block
from klrl.models.sharding import split_rows

Array = jax.Array
_INIT = nn.initializers.normal(0.02)
# the adaptable layers: klrl module -> HF module path inside a layer (model.layers.{i}.self_attn.q_proj, ...)
_MODULES = {
    **{m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{m: f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")},
}


def inv_frequencies(c: LlamaConfig) -> np.ndarray:
    """``theta^(-2i/Dh)`` in float32, with HF's ``linear`` or ``llama3`` scaling
    (``modeling_rope_utils._compute_llama3_parameters``)."""
    dh = c.head_dim
    inv = (
        1.0 / (np.float32(c.rope_theta) ** (np.arange(0, dh, 2).astype(np.float32) / np.float32(dh)))
    ).astype(np.float32)
    rs = dict(c.rope_scaling)
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_tables(inv_freq: np.ndarray, positions: Array) -> tuple[Array, Array]:
    """``positions [B, T]`` -> ``cos, sin [B, T, Dh]`` (float32; halves repeated, HF layout)."""
    f = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """``x [B, T, H, Dh]``: ``x cos + rotate_half(x) sin``, ``rotate_half(x) = [-x2, x1]``."""
    cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return w.astype(self.dtype) * y.astype(self.dtype)


class Block(nn.Module):
    c: LlamaConfig
    dtype: Any

    @nn.compact
    def __call__(self, carry, cos, sin, mask, index):
        x, cache, layer = carry
        c, dt = self.c, self.dtype
        b, t, _ = x.shape
        dense = lambda n, bias, name: nn.Dense(n, use_bias=bias, dtype=dt, kernel_init=_INIT, name=name)
        # the projections see [B T, width] rows: with [B, T, width] the weight gradients contract two
        # batch dimensions and XLA:CPU wrote each cotangent a second time, transposed ([width, B T]),
        # for them (benchmarks/NOTES.md, issue 38 item 7); the values are the same
        rows = lambda a: a.reshape(b * t, a.shape[-1])
        y = rows(RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x))
        q = dense(c.num_attention_heads * c.head_dim, c.qkv_bias, "q_proj")(y)
        k = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias, "k_proj")(y)
        v = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias, "v_proj")(y)
        q = apply_rope(q.reshape(b, t, c.num_attention_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(b, t, c.num_key_value_heads, c.head_dim), cos, sin)
        v = v.reshape(b, t, c.num_key_value_heads, c.head_dim)
        if cache is not None:
            cache, k, v = write_cache(cache, layer, k, v, index)
        a = attention(q, k, v, mask, c.head_dim**-0.5, cached=cache is not None)
        x = x + dense(c.hidden_size, c.o_bias, "o_proj")(rows(a)).reshape(x.shape)
        y = rows(RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x))
        g = dense(c.intermediate_size, c.mlp_bias, "gate_proj")(y)
        u = dense(c.intermediate_size, c.mlp_bias, "up_proj")(y)
        x = x + dense(c.hidden_size, c.mlp_bias, "down_proj")(nn.silu(g) * u).reshape(x.shape)
        return (split_rows(x), cache, layer + 1), None  # rows on fsdp (klrl.step.parallel)


class LlamaModule(nn.Module):
    c: LlamaConfig
    dtype: Any
    remat: str = "none"  # klrl.models.remat.REMAT_MODES

    @nn.compact
    def __call__(self, tokens, positions, mask, cache=None, index=None, logits=True):
        c = self.c
        mask = attention_mask(tokens, positions, mask, cache is not None)  # shapes checked; [B, T] ok
        embed = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, embedding_init=_INIT, name="embed_tokens"
        )
        x = split_rows(embed(tokens))
        cos, sin = rope_tables(inv_frequencies(c), positions)
        block = remat_block(Block, self.remat)
        layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.num_hidden_layers,
        )(c, self.dtype, name="layers")
        idx = jnp.asarray(0 if index is None else index, jnp.int32)
        (x, cache, _), _ = layers((x, cache, jnp.zeros((), jnp.int32)), cos, sin, mask, idx)
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x)
        out = None
        if logits:
            if c.tie_word_embeddings:
                out = embed.attend(x)
            else:
                out = nn.Dense(
                    c.vocab_size, use_bias=False, dtype=self.dtype, kernel_init=_INIT, name="lm_head"
                )(x)
            out = out.astype(jnp.float32)
        return LMOutput(out, x, cache)


@register_family("llama", hf=("llama", "mistral", "qwen2"), hf_config=config_from_hf, gguf=READING)
@dataclasses.dataclass(frozen=True)
class Llama(FlaxLM):
    """A Llama/Mistral/Qwen2 causal LM implementing :class:`klrl.models.base.CausalLM`.

    ``dtype`` is the compute dtype (float32 or bfloat16); parameters stay float32.
    """

    MODULE = LlamaModule
    EMBEDDING = "embed_tokens"  # the tied head: x @ E^T
    LORA_TARGETS = f"layers/({'|'.join(_MODULES)})"  # klrl.models.lora
    # MaxText/tunix-style: embedding rows on ``tensor``, width on ``fsdp``; q/k/v/gate/up column-parallel,
    # o/down row-parallel (leading axis: layers, unsharded)
    PARTITION_RULES = (
        (r"embed_tokens/embedding$", P("tensor", "fsdp")),
        (r"lm_head/kernel$", P("fsdp", "tensor")),
        (r"layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P(None, "fsdp", "tensor")),
        (r"layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P(None, "tensor")),
        (r"layers/(o_proj|down_proj)/kernel$", P(None, "tensor", "fsdp")),
    )
    PEFT = PeftLayout("layers", "model.layers", _MODULES, {m: m for m in _MODULES}, False)

    config: LlamaConfig

    def hf_config(self) -> dict:
        return config_to_hf(self.config)

    # ---- HF tensors <-> parameters ---------------------------------------------------------

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """Older files keep the rotary ``inv_freq`` buffer: ignored (``None``)."""
        return None if name.endswith("rotary_emb.inv_freq") else name

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, with its (torch-layout) shape."""
        c = self.config
        d = c.hidden_size
        s = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
        if not c.tie_word_embeddings:
            s["lm_head.weight"] = (c.vocab_size, d)
        for i in range(c.num_hidden_layers):
            for name, shape in layer_shapes(c).items():
                s[f"model.layers.{i}.{name}"] = shape
        return s

    def params_from_hf(self, get, put=None) -> dict:
        """``get(name) -> np.ndarray`` (HF names, torch layout) -> float32 parameters; each leaf
        goes through ``put`` (e.g. ``jnp.asarray``) as soon as it is complete."""
        put = put or (lambda a: a)
        c = self.config
        p = {
            "embed_tokens": {"embedding": put(get("model.embed_tokens.weight"))},
            "norm": {"scale": put(get("model.norm.weight"))},
            "layers": stack_layers(c.num_hidden_layers, layer_shapes(c), get, put),
        }
        if not c.tie_word_embeddings:
            p["lm_head"] = {"kernel": put(np.ascontiguousarray(get("lm_head.weight").T))}
        return {"params": p}

    def params_to_hf(self, params) -> dict[str, np.ndarray]:
        p = jax.tree.map(lambda a: np.asarray(a, np.float32), params["params"])
        c = self.config
        out = {
            "model.embed_tokens.weight": p["embed_tokens"]["embedding"],
            "model.norm.weight": p["norm"]["scale"],
        }
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = p["lm_head"]["kernel"].T
        out.update(unstack_layers(c.num_hidden_layers, p["layers"]))
        return out
