"""Llama / Qwen2 family: logits against transformers' (committed goldens, and live when
transformers is importable), KV-cache decoding against teacher forcing, config mapping."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_hf
from jax.sharding import PartitionSpec as P

from klrl.models.base import CausalLM, causal_mask, forward, positions_from_mask, spec_for
from klrl.models.hf import load_hf
from klrl.models.llama import Llama, LlamaConfig, config_from_hf, config_to_hf, inv_frequencies

DATA = Path(__file__).parents[1] / "data"


def golden_error(name: str, dtype=jnp.float32) -> float:
    """max |klrl - transformers| over real positions, relative to the logits' max |value|, of both
    klrl's ``forward`` (``[B, T, T]`` causal mask) and ``apply`` with transformers' own inputs: the
    ``[B, T]`` padding mask (``attention_mask``) and ``position_ids`` (one program: one compile)."""
    model, params = load_hf(DATA / name, dtype=dtype)
    g = np.load(DATA / name / "golden.npz")
    both = jax.jit(
        lambda p, t, k, pos: (forward(model, p, t, k), model.apply(p, t, pos, k.astype(jnp.int32)))
    )
    outs = both(
        params, jnp.asarray(g["tokens"], jnp.int32), g["mask"], jnp.asarray(g["positions"], jnp.int32)
    )
    m, scale = g["mask"], np.abs(g["logits"][g["mask"]]).max()
    return max(float(np.abs(np.asarray(o.logits)[m] - g["logits"][m]).max() / scale) for o in outs)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_fp32_logits_match_transformers_golden(name):
    assert golden_error(name) <= 1e-4


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_bf16_compute_is_close_and_params_stay_fp32(name):
    model, params = load_hf(DATA / name, dtype=jnp.bfloat16)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))
    assert golden_error(name, jnp.bfloat16) < 0.05


def test_is_a_causal_lm_and_shapes():
    model, params = load_hf(DATA / "tiny_llama")
    assert isinstance(model, CausalLM)
    assert (model.vocab_size, model.hidden_size, model.max_len) == (256, 32, 64)
    assert params["params"]["layers"]["q_proj"]["kernel"].shape == (2, 32, 32)  # stacked [L, in, out]
    fresh = model.init(jax.random.key(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, params)


def decode_vs_forward(model, params, tokens, mask, prefill: int) -> float:
    """Prefill ``prefill`` slots into the cache, decode the rest one token per step; compare each
    step's logits with the teacher-forced forward of the whole sequence."""
    full = np.asarray(jax.jit(lambda p, t, k: forward(model, p, t, k).logits)(params, tokens, mask))
    apply = jax.jit(model.apply)
    b, s = tokens.shape
    pos = positions_from_mask(mask)
    cache = model.init_cache(b, s)
    att = causal_mask(mask)
    out = apply(params, tokens[:, :prefill], pos[:, :prefill], att[:, :prefill], cache, 0)
    got = [np.asarray(out.logits)]
    cache = out.cache
    for i in range(prefill, s):
        out = apply(params, tokens[:, i : i + 1], pos[:, i : i + 1], att[:, i : i + 1], cache, jnp.int32(i))
        cache = out.cache
        got.append(np.asarray(out.logits))
    got = np.concatenate(got, 1)
    m = np.asarray(mask)
    return float(np.abs(got[m] - full[m]).max() / np.abs(full[m]).max())


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_kv_cache_decoding_matches_teacher_forcing(name):
    model, params = load_hf(DATA / name)
    g = np.load(DATA / name / "golden.npz")
    assert (
        decode_vs_forward(model, params, jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"]), 4)
        < 1e-5
    )


def test_llama3_rope_frequencies_by_hand():
    c = LlamaConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        rope_theta=500000.0,
        rope_scaling=(
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 16),
            ("rope_type", "llama3"),
        ),
    )
    base = 500000.0 ** (-np.arange(0, 8, 2) / 8)  # wavelengths 6.3, 167, 4.5e3, 1.2e5
    w = 2 * math.pi / base[0]  # 4 < w < 16: smoothed between scaled and unscaled
    s = (16 / w - 1.0) / (4.0 - 1.0)
    want = [(1 - s) * base[0] / 8 + s * base[0], base[1] / 8, base[2] / 8, base[3] / 8]
    np.testing.assert_allclose(inv_frequencies(c), want, rtol=1e-6)


def test_config_mapping_transformers4_and_5_styles_and_mistral():
    v4 = {
        "model_type": "mistral",
        "vocab_size": 10,
        "hidden_size": 16,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "sliding_window": None,
    }
    c = config_from_hf(v4)
    assert (c.head_dim, c.rope_theta, dict(c.rope_scaling), c.qkv_bias) == (
        4,
        1e6,
        {"rope_type": "linear", "factor": 2.0},
        False,
    )
    v5 = config_to_hf(c)
    assert config_from_hf(v5) == c
    assert config_from_hf({**v4, "model_type": "qwen2"}).qkv_bias
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        config_from_hf({**v4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf({**v4, "sliding_window": 4096})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        config_from_hf({**v4, "num_key_value_heads": 3})


def test_partition_rules_cover_every_matrix():
    model, params = load_hf(DATA / "tiny_llama")
    specs = spec_for(model.partition_rules(), params)
    flat = {jax.tree_util.keystr(k): s for k, s in jax.tree_util.tree_flatten_with_path(specs)[0]}
    for k, s in flat.items():
        if "kernel" in k or "embedding" in k:
            assert s != P(), k
    assert flat["['params']['layers']['q_proj']['kernel']"] == P(None, "fsdp", "tensor")
    assert flat["['params']['layers']['down_proj']['kernel']"] == P(None, "tensor", "fsdp")


@needs_hf  # (CI: fails, never skips, without the [hf] extra)
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_live_against_transformers(name):
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(DATA / name, attn_implementation="eager").eval()
    g = np.load(DATA / name / "golden.npz")
    with torch.no_grad():
        want = ref(
            input_ids=torch.tensor(g["tokens"]),
            attention_mask=torch.tensor(g["mask"].astype(np.int64)),
            position_ids=torch.tensor(g["positions"]),
        ).logits.numpy()
    np.testing.assert_allclose(want[g["mask"]], g["logits"][g["mask"]], atol=1e-5)
    assert golden_error(name) <= 1e-4


def test_llama_is_hashable_for_jit():
    model, params = load_hf(DATA / "tiny_llama")
    f = jax.jit(lambda p, t, m: forward(model, p, t, m).logits)
    g = np.load(DATA / "tiny_llama" / "golden.npz")
    out = f(params, jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"]))
    assert out.shape == (3, 10, 256) and hash(Llama(model.config)) == hash(Llama(model.config))


def test_apply_refuses_other_mask_shapes_in_one_line():
    model, params = load_hf(DATA / "tiny_llama")
    tokens = jnp.ones((2, 5), jnp.int32)
    pos = positions_from_mask(jnp.ones((2, 5)))
    for bad in (jnp.ones((5,), bool), jnp.ones((2, 4), bool), jnp.ones((2, 5, 4), bool), jnp.ones((1, 5, 5))):
        with pytest.raises(ValueError, match=r"^mask: shape .*expected \[B, T\] = \(2, 5\)") as e:
            model.apply(params, tokens, pos, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^positions: shape \(5,\), expected \[B, T\]"):
        model.apply(params, tokens, pos[0], jnp.ones((2, 5)))
    with pytest.raises(ValueError, match=r"^tokens: shape \(5,\), expected \[B, T\]"):
        model.apply(params, tokens[0], pos, jnp.ones((2, 5)))
    cache = model.init_cache(2, 8)  # with a cache a [B, T] mask is ambiguous (which slots?): refused
    with pytest.raises(ValueError, match=r"with a cache: \[B, T, S\]"):
        model.apply(params, tokens, pos, jnp.ones((2, 5)), cache, 0)


def test_block_rows_layout_gradients_match_the_batched_layout(monkeypatch):
    """The Block's projections on ``[B T, width]`` rows (issue 38, item 7: XLA:CPU's weight gradients
    without a transposed cotangent copy) give the gradients of the ``[B, T, width]`` formulation."""
    import dataclasses

    import flax.linen as nn

    import klrl.models.llama as llama

    class Batched(nn.Module):  # the Block as it was: every Dense on [B, T, width]
        c: LlamaConfig
        dtype: object

        @nn.compact
        def __call__(self, carry, cos, sin, mask, index):
            x, cache, layer = carry
            c, dt = self.c, self.dtype
            b, t, _ = x.shape
            dense = lambda n, bias, name: nn.Dense(n, use_bias=bias, dtype=dt, name=name)  # noqa: E731
            y = llama.RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x)
            q = dense(c.num_attention_heads * c.head_dim, c.qkv_bias, "q_proj")(y)
            k = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias, "k_proj")(y)
            v = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias, "v_proj")(y)
            q = llama.apply_rope(q.reshape(b, t, c.num_attention_heads, c.head_dim), cos, sin)
            k = llama.apply_rope(k.reshape(b, t, c.num_key_value_heads, c.head_dim), cos, sin)
            a = llama.attention(q, k, v.reshape(b, t, -1, c.head_dim), mask, c.head_dim**-0.5, cached=False)
            x = x + dense(c.hidden_size, c.o_bias, "o_proj")(a)
            y = llama.RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
            h = nn.silu(dense(c.intermediate_size, c.mlp_bias, "gate_proj")(y))
            u = dense(c.intermediate_size, c.mlp_bias, "up_proj")(y)
            x = x + dense(c.hidden_size, c.mlp_bias, "down_proj")(h * u)
            return (x, cache, layer + 1), None

    model, params = load_hf(DATA / "tiny_llama")
    g = np.load(DATA / "tiny_llama" / "golden.npz")
    tokens, mask = jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"])
    for remat in ("none", "block"):
        m = dataclasses.replace(model, remat=remat)
        loss = lambda p, m=m: jnp.sum(jnp.sin(forward(m, p, tokens, mask).logits))  # noqa: E731
        rows = jax.grad(loss)(params)
        monkeypatch.setattr(llama, "Block", Batched)
        batched = jax.grad(loss)(params)
        monkeypatch.undo()
        for a, b in zip(jax.tree.leaves(rows), jax.tree.leaves(batched), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
