"""Tests of klrl.models.gpt (klrl's GPT as a CausalLM) and klrl.models.heads: KV-cache decoding vs a
teacher-forced forward, heads on a trunk, the family registry, FLOP count."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import ModelConfig
from klrl.models.base import CausalLM, causal_mask, forward, positions_from_mask, spec_for
from klrl.models.gpt import GPT, matmul_flops
from klrl.models.heads import ScalarHead, ValueHead, attach, detach
from klrl.models.registry import family_names, get_family

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
    """The trunk's parameters with a value head attached (one dict, as the train state keeps them)."""
    head = ValueHead(model.hidden_size)
    return jax.jit(lambda k: attach(model.init(k), head.init(k)))(jax.random.PRNGKey(seed))


def _forward(model: GPT, params, tokens, key_mask):
    return jax.jit(lambda p, t, m: forward(model, detach(p)[0], t, m))(params, tokens, key_mask)


def _incremental(model: GPT, params, tokens, prompt_mask):
    """Prefill the prompt into a KV cache, then feed the remaining tokens one at a time."""
    b = tokens.shape[0]
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((b, R_LEN), jnp.float32)], axis=1)
    mask, pos = causal_mask(key_mask), positions_from_mask(key_mask)
    apply = jax.jit(lambda p, t, ps, m, c, i: model.apply(detach(p)[0], t, ps, m, c, i))
    out = apply(params, tokens[:, :P_LEN], pos[:, :P_LEN], mask[:, :P_LEN], model.init_cache(b, S_LEN), 0)
    logits, cache = [out.logits], out.cache
    for slot in range(P_LEN, S_LEN):  # one compiled single-token step; the slot is a traced index
        sl = slice(slot, slot + 1)
        o = apply(params, tokens[:, sl], pos[:, sl], mask[:, sl], cache, jnp.int32(slot))
        logits.append(o.logits)
        cache = o.cache
    return jnp.concatenate(logits, axis=1), key_mask


_MODELS: dict[bool, tuple[GPT, dict]] = {}


def _model(tie: bool) -> tuple[GPT, dict]:
    """A policy (tied or untied output projection) and its parameters with a value head attached,
    built once per module."""
    if tie not in _MODELS:
        cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, tie_embeddings=tie)
        model = GPT(cfg, VOCAB, S_LEN)
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
    value = ValueHead(16).apply(params["v_head"], out.hidden)
    assert value.shape == (3, S_LEN) and value.dtype == jnp.float32
    assert out.hidden.shape == (3, S_LEN, 16)
    ref = np.asarray(out.hidden) @ np.asarray(params["v_head"]["kernel"][:, 0]) + float(
        params["v_head"]["bias"][0]
    )
    np.testing.assert_allclose(np.asarray(value), ref, atol=1e-5, rtol=1e-5)


def test_scalar_only_model() -> None:
    """A critic / reward trunk: no LM head, the policy's hidden states; a scalar head reads the last
    real response token."""
    policy, params = _model(True)
    critic = GPT(policy.cfg, VOCAB, S_LEN, lm_head=False)
    tokens, prompt_mask = _batch()
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((3, R_LEN))], axis=1)
    out = _forward(critic, params, tokens, key_mask)
    assert out.logits is None
    both = _forward(policy, params, tokens, key_mask)
    np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(both.hidden), atol=1e-6)
    assert set(critic.init(jax.random.PRNGKey(0))) == set(detach(params)[0])  # tied: no 'lm' either way
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], jnp.float32)
    score = ScalarHead(16).score(params["v_head"], out.hidden, mask)
    value = np.asarray(ValueHead(16).apply(params["v_head"], out.hidden))
    np.testing.assert_allclose(np.asarray(score), [value[0, P_LEN + 1], value[1, S_LEN - 1], 0.0], atol=1e-6)


def test_gpt_is_a_causal_lm_family() -> None:
    model = get_family("gpt")(ModelConfig(n_layers=1, d_model=8, n_heads=2), VOCAB, S_LEN)
    assert isinstance(model, GPT) and isinstance(model, CausalLM)
    assert (model.vocab_size, model.hidden_size, model.max_len) == (VOCAB, 8, S_LEN)
    assert "gpt" in family_names()
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        get_family("nope")
    params = model.init(jax.random.PRNGKey(0))
    specs = spec_for(model.partition_rules(), params)
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): s
        for path, s in jax.tree_util.tree_leaves_with_path(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        )
    }
    assert flat["h0/qkv/kernel"] == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert flat["h0/proj/kernel"] == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert flat["ln_f/scale"] == jax.sharding.PartitionSpec()


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
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    tokens, mask = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))
    jaxpr = jax.make_jaxpr(lambda p: forward(model, p, tokens, mask).logits)(params).jaxpr
    assert _dot_flops(jaxpr) == matmul_flops(cfg, VOCAB, tokens=b * t, context=t)


def test_apply_takes_a_padding_mask_and_refuses_other_shapes():
    """klrl's GPT, like the pretrained families: a ``[B, T]`` padding mask is made causal inside
    (the same logits as the ``[B, T, T]`` mask); another shape is one ``ValueError`` naming both."""
    model = GPT(ModelConfig(n_layers=1, d_model=16, n_heads=2), VOCAB, S_LEN)
    params = model.init(jax.random.PRNGKey(0))
    tokens, prompt_mask = _batch()
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((3, R_LEN))], axis=1)
    pos = positions_from_mask(key_mask)
    both = jax.jit(lambda p, t, pos, k: (model.apply(p, t, pos, causal_mask(k)), model.apply(p, t, pos, k)))
    want, got = (o.logits for o in both(params, tokens, pos, key_mask))
    real = np.asarray(key_mask) > 0
    np.testing.assert_array_equal(np.asarray(got)[real], np.asarray(want)[real])
    with pytest.raises(ValueError, match=r"^mask: shape \(3, 8\), expected \[B, T\] = \(3, 9\)"):
        model.apply(params, tokens, pos, key_mask[:, 1:])
