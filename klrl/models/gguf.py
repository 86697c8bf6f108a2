"""GGUF files in (Llama and Qwen2 architectures): weights dequantised to float32 with the ``gguf``
library, the tokenizer rebuilt from the file's metadata.

llama.cpp's converter stores a Llama's q and k projections with the rows of each head permuted
for its interleaved RoPE; :func:`unpermute` undoes it (as transformers'
``modeling_gguf_pytorch_utils.LlamaConverter`` does: ``w.reshape(n, 2, Dh/2, ...)`` was written as
``w.reshape(n, Dh/2, 2, ...)``). Qwen2 files are stored unpermuted.

Every check (architecture, fields, tensor names and shapes, quantisation types ``gguf`` can
dequantise, the tokenizer) runs before the weights are dequantised; failures raise
:class:`klrl.models.hf.CheckpointFormatError` naming the file and the field or tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from klrl.data.hf_tokenizer import HFTokenizer, byte_level_bpe, make_tokenizer
from klrl.models.hf import CheckpointFormatError
from klrl.models.llama import Llama, LlamaConfig

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> the HF Llama name (``None``: not a tensor this loader knows)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows ``(head, Dh/2, 2)`` back to ``(head, 2, Dh/2)``."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None, *, path=None, required=False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise CheckpointFormatError(f"{path}: missing metadata field {key!r}")
        return default
    return f.contents()


def read_tokenizer(reader, path) -> HFTokenizer:
    """The byte-level BPE a GGUF's ``tokenizer.ggml.*`` metadata describes."""
    kind = _field(reader, "tokenizer.ggml.model", path=path, required=True)
    if kind != "gpt2":
        raise CheckpointFormatError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2 byte-level BPE)"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens", path=path, required=True)
    merges = _field(reader, "tokenizer.ggml.merges", path=path, required=True)
    types = _field(reader, "tokenizer.ggml.token_type", ()) or ()
    tok = byte_level_bpe(tokens, merges, types, _field(reader, "tokenizer.ggml.pre"))
    special = {}
    for name, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and not 0 <= int(i) < len(tokens):
            raise CheckpointFormatError(
                f"{path}: tokenizer.ggml.{key}_token_id {i} is outside the vocabulary"
            )
        special[name] = tokens[int(i)] if i is not None else None
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    return make_tokenizer(tok, special, _field(reader, "tokenizer.chat_template"), add_bos=add_bos)


def _config(reader, path, tensors) -> LlamaConfig:
    arch = _field(reader, "general.architecture", path=path, required=True)
    if arch not in ("llama", "qwen2"):
        raise CheckpointFormatError(f"{path}: general.architecture {arch!r} is not supported (llama, qwen2)")
    get = lambda k, default=None, **kw: _field(reader, f"{arch}.{k}", default, path=path, **kw)
    if "token_embd.weight" not in tensors:
        raise CheckpointFormatError(f"{path}: missing tensor 'token_embd.weight'")
    vocab, width = (int(x) for x in tensors["token_embd.weight"].shape[::-1])
    heads = int(get("attention.head_count", required=True))
    rope = {}
    kind = get("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise CheckpointFormatError(
                f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (linear)"
            )
        rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", required=True))}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(get("embedding_length", required=True)),
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_hidden_layers=int(get("block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", width // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=tuple(sorted(rope.items())),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=arch == "qwen2",
        model_type=arch,
    )


def load_gguf(path: str | Path, *, dtype=jnp.float32, put=None):
    """A GGUF file -> ``(model, params, tokenizer)`` with float32 parameter leaves (numpy, or
    what ``put`` makes of each as soon as it is dequantised, e.g. ``jnp.asarray``)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointFormatError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0]})") from None
    tensors = {t.name: t for t in reader.tensors}
    try:
        cfg = _config(reader, path, tensors)
        model = Llama(cfg, dtype)
    except ValueError as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{path}: {e}") from None
    by_hf = {}
    for name in tensors:
        h = hf_name(name)
        if h is None:
            raise CheckpointFormatError(f"{path}: unexpected tensor {name!r}")
        by_hf[h] = tensors[name]
    expected = model.hf_shapes()
    for h in sorted(set(by_hf) - set(expected)):
        raise CheckpointFormatError(f"{path}: unexpected tensor {by_hf[h].name!r}")
    gname = {v: k for k, v in _TOP.items()}
    for h, shape in expected.items():
        if h not in by_hf:
            parts = h.split(".")
            g = gname.get(h) or "blk.{}.{}".format(
                parts[2], {v: k for k, v in _LAYER.items()}[".".join(parts[3:])]
            )
            raise CheckpointFormatError(f"{path}: missing tensor {g!r}")
        got = tuple(int(x) for x in by_hf[h].shape[::-1])
        if got != tuple(shape):
            raise CheckpointFormatError(
                f"{path}: tensor {by_hf[h].name!r} has shape {list(got)}, the metadata implies {list(shape)}"
            )
    _check_quant_types(gguf, reader.tensors, path)
    tokenizer = read_tokenizer(reader, path)
    reader.fields.clear()  # the metadata's Python objects (~100 MB for a 49k vocabulary) are done with
    eos = tokenizer.stop_ids[0] if tokenizer.stop_ids else None
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id}
    cfg = dataclasses.replace(cfg, tokens=tuple((k, v) for k, v in ids.items() if v is not None))
    model = Llama(cfg, dtype)
    arch_permuted = cfg.model_type == "llama"

    def get(h: str) -> np.ndarray:
        t = by_hf[h]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        a = np.asarray(a, np.float32).reshape(tuple(int(x) for x in t.shape[::-1]))
        if arch_permuted and ".q_proj." in h:
            a = unpermute(a, cfg.num_attention_heads)
        elif arch_permuted and ".k_proj." in h:
            a = unpermute(a, cfg.num_key_value_heads)
        return a

    return model, model.params_from_hf(get, put), tokenizer


def _check_quant_types(gguf, tensors, path) -> None:
    """Dequantise one row of one tensor of each quantisation type: the ones ``gguf`` cannot
    handle fail here, naming a tensor, before any weight is read."""
    seen = set()
    for t in tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        try:
            gguf.quants.dequantize(t.data[:1], t.tensor_type)
        except (NotImplementedError, ValueError, KeyError, TypeError) as e:
            name = getattr(t.tensor_type, "name", t.tensor_type)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointFormatError(
                f"{path}: tensor {t.name!r} has quantisation type {name}, "
                f"which gguf cannot dequantise ({msg})"
            ) from None
