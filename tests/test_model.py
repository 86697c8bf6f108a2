"""Tests of klrl.model: KV-cache decoding vs a teacher-forced forward, heads, FLOP count."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import ModelConfig
from klrl.model import (
    GPT,
    causal_mask,
    forward,
    init_cache,
    init_params,
    matmul_flops,
    positions_from_mask,
)

VOCAB = 23
P_LEN, R_LEN = 5, 4
S_LEN = P_LEN + R_LEN


def _batch():
    """Left-padded prompts (lengths 5, 3, 1) followed by R_LEN forced tokens."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, VOCAB, size=(3, S_LEN)).astype(np.int32)
    prompt_mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]], np.float32)
    tokens[:, :P_LEN] = np.where(prompt_mask > 0, tokens[:, :P_LEN], 0)
    return jnp.asarray(tokens), jnp.asarray(prompt_mask)


def _init(model: GPT, seed: int, seq_len: int):
    return jax.jit(lambda k: init_params(model, k, seq_len))(jax.random.PRNGKey(seed))


def _forward(model: GPT, params, tokens, key_mask):
    return jax.jit(lambda p, t, m: forward(model, p, t, m))(params, tokens, key_mask)


def _incremental(model: GPT, params, tokens, prompt_mask):
    """Prefill the prompt into a KV cache, then feed the remaining tokens one at a time."""
    b = tokens.shape[0]
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((b, R_LEN), jnp.float32)], axis=1)
    mask, pos = causal_mask(key_mask), positions_from_mask(key_mask)
    apply = jax.jit(lambda p, t, ps, m, c, i: model.apply({"params": p}, t, ps, m, c, i))
    out = apply(
        params, tokens[:, :P_LEN], pos[:, :P_LEN], mask[:, :P_LEN], init_cache(model.cfg, b, S_LEN), 0
    )
    logits, cache = [out.logits], out.cache
    for slot in range(P_LEN, S_LEN):  # one compiled single-token step; the slot is a traced index
        sl = slice(slot, slot + 1)
        o = apply(params, tokens[:, sl], pos[:, sl], mask[:, sl], cache, jnp.int32(slot))
        logits.append(o.logits)
        cache = o.cache
    return jnp.concatenate(logits, axis=1), key_mask


_MODELS: dict[bool, tuple[GPT, dict]] = {}


def _model(tie: bool) -> tuple[GPT, dict]:
    """A policy with both heads (tied or untied output projection), built once per module."""
    if tie not in _MODELS:
        cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, tie_embeddings=tie)
        model = GPT(cfg, VOCAB, S_LEN, lm_head=True, scalar_head=True)
        _MODELS[tie] = (model, _init(model, int(tie), S_LEN))
    return _MODELS[tie]


@pytest.mark.parametrize("tie", [True, False])
def test_kv_cache_matches_teacher_forcing(tie: bool) -> None:
    model, params = _model(tie)
    tokens, prompt_mask = _batch()
    inc, key_mask = _incremental(model, params, tokens, prompt_mask)
    full = _forward(model, params, tokens, key_mask).logits
    assert inc.shape == full.shape == (3, S_LEN, VOCAB)
    valid = np.asarray(key_mask) > 0  # padded prompt slots are never read by real tokens
    np.testing.assert_allclose(np.asarray(inc)[valid], np.asarray(full)[valid], atol=1e-5, rtol=1e-5)
    # left padding must not change a row's outputs: row 1 alone, without its padding
    short = _forward(model, params, tokens[1:2, 2:], jnp.ones((1, S_LEN - 2))).logits
    np.testing.assert_allclose(np.asarray(short[0]), np.asarray(full[1, 2:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_heads(tie: bool) -> None:
    model, params = _model(tie)
    tokens, prompt_mask = _batch()
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((3, R_LEN))], axis=1)
    out = _forward(model, params, tokens, key_mask)
    assert out.logits.shape == (3, S_LEN, VOCAB) and out.logits.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out.logits)))
    # tied: the output projection is the embedding, logits = h @ wte^T; untied: a separate kernel
    assert ("lm" in params) is (not tie)
    w = params["wte"]["embedding"].T if tie else params["lm"]["kernel"]
    assert w.shape == (16, VOCAB)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(out.hidden @ w), atol=1e-5, rtol=1e-5)
    # value head: [B, T] float32, a linear function of the final hidden state
    assert out.value.shape == (3, S_LEN) and out.value.dtype == jnp.float32
    assert out.hidden.shape == (3, S_LEN, 16)
    ref = out.hidden @ params["v_head"]["kernel"][:, 0] + params["v_head"]["bias"][0]
    np.testing.assert_allclose(np.asarray(out.value), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_scalar_only_model() -> None:
    """A critic / reward model: no LM head, a value per position, same trunk as the policy."""
    policy, params = _model(True)
    critic = policy.clone(lm_head=False)
    tokens, prompt_mask = _batch()
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((3, R_LEN))], axis=1)
    out = _forward(critic, params, tokens, key_mask)
    assert out.logits is None and out.value.shape == (3, S_LEN)
    both = _forward(policy, params, tokens, key_mask)
    np.testing.assert_allclose(np.asarray(out.value), np.asarray(both.value), atol=1e-6)
    no_head = policy.clone(scalar_head=False)
    assert jax.eval_shape(lambda p: forward(no_head, p, tokens, key_mask), params).value is None


def test_matmul_flops_hand_count() -> None:
    cfg = ModelConfig(n_layers=2, d_model=4, n_heads=2, mlp_ratio=2)
    # per layer and token: qkv 2*4*12 = 96, proj 2*4*4 = 32, MLP 2*(2*4*8) = 128,
    # attention scores + mixing 2*(2*5*4) = 80  -> 336; two layers 672; LM head 2*4*10 = 80
    assert matmul_flops(cfg, vocab=10, tokens=3, context=5) == 3 * (672 + 80) == 2256
    assert matmul_flops(cfg, vocab=10, tokens=3, context=5, lm_head=False) == 3 * 672 == 2016


def _dot_flops(jaxpr) -> int:
    """2 * (output size) * (contracted size), summed over every dot_general, sub-jaxprs included."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = int(np.prod([lhs[i] for i in lhs_contract]))
            total += 2 * k * int(np.prod(eqn.outvars[0].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub)
    return total


@pytest.mark.parametrize("tie", [True, False])
def test_matmul_flops_matches_traced_forward(tie: bool) -> None:
    """The formula equals the dot_generals of an actual forward (full attention over T keys)."""
    cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, mlp_ratio=3, tie_embeddings=tie)
    b, t = 2, 6
    model = GPT(cfg, VOCAB, t)
    params = jax.eval_shape(lambda k: init_params(model, k, t), jax.random.PRNGKey(0))
    tokens, mask = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))
    jaxpr = jax.make_jaxpr(lambda p: forward(model, p, tokens, mask).logits)(params).jaxpr
    assert _dot_flops(jaxpr) == matmul_flops(cfg, VOCAB, tokens=b * t, context=t)
