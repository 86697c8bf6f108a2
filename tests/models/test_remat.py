"""model.remat (klrl.models.remat): the same loss and gradients as without rematerialisation, for every
family, and fewer temporaries in the compiled gradient (``memory_analysis``); the PPO update's
gradient under ``model.remat`` equals the one without."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import ConfigError, ModelConfig
from klrl.models.base import forward
from klrl.models.gpt import GPT
from klrl.models.hf import load_hf
from klrl.models.remat import REMAT_MODES, check_mode, with_remat

DATA = Path(__file__).parents[1] / "data"
B, T = 8, 48


def _families():
    gpt = GPT(ModelConfig(n_layers=3, d_model=32, n_heads=4), vocab_size=64, max_len=T)
    out = [("gpt", gpt, gpt.init(jax.random.key(0)))]
    for name in ("tiny_llama", "tiny_qwen2", "tiny_gpt2", "tiny_gemma3"):
        out.append((name, *load_hf(DATA / name)))
    return out


FAMILIES = _families()


def _loss(model, tokens, key_mask, w):
    def loss(params):
        out = forward(model, params, tokens, key_mask)
        return jnp.sum(w * jax.nn.log_softmax(out.logits)) + jnp.sum(out.hidden**2)

    return loss


def _inputs(model):
    k = jax.random.split(jax.random.key(1), 2)
    tokens = jax.random.randint(k[0], (B, T), 0, model.vocab_size)
    key_mask = (jnp.arange(T)[None] >= jnp.arange(B)[:, None]).astype(jnp.float32)  # left padding
    w = jax.random.normal(k[1], (B, T, model.vocab_size))
    return tokens, key_mask, w


@pytest.mark.parametrize("name,model,params", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_same_loss_and_gradients_and_fewer_temporaries(name, model, params):
    """Same values for every family; fewer temporaries where the layers are an ``nn.scan`` (GPT-2,
    Llama, Qwen2). klrl's GPT unrolls its layers in Python: XLA:CPU may schedule the recomputation
    early there, and measured no saving (its models are the small testbed's)."""
    tokens, key_mask, w = _inputs(model)
    got, temp = {}, {}
    for mode in REMAT_MODES:
        m = with_remat(model, mode)
        assert m.remat == mode
        f = jax.jit(jax.value_and_grad(_loss(m, tokens, key_mask, w)))
        got[mode] = f(params)
        temp[mode] = f.lower(params).compile().memory_analysis().temp_size_in_bytes
    (l0, g0) = got["none"]
    for mode in ("block", "dots", "full"):
        lm, gm = got[mode]
        np.testing.assert_allclose(lm, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(gm), jax.tree.leaves(g0), strict=True):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max())
            )
    if name != "gpt":  # layers in a scan: the backward recomputes one block at a time
        assert temp["full"] < temp["none"], temp
        assert temp["block"] < temp["none"], temp
        assert temp["full"] <= temp["block"], temp
        assert temp["block"] <= temp["dots"] < temp["none"], temp  # dots also keeps the attention's


def test_modes_and_config():
    assert check_mode(False) == "none" and check_mode(True) == "full" and check_mode("block") == "block"
    with pytest.raises(ValueError, match="remat"):
        check_mode("sometimes")
    with pytest.raises(ConfigError, match="model.remat"):
        ModelConfig(remat="all")
    model = FAMILIES[1][1]
    assert with_remat(model, "none") is model


@pytest.mark.parametrize("logits", ["full", "chunked"])
def test_the_ppo_loss_gradient_is_the_same_under_remat(logits):
    """``Train.loss`` (what the update differentiates) of a run with ``model.remat`` block/dots/full has the
    value and the gradient of the same run without it (policy with a head and a separate value
    model); the rollout's and the scoring's models are not rematerialised."""
    from klrl.config import RunConfig
    from klrl.data.vocab import WordTokenizer
    from klrl.step.train import Batch, make_train
    from klrl.tasks.base import JaxReward, Task, TokenPool

    v, p, r, b = 13, 3, 5, 4
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, v, (b, p + r)), jnp.int32)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    mb = Batch(tokens=tokens, key_mask=jnp.ones((b, p + r)), response=tokens[:, p:], mask=jnp.ones((b, r)),
               logp=-2.0 + 0.3 * f32(b, r), ref_logp=-2.0 + 0.3 * f32(b, r), adv=f32(b, r), ret=f32(b, r),
               value=0.1 * f32(b, r), ref_logits=None)  # fmt: skip
    out = {}
    for value_model in ("head", "separate"):
        for mode in REMAT_MODES:
            cfg = RunConfig().replace(
                model={"n_layers": 2, "d_model": 16, "n_heads": 2, "value_model": value_model, "remat": mode,
                       "logits": logits},
                sampling={"response_len": r}, train={"batch_size": b, "devices": 1}, ppo={"minibatches": 1},
            )  # fmt: skip
            policy = GPT(cfg.model, v, p + r)
            task = Task(
                name="toy", tokenizer=WordTokenizer(tuple(f"w{i}" for i in range(v)), 0, stop_ids=(1,)),
                prompts=TokenPool(tokens[:, :p], jnp.ones((b, p))), prompt_len=p,
                reward=JaxReward(lambda env, ro: jnp.zeros(ro.response.shape[:1])),
                policy=policy, policy_params=policy.init(jax.random.key(0)),
            )  # fmt: skip
            train = make_train(cfg, task)
            ctx = train.context
            assert ctx.update_policy.remat == mode and ctx.models.policy.remat == "none"
            params = train.init(1).params
            out[value_model, mode] = jax.jit(jax.value_and_grad(train.loss, has_aux=True))(
                params, mb, 17.0, 4.0, 0.1
            )
        (l0, _), g0 = out[value_model, "none"]
        for mode in ("block", "dots", "full"):
            (lm, _), gm = out[value_model, mode]
            np.testing.assert_allclose(lm, l0, rtol=1e-6)
            for a, c in zip(jax.tree.leaves(gm), jax.tree.leaves(g0), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)
