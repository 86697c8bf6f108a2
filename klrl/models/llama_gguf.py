"""The Llama family's GGUF side (architectures ``llama`` and ``qwen2``): its config from the file's
metadata, the llama.cpp tensor names, and the q/k row order (:data:`READING`, registered with the
family in :mod:`klrl.models.llama`; :func:`klrl.models.gguf.load_gguf` reads the file).

llama.cpp's converter stores a Llama's q and k projections with the rows of each head permuted
for its interleaved RoPE; :func:`unpermute` undoes it (as transformers'
``modeling_gguf_pytorch_utils.LlamaConverter`` does: ``w.reshape(n, 2, Dh/2, ...)`` was written as
``w.reshape(n, Dh/2, 2, ...)``). Qwen2 files are stored unpermuted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from klrl.models.hf import CheckpointFormatError
from klrl.models.llama_hf import LlamaConfig
from klrl.models.registry import GGUFReading

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    """The llama.cpp name of HF Llama tensor ``hf`` (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``)."""
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".", 3)
    return f"blk.{parts[2]}.{_LAYER[parts[3]]}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows ``(head, Dh/2, 2)`` back to ``(head, 2, Dh/2)``."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(cfg: LlamaConfig, hf: str, a: np.ndarray) -> np.ndarray:
    """A dequantised tensor as the HF tensor ``hf``: a ``llama`` file's q and k rows unpermuted."""
    if cfg.model_type == "llama" and ".q_proj." in hf:
        return unpermute(a, cfg.num_attention_heads)
    if cfg.model_type == "llama" and ".k_proj." in hf:
        return unpermute(a, cfg.num_key_value_heads)
    return a


def config(arch: str, field: Callable, shapes: dict[str, tuple[int, ...]], path: Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a GGUF file's ``<arch>.*`` metadata and tensor shapes."""
    if "token_embd.weight" not in shapes:
        raise CheckpointFormatError(f"{path}: missing tensor 'token_embd.weight'")
    vocab, width = shapes["token_embd.weight"]
    heads = int(field("attention.head_count", required=True))
    rope = {}
    kind = field("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise CheckpointFormatError(
                f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (linear)"
            )
        rope = {"rope_type": "linear", "factor": float(field("rope.scaling.factor", required=True))}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(field("embedding_length", required=True)),
        intermediate_size=int(field("feed_forward_length", required=True)),
        num_hidden_layers=int(field("block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=int(field("attention.head_count_kv", heads)),
        head_dim=int(field("rope.dimension_count", width // heads)),
        max_position_embeddings=int(field("context_length", 2048)),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=tuple(sorted(rope.items())),
        tie_word_embeddings="output.weight" not in shapes,
        qkv_bias=arch == "qwen2",
        model_type=arch,
    )


READING = GGUFReading(architectures=("llama", "qwen2"), config=config, tensor_name=gguf_name, convert=convert)
