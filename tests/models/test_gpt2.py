"""GPT-2 family: logits against transformers' GPT2LMHeadModel (committed goldens, live when
importable), KV-cache decoding against teacher forcing, hub-style tensor names, config mapping."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_hf
from safetensors.numpy import load_file, save_file

from klrl.models.base import causal_mask, forward, positions_from_mask
from klrl.models.gpt2 import GPT2, config_from_hf, config_to_hf
from klrl.models.hf import load_hf

DATA = Path(__file__).parents[1] / "data"


def rel_error(model, params) -> float:
    """Relative max error against transformers' logits of ``forward`` (``[B, T, T]`` mask) and of
    ``apply`` with transformers' ``[B, T]`` ``attention_mask`` and ``position_ids`` (one program)."""
    g = np.load(DATA / "tiny_gpt2" / "golden.npz")
    both = jax.jit(
        lambda p, t, k, pos: (
            forward(model, p, t, k).logits,
            model.apply(p, t, pos, k.astype(jnp.int32)).logits,
        )
    )
    outs = both(
        params, jnp.asarray(g["tokens"], jnp.int32), g["mask"], jnp.asarray(g["positions"], jnp.int32)
    )
    m, scale = g["mask"], np.abs(g["logits"][g["mask"]]).max()
    return max(float(np.abs(np.asarray(o)[m] - g["logits"][m]).max() / scale) for o in outs)


def test_fp32_logits_match_transformers_golden():
    model, params = load_hf(DATA / "tiny_gpt2")
    assert isinstance(model, GPT2) and model.config.layer_norm_epsilon == 1e-5
    assert rel_error(model, params) <= 1e-4


def test_bf16_compute_is_close():
    model, params = load_hf(DATA / "tiny_gpt2", dtype=jnp.bfloat16)
    assert rel_error(model, params) < 0.05


def test_kv_cache_decoding_matches_teacher_forcing():
    model, params = load_hf(DATA / "tiny_gpt2")
    g = np.load(DATA / "tiny_gpt2" / "golden.npz")
    tokens, mask = jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"])
    full = np.asarray(jax.jit(lambda p, t, k: forward(model, p, t, k).logits)(params, tokens, mask))
    apply = jax.jit(model.apply)
    pos, att = positions_from_mask(mask), causal_mask(mask)
    cache = model.init_cache(3, 10)
    got = []
    for i in range(10):
        out = apply(params, tokens[:, i : i + 1], pos[:, i : i + 1], att[:, i : i + 1], cache, jnp.int32(i))
        cache = out.cache
        got.append(np.asarray(out.logits))
    np.testing.assert_allclose(np.concatenate(got, 1)[g["mask"]], full[g["mask"]], atol=1e-5)


def test_hub_style_names_without_prefix_and_mask_buffers(tmp_path):
    d = tmp_path / "gpt2"
    shutil.copytree(DATA / "tiny_gpt2", d)
    t = load_file(d / "model.safetensors")
    hub = {k.removeprefix("transformer."): v for k, v in t.items()}
    hub["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))  # old files keep the causal mask
    save_file(hub, str(d / "model.safetensors"), metadata={"format": "pt"})
    model, params = load_hf(d)
    assert rel_error(model, params) <= 1e-4


def test_config_mapping():
    d = {
        "model_type": "gpt2",
        "vocab_size": 50,
        "n_embd": 16,
        "n_layer": 1,
        "n_head": 2,
        "n_positions": 32,
        "activation_function": "gelu_new",
        "bos_token_id": 50256,
    }
    c = config_from_hf(d)
    assert c.inner == 64 and c.tie_word_embeddings and config_from_hf(config_to_hf(c)) == c
    with pytest.raises(ValueError, match="activation_function"):
        config_from_hf({**d, "activation_function": "mish"})
    assert GPT2(c).max_len == 32


@needs_hf  # (CI: fails, never skips, without the [hf] extra)
def test_live_against_transformers():
    import torch
    import transformers

    ref = transformers.GPT2LMHeadModel.from_pretrained(DATA / "tiny_gpt2", attn_implementation="eager").eval()
    g = np.load(DATA / "tiny_gpt2" / "golden.npz")
    with torch.no_grad():
        want = ref(
            input_ids=torch.tensor(g["tokens"]),
            attention_mask=torch.tensor(g["mask"].astype(np.int64)),
            position_ids=torch.tensor(g["positions"]),
        ).logits.numpy()
    np.testing.assert_allclose(want[g["mask"]], g["logits"][g["mask"]], atol=1e-5)
