"""The Gemma 3 family's configuration and checkpoints: :class:`Gemma3Config` from and to an HF
``config.json`` (``model_type`` ``gemma3_text``, transformers 4 and 5 spellings), HF per-layer tensors
to and from the stacked ``[L, ...]`` parameters of :mod:`klrl.models.gemma3`'s layer scan, and the
GGUF side (:data:`READING`: architecture ``gemma3``).

GGUF files (llama.cpp's ``convert_hf_to_gguf.Gemma3Model``): the q/k rows are not permuted; every
RMSNorm weight (the four per block, q_norm, k_norm, the final norm) is stored as ``1 + w``, which
:func:`convert` undoes (as transformers' ``modeling_gguf_pytorch_utils.Gemma2TensorProcessor`` does),
so the parameters hold HF's ``w``. The metadata has no layer pattern, local RoPE base or
``query_pre_attn_scalar``: the pattern is five sliding-window layers then one global (llama.cpp's
and transformers' default), the local base ``rope.freq_base_swa`` or 10000, and the query scale
``head_dim`` (llama.cpp's rule; every Gemma 3 but the 27B, whose ``hidden / heads`` llama.cpp
special-cases by its 62 layers, as here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from klrl.data.hf_tokenizer import gemma_bpe
from klrl.models import llama_hf
from klrl.models.hf import CheckpointFormatError
from klrl.models.registry import GGUFReading

_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
LAYER_TYPES = ("sliding_attention", "full_attention")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config:
    """The fields of an HF ``Gemma3TextConfig`` that define the function."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # per layer: "sliding_attention" or "full_attention"
    sliding_window: int = 4096  # a local layer's query attends to itself and the window - 1 before it
    query_pre_attn_scalar: float = 256.0  # attention scores are scaled by its -1/2 power
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # the global layers' base
    rope_local_theta: float = 10_000.0  # the sliding-window layers' base
    rope_scaling: tuple = ()  # the global layers' scaling: () or (("factor", f), ("rope_type", "linear"))
    final_logit_softcapping: float | None = None  # logits = c tanh(logits / c)
    tie_word_embeddings: bool = True
    tokens: tuple = ()  # (name, id) for bos/eos/pad, written back on export

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types: must be {self.num_hidden_layers} of {', '.join(LAYER_TYPES)} "
                f"(got {list(self.layer_types)})"
            )
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1 (got {self.sliding_window})")
        kind = dict(self.rope_scaling).get("rope_type", "default")
        if kind not in ("default", "linear"):
            raise ValueError(f"rope_parameters: rope_type {kind!r} is not supported (default, linear)")


def _rope(d: dict) -> tuple[float, float, tuple]:
    """(global base, local base, global scaling items) of transformers 5's per-layer-type
    ``rope_parameters`` or transformers 4's ``rope_theta``/``rope_local_base_freq``/``rope_scaling``."""
    rp = d.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or {}) if "full_attention" in rp else dict(rp)
    local = dict(rp.get("sliding_attention") or {})
    full.update(d.get("rope_scaling") or {})
    if "type" in full and "rope_type" not in full:
        full["rope_type"] = full.pop("type")
    theta = float(full.pop("rope_theta", d.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0)))
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters: sliding_attention rope_type {local['rope_type']!r} is not supported"
        )
    if full.get("rope_type", "default") == "default":
        full = {}
    return theta, local_theta, tuple(sorted(full.items()))


def config_from_hf(d: dict) -> Gemma3Config:
    """An HF ``Gemma3TextConfig`` dict -> :class:`Gemma3Config`; ``KeyError``/``ValueError`` name the
    field."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation: {act!r} is not supported (gelu_pytorch_tanh)")
    for field in ("attention_bias", "use_bidirectional_attention"):
        if d.get(field):
            raise ValueError(f"{field}: true is not supported")
    if d.get("attn_logit_softcapping") is not None:  # transformers' Gemma3Attention never applies it
        raise ValueError("attn_logit_softcapping: not supported (Gemma 3 has none)")
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    theta, local_theta, scaling = _rope(d)
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    return Gemma3Config(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        layer_types=tuple(types),
        sliding_window=int(d.get("sliding_window") or 4096),
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        max_position_embeddings=d.get("max_position_embeddings", 131072),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_scaling=scaling,
        final_logit_softcapping=d.get("final_logit_softcapping"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        tokens=tuple((k, d[k]) for k in _TOKEN_FIELDS if isinstance(d.get(k), int)),
    )


def config_to_hf(c: Gemma3Config) -> dict:
    """:class:`Gemma3Config` -> a ``config.json`` dict transformers reads as ``Gemma3ForCausalLM``."""
    d = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **{f: getattr(c, f) for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
        **{f: getattr(c, f) for f in ("num_attention_heads", "num_key_value_heads", "head_dim")},
        "layer_types": list(c.layer_types),
        "sliding_window": c.sliding_window,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta, **dict(c.rope_scaling)},
        },
        "final_logit_softcapping": c.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    d.update(dict(c.tokens))
    return d


# HF name (after "model.layers.N.") -> GGUF name (after "blk.N."); the flax module is the HF module's
# name, its leaf "scale" (norms) or "kernel" ([in, out]: the torch weight transposed)
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _flax(hf: str) -> tuple[str, str, bool]:
    """``'self_attn.q_proj.weight'`` -> ``('q_proj', 'kernel', True)`` (module, leaf, transposed)."""
    mod = hf.rsplit(".", 2)[-2]
    return (mod, "scale", False) if "norm" in mod else (mod, "kernel", True)


TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def layer_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """HF per-layer tensor (after ``model.layers.N.``) -> torch-layout shape."""
    d, f, dh = c.hidden_size, c.intermediate_size, c.head_dim
    nq, nkv = c.num_attention_heads * dh, c.num_key_value_heads * dh
    norms = {h: (dh if "_norm." in h else d,) for h in LAYER if _flax(h)[1] == "scale"}
    return {
        **norms,
        "self_attn.q_proj.weight": (nq, d),
        "self_attn.k_proj.weight": (nkv, d),
        "self_attn.v_proj.weight": (nkv, d),
        "self_attn.o_proj.weight": (d, nq),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }


def stack_layers(c: Gemma3Config, get, put) -> dict:
    """One ``[L, ...]`` float32 array per layer tensor (kernels transposed to ``[in, out]``)."""
    return llama_hf.stack_layers(c.num_hidden_layers, layer_shapes(c), get, put, _flax)


def unstack_layers(c: Gemma3Config, layers: dict) -> dict[str, np.ndarray]:
    out = {}
    for hf in LAYER:
        mod, leaf, tr = _flax(hf)
        a = layers[mod][leaf]
        for i in range(c.num_hidden_layers):
            out[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(a[i].T if tr else a[i])
    return out


# ---- GGUF ----------------------------------------------------------------------------------------


def gguf_name(hf: str) -> str:
    """The llama.cpp name of HF Gemma 3 tensor ``hf``."""
    if hf in TOP:
        return TOP[hf]
    parts = hf.split(".", 3)
    return f"blk.{parts[2]}.{LAYER[parts[3]]}"


def convert(cfg: Gemma3Config, hf: str, a: np.ndarray) -> np.ndarray:
    """A dequantised tensor as HF's: llama.cpp stored every norm weight as ``1 + w``."""
    return a - np.float32(1.0) if hf.endswith("norm.weight") else a


def config(arch: str, field: Callable, shapes: dict[str, tuple[int, ...]], path: Path) -> Gemma3Config:
    """The :class:`Gemma3Config` of a GGUF file's ``gemma3.*`` metadata and tensor shapes."""
    if "token_embd.weight" not in shapes:
        raise CheckpointFormatError(f"{path}: missing tensor 'token_embd.weight'")
    vocab, width = shapes["token_embd.weight"]
    heads = int(field("attention.head_count", required=True))
    layers = int(field("block_count", required=True))
    head_dim = int(field("attention.key_length", width // heads))
    rope = ()
    kind = field("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise CheckpointFormatError(
                f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (linear)"
            )
        rope = (("factor", float(field("rope.scaling.factor", required=True))), ("rope_type", "linear"))
    return Gemma3Config(
        vocab_size=vocab,
        hidden_size=int(field("embedding_length", required=True)),
        intermediate_size=int(field("feed_forward_length", required=True)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)),
        sliding_window=int(field("attention.sliding_window", 4096)),
        query_pre_attn_scalar=float(width // heads if layers == 62 else head_dim),
        max_position_embeddings=int(field("context_length", 131072)),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field("rope.freq_base", 1_000_000.0)),
        rope_local_theta=float(field("rope.freq_base_swa", 10_000.0)),
        rope_scaling=rope,
        final_logit_softcapping=field("final_logit_softcapping"),
        tie_word_embeddings="output.weight" not in shapes,
    )


READING = GGUFReading(
    architectures=("gemma3",), config=config, tensor_name=gguf_name, convert=convert, spm_tokenizer=gemma_bpe
)
