"""Llama-family configuration and the HF side of it: :class:`LlamaConfig` from and to an HF
``config.json`` (transformers 4 and 5 spellings), and HF per-layer tensors (torch layout) to and from
the stacked ``[L, ...]`` parameters of :mod:`klrl.models.llama`'s layer scan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

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


def layer_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF per-layer tensor (after ``model.layers.N.``) -> torch-layout shape."""
    d, f = c.hidden_size, c.intermediate_size
    nq, nkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
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


def stack_layers(n: int, shapes: dict[str, tuple[int, ...]], get, put, flax_name=_flax_name) -> dict:
    """One ``[L, ...]`` float32 array per layer tensor (``model.layers.{i}.<name>`` for each ``name``
    of ``shapes``), filled layer by layer (peak memory: the stacked result plus one layer's tensor);
    ``flax_name(name) -> (module, leaf, transposed)`` (Gemma 3 names its norms otherwise)."""
    out: dict = {}
    for hf, shape in shapes.items():
        mod, leaf, tr = flax_name(hf)
        buf = np.empty((n, *(shape[::-1] if tr else shape)), np.float32)
        for i in range(n):
            a = get(f"model.layers.{i}.{hf}")
            buf[i] = a.T if tr else a
        out.setdefault(mod, {})[leaf] = put(buf)
        del buf
    return out


def unstack_layers(n: int, layers: dict, prefix: str = "model.layers") -> dict[str, np.ndarray]:
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
