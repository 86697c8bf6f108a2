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

from klrl.models.attention import attention, empty_cache, write_cache
from klrl.models.base import LMOutput

Array = jax.Array
_INIT = nn.initializers.normal(0.02)
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """The fields of an HF Llama/Mistral/Qwen2 ``config.json`` that define the function."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) items of HF's rope parameters beyond the base
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    tokens: tuple = ()  # (name, id) for bos/eos/pad, written back on export

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        kind = dict(self.rope_scaling).get("rope_type", "default")
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


def _freeze(v):
    return tuple(v) if isinstance(v, list) else v


def config_from_hf(d: dict) -> LlamaConfig:
    """An HF ``config.json`` dict (transformers 4 ``rope_theta``/``rope_scaling`` or 5
    ``rope_parameters``) -> :class:`LlamaConfig`; ``KeyError``/``ValueError`` name the field."""
    mt = d.get("model_type", "llama")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {d['hidden_act']!r} is not supported (silu)")
    if d.get("use_sliding_window") or (mt == "mistral" and d.get("sliding_window") is not None):
        raise ValueError("sliding_window: sliding-window attention is not supported")
    rope = dict(d.get("rope_parameters") or {})
    rope.update(d.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") == "default":
        rope = {}
    heads = d["num_attention_heads"]
    return LlamaConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=tuple(sorted((k, _freeze(v)) for k, v in rope.items())),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bool(d.get("attention_bias", False)) or mt == "qwen2",
        o_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        model_type=mt,
        tokens=tuple((k, _freeze(d[k])) for k in _TOKEN_FIELDS if d.get(k) is not None),
    )


def config_to_hf(c: LlamaConfig) -> dict:
    """:class:`LlamaConfig` -> an HF ``config.json`` dict transformers 4 and 5 read."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    rope = dict(c.rope_scaling)
    d = {
        "architectures": [arch[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": c.tie_word_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope or None,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default", **rope},
        "torch_dtype": "float32",
    }
    if c.model_type == "qwen2":
        d["use_sliding_window"] = False
    else:
        d["attention_bias"] = c.o_bias
        d["mlp_bias"] = c.mlp_bias
    d.update({k: list(v) if isinstance(v, tuple) else v for k, v in c.tokens})
    return d


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
        y = RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x)
        q = dense(c.num_attention_heads * c.head_dim, c.qkv_bias, "q_proj")(y)
        k = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias, "k_proj")(y)
        v = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias, "v_proj")(y)
        q = apply_rope(q.reshape(b, t, c.num_attention_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(b, t, c.num_key_value_heads, c.head_dim), cos, sin)
        v = v.reshape(b, t, c.num_key_value_heads, c.head_dim)
        if cache is not None:
            cache, k, v = write_cache(cache, layer, k, v, index)
        a = attention(q, k, v, mask, c.head_dim**-0.5, cached=cache is not None)
        x = x + dense(c.hidden_size, c.o_bias, "o_proj")(a)
        y = RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        g = dense(c.intermediate_size, c.mlp_bias, "gate_proj")(y)
        u = dense(c.intermediate_size, c.mlp_bias, "up_proj")(y)
        x = x + dense(c.hidden_size, c.mlp_bias, "down_proj")(nn.silu(g) * u)
        return (x, cache, layer + 1), None


class LlamaModule(nn.Module):
    c: LlamaConfig
    dtype: Any
    remat: bool = False

    @nn.compact
    def __call__(self, tokens, positions, mask, cache=None, index=None, logits=True):
        c = self.c
        embed = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, embedding_init=_INIT, name="embed_tokens"
        )
        x = embed(tokens)
        cos, sin = rope_tables(inv_frequencies(c), positions)
        block = nn.remat(Block) if self.remat else Block
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


@dataclasses.dataclass(frozen=True)
class Llama:
    """A Llama/Mistral/Qwen2 causal LM implementing :class:`klrl.models.base.CausalLM`.

    ``dtype`` is the compute dtype (float32 or bfloat16); parameters stay float32.
    """

    config: LlamaConfig
    dtype: Any = jnp.float32
    remat: bool = False

    @property
    def module(self) -> LlamaModule:
        return LlamaModule(self.config, self.dtype, self.remat)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_len(self) -> int:
        return self.config.max_position_embeddings

    def init(self, key: Array):
        t = jnp.zeros((1, 2), jnp.int32)
        m = jnp.ones((1, 2, 2), bool)
        return self.module.init(key, t, t, m)

    def apply(self, params, tokens, positions, mask, cache=None, index=None, *, logits=True) -> LMOutput:
        return self.module.apply(params, tokens, positions, mask, cache, index, logits)

    def init_cache(self, batch: int, length: int):
        c = self.config
        return empty_cache(c.num_hidden_layers, batch, c.num_key_value_heads, length, c.head_dim, self.dtype)

    def partition_rules(self):
        """MaxText/tunix-style: embedding rows on ``tensor``, width on ``fsdp``; q/k/v/gate/up
        column-parallel, o/down row-parallel (leading axis: layers, unsharded)."""
        return (
            (r"embed_tokens/embedding$", P("tensor", "fsdp")),
            (r"lm_head/kernel$", P("fsdp", "tensor")),
            (r"layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P(None, "fsdp", "tensor")),
            (r"layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P(None, "tensor")),
            (r"layers/(o_proj|down_proj)/kernel$", P(None, "tensor", "fsdp")),
        )

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
        d, nq, nkv, f = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        )
        s = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
        if not c.tie_word_embeddings:
            s["lm_head.weight"] = (c.vocab_size, d)
        for i in range(c.num_hidden_layers):
            for name, shape in _layer_shapes(c, d, nq, nkv, f).items():
                s[f"model.layers.{i}.{name}"] = shape
        return s

    def params_from_hf(self, get, put=None) -> dict:
        """``get(name) -> np.ndarray`` (HF names, torch layout) -> float32 parameters; each leaf
        goes through ``put`` (e.g. ``jnp.asarray``) as soon as it is complete."""
        put = put or (lambda a: a)
        c = self.config
        d, nq, nkv, f = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        )
        p = {
            "embed_tokens": {"embedding": put(get("model.embed_tokens.weight"))},
            "norm": {"scale": put(get("model.norm.weight"))},
            "layers": _stack_layers(c.num_hidden_layers, _layer_shapes(c, d, nq, nkv, f), get, put),
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
        out.update(_unstack_layers(c.num_hidden_layers, p["layers"]))
        return out


def _layer_shapes(c: LlamaConfig, d: int, nq: int, nkv: int, f: int) -> dict[str, tuple[int, ...]]:
    s = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (nq, d),
        "self_attn.k_proj.weight": (nkv, d),
        "self_attn.v_proj.weight": (nkv, d),
        "self_attn.o_proj.weight": (d, nq),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    if c.qkv_bias:
        s.update(
            {"self_attn.q_proj.bias": (nq,), "self_attn.k_proj.bias": (nkv,), "self_attn.v_proj.bias": (nkv,)}
        )
    if c.o_bias:
        s["self_attn.o_proj.bias"] = (d,)
    if c.mlp_bias:
        s.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)})
    return s


def _flax_name(hf: str) -> tuple[str, str, bool]:
    """``'self_attn.q_proj.weight'`` -> (module, leaf, transpose)."""
    mod, leaf = hf.rsplit(".", 2)[-2:]
    if mod.endswith("layernorm"):
        return mod, "scale", False
    return mod, "kernel" if leaf == "weight" else "bias", leaf == "weight"


def _stack_layers(n: int, shapes: dict[str, tuple[int, ...]], get, put) -> dict:
    """One ``[L, ...]`` float32 array per layer tensor, filled layer by layer (peak memory: the
    stacked result plus one layer's tensor)."""
    out: dict = {}
    for hf, shape in shapes.items():
        mod, leaf, tr = _flax_name(hf)
        buf = np.empty((n, *(shape[::-1] if tr else shape)), np.float32)
        for i in range(n):
            a = get(f"model.layers.{i}.{hf}")
            buf[i] = a.T if tr else a
        out.setdefault(mod, {})[leaf] = put(buf)
        del buf
    return out


def _unstack_layers(n: int, layers: dict, prefix: str = "model.layers") -> dict[str, np.ndarray]:
    group = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    out = {}
    for mod, leaves in layers.items():
        for leaf, a in leaves.items():
            hf_leaf = "weight" if leaf in ("kernel", "scale") else "bias"
            sub = group.get(mod, "" if mod.endswith("layernorm") else "mlp")
            name = ".".join(x for x in (sub, mod, hf_leaf) if x)
            for i in range(n):
                out[f"{prefix}.{i}.{name}"] = np.ascontiguousarray(a[i].T if leaf == "kernel" else a[i])
    return out
