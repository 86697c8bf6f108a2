"""GPT-2 (transformers' ``GPT2LMHeadModel``) as a flax module over stacked layer parameters.

Per layer (``modeling_gpt2.GPT2Block``)::

    h = x + c_proj(attn(split3(c_attn(ln_1(x)))))
    y = h + mlp.c_proj(act(mlp.c_fc(ln_2(h))))

LayerNorm with ``layer_norm_epsilon`` (1e-5), ``act = gelu_new`` (the tanh approximation),
biases everywhere, learned positions ``wpe[positions]`` added to ``wte[tokens]``, attention scaled
by ``1/sqrt(Dh)`` (and ``1/(layer+1)`` with ``scale_attn_by_inverse_layer_idx``), a tied head
``x @ wte^T``. HF's ``Conv1D`` stores weights ``[in, out]``: the flax kernel as is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from klrl.models.attention import attention, attention_mask, empty_cache, write_cache
from klrl.models.base import FlaxLM, LMOutput, PeftLayout
from klrl.models.registry import register_family
from klrl.models.remat import remat_block
from klrl.models.sharding import split_rows

Array = jax.Array
_INIT = nn.initializers.normal(0.02)
_ACTS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    tokens: tuple = ()

    def __post_init__(self):
        if self.activation_function not in _ACTS:
            raise ValueError(
                f"activation_function: {self.activation_function!r} is not supported ({sorted(_ACTS)})"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head: {self.n_head} does not divide n_embd {self.n_embd}")

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd


def config_from_hf(d: dict) -> GPT2Config:
    """An HF GPT-2 ``config.json`` dict -> :class:`GPT2Config`."""
    return GPT2Config(
        vocab_size=d["vocab_size"],
        n_embd=d["n_embd"],
        n_layer=d["n_layer"],
        n_head=d["n_head"],
        n_positions=d.get("n_positions", 1024),
        n_inner=d.get("n_inner"),
        activation_function=d.get("activation_function", "gelu_new"),
        layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
        scale_attn_weights=bool(d.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        tokens=tuple((k, d[k]) for k in _TOKEN_FIELDS if isinstance(d.get(k), int)),
    )


def config_to_hf(c: GPT2Config) -> dict:
    d = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "tokens"},
        "torch_dtype": "float32",
    }
    d.update(dict(c.tokens))
    return d


class Block(nn.Module):
    c: GPT2Config
    dtype: Any

    @nn.compact
    def __call__(self, carry, mask, index):
        x, cache, layer = carry
        c, dt = self.c, self.dtype
        b, t, d = x.shape
        h, dh = c.n_head, d // c.n_head
        dense = lambda n, name: nn.Dense(n, dtype=dt, kernel_init=_INIT, name=name)
        norm = lambda name: nn.LayerNorm(epsilon=c.layer_norm_epsilon, dtype=dt, name=name)
        q, k, v = jnp.split(dense(3 * d, "c_attn")(norm("ln_1")(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, dh) for a in (q, k, v))
        if cache is not None:
            cache, k, v = write_cache(cache, layer, k, v, index)
        scale = dh**-0.5 if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scale = scale / (layer + 1).astype(jnp.float32)
        a = attention(q, k, v, mask, scale, cached=cache is not None)
        x = x + dense(d, "c_proj")(a)
        y = _ACTS[c.activation_function](dense(c.inner, "c_fc")(norm("ln_2")(x)))
        x = x + dense(d, "mlp_c_proj")(y)
        return (split_rows(x), cache, layer + 1), None  # rows on fsdp (klrl.step.parallel)


class GPT2Module(nn.Module):
    c: GPT2Config
    dtype: Any
    remat: str = "none"  # klrl.models.remat.REMAT_MODES

    @nn.compact
    def __call__(self, tokens, positions, mask, cache=None, index=None, logits=True):
        c = self.c
        mask = attention_mask(tokens, positions, mask, cache is not None)  # shapes checked; [B, T] ok
        wte = nn.Embed(c.vocab_size, c.n_embd, dtype=self.dtype, embedding_init=_INIT, name="wte")
        wpe = nn.Embed(c.n_positions, c.n_embd, dtype=self.dtype, embedding_init=_INIT, name="wpe")
        x = split_rows(wte(tokens) + wpe(positions))
        block = remat_block(Block, self.remat)
        layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=c.n_layer,
        )(c, self.dtype, name="h")
        idx = jnp.asarray(0 if index is None else index, jnp.int32)
        (x, cache, _), _ = layers((x, cache, jnp.zeros((), jnp.int32)), mask, idx)
        x = nn.LayerNorm(epsilon=c.layer_norm_epsilon, dtype=self.dtype, name="ln_f")(x)
        out = None
        if logits:
            if c.tie_word_embeddings:
                out = wte.attend(x)
            else:
                out = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype, name="lm_head")(x)
            out = out.astype(jnp.float32)
        return LMOutput(out, x, cache)


@register_family("gpt2", hf=("gpt2",), hf_config=config_from_hf)
@dataclasses.dataclass(frozen=True)
class GPT2(FlaxLM):
    """GPT-2 implementing :class:`klrl.models.base.CausalLM` (compute ``dtype``, float32 params)."""

    MODULE = GPT2Module
    EMBEDDING = "wte"  # the tied head: x @ wte^T
    LORA_TARGETS = "h/(c_attn|c_proj|c_fc|mlp_c_proj)"  # klrl.models.lora
    PARTITION_RULES = (
        (r"wte/embedding$", P("tensor", "fsdp")),
        (r"wpe/embedding$", P(None, "fsdp")),
        (r"lm_head/kernel$", P("fsdp", "tensor")),
        (r"h/(c_attn|c_fc)/kernel$", P(None, "fsdp", "tensor")),
        (r"h/(c_attn|c_fc)/bias$", P(None, "tensor")),
        (r"h/(c_proj|mlp_c_proj)/kernel$", P(None, "tensor", "fsdp")),
    )
    # HF: transformer.h.{i}.attn.c_attn, ...; klrl's c_proj is attn.c_proj, mlp_c_proj is mlp.c_proj;
    # Conv1D stores the weight [in, out]
    PEFT = PeftLayout(
        "h",
        "transformer.h",
        {"c_attn": "attn.c_attn", "c_proj": "attn.c_proj", "c_fc": "mlp.c_fc", "mlp_c_proj": "mlp.c_proj"},
        {"c_attn": "c_attn", "c_proj": "attn.c_proj", "c_fc": "c_fc", "mlp_c_proj": "mlp.c_proj"},
        True,
    )

    config: GPT2Config

    @property
    def hidden_size(self) -> int:
        return self.config.n_embd

    @property
    def max_len(self) -> int:
        return self.config.n_positions

    def init_cache(self, batch: int, length: int):
        c = self.config
        return empty_cache(c.n_layer, batch, c.n_head, length, c.n_embd // c.n_head, self.dtype)

    def hf_config(self) -> dict:
        return config_to_hf(self.config)

    # ---- HF tensors <-> parameters ---------------------------------------------------------

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """Hub GPT-2 files name tensors without ``transformer.`` and keep the causal-mask
        buffers ``attn.bias``/``attn.masked_bias``: normalise, or ``None`` to ignore."""
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        return name

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        s = {
            "transformer.wte.weight": (c.vocab_size, c.n_embd),
            "transformer.wpe.weight": (c.n_positions, c.n_embd),
            "transformer.ln_f.weight": (c.n_embd,),
            "transformer.ln_f.bias": (c.n_embd,),
        }
        if not c.tie_word_embeddings:
            s["lm_head.weight"] = (c.vocab_size, c.n_embd)
        for i in range(c.n_layer):
            for name, (_, _, shape) in _layer_map(c).items():
                s[f"transformer.h.{i}.{name}"] = shape
        return s

    def params_from_hf(self, get, put=None) -> dict:
        """``get(name) -> np.ndarray`` (HF names) -> float32 parameters, each leaf through ``put``."""
        put = put or (lambda a: a)
        c = self.config
        layers: dict = {}
        for name, (mod, leaf, shape) in _layer_map(c).items():
            buf = np.empty((c.n_layer, *shape), np.float32)
            for i in range(c.n_layer):
                buf[i] = get(f"transformer.h.{i}.{name}")
            layers.setdefault(mod, {})[leaf] = put(buf)
            del buf
        p = {
            "wte": {"embedding": put(get("transformer.wte.weight"))},
            "wpe": {"embedding": put(get("transformer.wpe.weight"))},
            "ln_f": {"scale": put(get("transformer.ln_f.weight")), "bias": put(get("transformer.ln_f.bias"))},
            "h": layers,
        }
        if not c.tie_word_embeddings:
            p["lm_head"] = {"kernel": put(np.ascontiguousarray(get("lm_head.weight").T))}
        return {"params": p}

    def params_to_hf(self, params) -> dict[str, np.ndarray]:
        p = jax.tree.map(lambda a: np.asarray(a, np.float32), params["params"])
        c = self.config
        out = {
            "transformer.wte.weight": p["wte"]["embedding"],
            "transformer.wpe.weight": p["wpe"]["embedding"],
            "transformer.ln_f.weight": p["ln_f"]["scale"],
            "transformer.ln_f.bias": p["ln_f"]["bias"],
        }
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = np.ascontiguousarray(p["lm_head"]["kernel"].T)
        for name, (mod, leaf, _) in _layer_map(c).items():
            for i in range(c.n_layer):
                out[f"transformer.h.{i}.{name}"] = np.ascontiguousarray(p["h"][mod][leaf][i])
        return out


def _layer_map(c: GPT2Config) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """HF per-layer name -> (flax module, leaf, shape); Conv1D weights are ``[in, out]``."""
    d, f = c.n_embd, c.inner
    return {
        "ln_1.weight": ("ln_1", "scale", (d,)),
        "ln_1.bias": ("ln_1", "bias", (d,)),
        "attn.c_attn.weight": ("c_attn", "kernel", (d, 3 * d)),
        "attn.c_attn.bias": ("c_attn", "bias", (3 * d,)),
        "attn.c_proj.weight": ("c_proj", "kernel", (d, d)),
        "attn.c_proj.bias": ("c_proj", "bias", (d,)),
        "ln_2.weight": ("ln_2", "scale", (d,)),
        "ln_2.bias": ("ln_2", "bias", (d,)),
        "mlp.c_fc.weight": ("c_fc", "kernel", (d, f)),
        "mlp.c_fc.bias": ("c_fc", "bias", (f,)),
        "mlp.c_proj.weight": ("mlp_c_proj", "kernel", (f, d)),
        "mlp.c_proj.bias": ("mlp_c_proj", "bias", (d,)),
    }
