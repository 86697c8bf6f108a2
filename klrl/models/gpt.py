"""klrl's own GPT-2-style decoder (flax), as a :class:`klrl.models.base.CausalLM` (family ``"gpt"``).

Learned positions, pre-LayerNorm blocks, GELU MLP, optional tied embeddings. The flax module
:class:`GPTModule` is the trunk plus (optionally) the LM head; :class:`GPT` wraps it in the
causal-LM protocol (plain parameter dicts, ``apply(params, tokens, positions, mask, cache,
index) -> LMOutput``). Value and reward heads are separate modules (:mod:`klrl.models.heads`).

The KV cache is an explicit pytree, one ``(k, v)`` pair of ``[B, H, S, Dh]`` arrays per layer,
threaded by the caller, so decoding is a plain ``lax.scan``. Keys and values are kept in the
layout the attention matmuls read (heads before slots) and each layer's pair is its own leaf, so a
decode step writes one slot in place instead of copying or transposing the whole cache
(``benchmarks/NOTES.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from klrl.config import ModelConfig
from klrl.models.attention import attention_mask, causal_mask, positions_from_mask
from klrl.models.base import LMOutput, PartitionRules
from klrl.models.registry import register_family
from klrl.models.remat import check_mode, remat_block
from klrl.models.sharding import split_rows

Array = jax.Array
NEG_INF = -1e9
Cache = tuple[tuple[Array, Array], ...]  # per layer (k, v), each [B, H, S, Dh]


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


class GPTModule(nn.Module):
    """Decoder-only transformer: ``(tokens, positions, mask, cache, index) -> (logits | None,
    hidden, cache)``; ``lm_head=False`` leaves out the output projection (a value or reward trunk)."""

    cfg: ModelConfig
    vocab_size: int
    max_len: int
    lm_head: bool = True
    remat: str = "none"  # klrl.models.remat.REMAT_MODES

    @nn.compact
    def __call__(self, tokens, positions, mask, cache=None, index=None, logits=True) -> LMOutput:
        """``mask [B, T, S]``: query t may attend key s (causality and padding folded in).

        Without a cache S = T. With a cache the T new tokens are written at slot ``index``.
        A ``[B, T]`` padding mask (no cache) is made causal
        (:func:`klrl.models.attention.attention_mask`).
        """
        cfg = self.cfg
        mask = attention_mask(tokens, positions, mask, cache is not None)  # shapes checked
        dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
        wte = nn.Embed(self.vocab_size, cfg.d_model, name="wte")
        wpe = nn.Embed(self.max_len, cfg.d_model, name="wpe")
        x = split_rows((wte(tokens) + wpe(positions)).astype(dtype))  # rows on fsdp (klrl.step.parallel)
        new_cache = []
        block = remat_block(Block, self.remat, prevent_cse=True)  # a Python loop: keep the barriers
        for i in range(cfg.n_layers):
            layer_cache = None if cache is None else cache[i]
            x, nc = block(cfg.d_model, cfg.n_heads, cfg.mlp_ratio, dtype, name=f"h{i}")(
                x, mask, layer_cache, index
            )
            x = split_rows(x)
            new_cache.append(nc)
        x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
        out = None
        if self.lm_head and (logits or self.is_initializing()):
            if cfg.tie_embeddings:
                out = wte.attend(x)
            else:
                out = nn.Dense(self.vocab_size, use_bias=False, dtype=dtype, name="lm")(x)
            out = out.astype(jnp.float32)
        return LMOutput(out, x, None if cache is None else tuple(new_cache))


@dataclass(frozen=True)
class GPT:
    """klrl's GPT as a :class:`~klrl.models.base.CausalLM`. ``lm_head=False``: a trunk for a value
    or reward head (``apply`` then returns ``logits=None``)."""

    LORA_TARGETS = r"h\d+/(qkv|proj|fc|out)"  # klrl.models.lora

    cfg: ModelConfig
    vocab_size: int
    max_len: int
    lm_head: bool = True
    remat: str = "none"  # what the backward keeps of each block (klrl.models.remat)
    module: GPTModule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "remat", check_mode(self.remat))
        module = GPTModule(self.cfg, self.vocab_size, self.max_len, self.lm_head, self.remat)
        object.__setattr__(self, "module", module)

    @property
    def hidden_size(self) -> int:
        return self.cfg.d_model

    def init(self, key: Array) -> Any:
        tokens = jnp.zeros((1, self.max_len), jnp.int32)
        mask = jnp.ones((1, self.max_len), jnp.float32)
        return self.module.init(key, tokens, positions_from_mask(mask), causal_mask(mask))["params"]

    def apply(self, params, tokens, positions, mask, cache=None, index=None, *, logits=True) -> LMOutput:
        """:meth:`klrl.models.base.CausalLM.apply` (its types)."""
        return self.module.apply({"params": params}, tokens, positions, mask, cache, index, logits)

    def head(self, params: Any, hidden: Array) -> Array:
        """The LM head alone: final hidden states ``[..., D]`` (after ``ln_f``) -> float32 logits
        ``[..., V]``, the same product as :meth:`apply` (tied: ``wte.attend``, in the promoted dtype
        of the hidden states and the float32 embedding; untied: ``lm`` in the compute dtype)."""
        if self.cfg.tie_embeddings:
            e = params["wte"]["embedding"]
            dt = jnp.promote_types(hidden.dtype, e.dtype)
            return jnp.dot(hidden.astype(dt), e.astype(dt).T).astype(jnp.float32)
        dt = jnp.bfloat16 if self.cfg.dtype == "bfloat16" else jnp.float32
        return jnp.dot(hidden.astype(dt), params["lm"]["kernel"].astype(dt)).astype(jnp.float32)

    def init_cache(self, batch: int, length: int) -> Cache:
        """An empty cache of ``length`` slots: per layer ``(k, v)``, each ``[B, H, S, Dh]``."""
        cfg = self.cfg
        dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
        shape = (batch, cfg.n_heads, length, cfg.d_model // cfg.n_heads)
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers))

    def partition_rules(self) -> PartitionRules:
        """Megatron-style: qkv and fc split by output columns, proj and out by input rows, the
        embedding by vocabulary rows; every kernel's other axis over ``fsdp``."""
        return (
            (r"h\d+/(qkv|fc)/kernel", PartitionSpec("fsdp", "tensor")),
            (r"h\d+/(proj|out)/kernel", PartitionSpec("tensor", "fsdp")),
            (r"wte/embedding", PartitionSpec("tensor", "fsdp")),
            (r"lm/kernel", PartitionSpec("fsdp", "tensor")),
        )


@register_family("gpt")
def build_gpt(cfg: ModelConfig, vocab_size: int, max_len: int, *, lm_head: bool = True) -> GPT:
    """klrl's GPT of ``cfg`` (``model.*``) over ``vocab_size`` tokens and ``max_len`` positions."""
    return GPT(cfg, vocab_size, max_len, lm_head)


# ---- helpers shared by rollout, scoring and the update ----------------------


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
