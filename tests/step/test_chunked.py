"""klrl.step.chunked: logit-derived terms from hidden states, chunk by chunk, against NumPy on the full
logits (float64), their gradients against the full-logits path, and a whole PPO-KL step on the
chunked path against the same step on the full path (fp32 tolerance)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo.logprobs import entropy, token_logprobs
from klrl.config import ConfigError, ModelConfig, RunConfig
from klrl.models.base import forward
from klrl.models.gpt import GPT
from klrl.models.hf import load_hf
from klrl.registry import ESTIMATORS
from klrl.step.chunked import (
    CHUNK_MIN_VOCAB,
    TERMS,
    check_estimators,
    estimator_term,
    head_terms,
    lm_head,
    map_positions,
    use_chunks,
)

DATA = Path(__file__).parents[1] / "data"
GGUF = DATA / "tiny_gguf" / "tiny.gguf"
B, T, TEMP = 3, 7, 0.7


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _models():
    gpt = GPT(ModelConfig(n_layers=1, d_model=16, n_heads=2), vocab_size=50, max_len=16)
    untied = GPT(
        ModelConfig(n_layers=1, d_model=16, n_heads=2, tie_embeddings=False), vocab_size=50, max_len=16
    )
    out = [("gpt", gpt, gpt.init(jax.random.key(0))), ("gpt-untied", untied, untied.init(jax.random.key(1)))]
    for name in ("tiny_llama", "tiny_qwen2", "tiny_gpt2"):  # untied, tied, tied
        model, params = load_hf(DATA / name)
        out.append((name, model, params))
    return out


MODELS = _models()


@pytest.mark.parametrize("name,model,params", MODELS, ids=[m[0] for m in MODELS])
def test_head_is_the_lm_head_of_apply(name, model, params):
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, model.vocab_size)
    out = forward(model, params, tokens, jnp.ones((2, 9)))
    np.testing.assert_allclose(
        np.asarray(lm_head(model, params, out.hidden)), np.asarray(out.logits), atol=1e-5
    )


def test_use_chunks_auto_and_config():
    assert use_chunks("auto", CHUNK_MIN_VOCAB) and not use_chunks("auto", CHUNK_MIN_VOCAB - 1)
    assert use_chunks("chunked", 10) and not use_chunks("full", 10**6)
    with pytest.raises(ConfigError, match="model.logits"):
        ModelConfig(logits="sometimes")
    with pytest.raises(ConfigError, match="model.logits_chunk"):
        ModelConfig(logits_chunk=0)


def test_an_estimator_of_the_logits_runs_chunked_only_in_its_declared_form():
    assert ESTIMATORS.meta("full")["chunked"] == "kl"  # full's chunked form: head_terms' exact KL
    for n in ESTIMATORS:  # every built-in runs on the chunked path
        meta = ESTIMATORS.meta(n)
        assert meta["inputs"] == "logp" or meta["chunked"] in TERMS, n
    check_estimators(RunConfig().replace(kl={"estimator": "full"}), CHUNK_MIN_VOCAB)
    assert estimator_term("full", {"kl": 1.5}) == 1.5
    ESTIMATORS.register("jsd", inputs="logits")(lambda *a: None)  # no chunked form
    try:
        cfg = RunConfig().replace(kl={"estimator": "jsd"})
        check_estimators(cfg, CHUNK_MIN_VOCAB - 1)  # the full path reads the logits: fine
        check_estimators(cfg.replace(model={"logits": "full"}), 10**6)
        with pytest.raises(ConfigError, match=r"^kl.estimator: the KL estimator 'jsd' reads the full"):
            check_estimators(cfg, CHUNK_MIN_VOCAB)
        ctrl = RunConfig().replace(ctrl={"estimator": "jsd"}, model={"logits": "chunked"})
        with pytest.raises(ConfigError, match=r"^ctrl.estimator: the KL estimator 'jsd'"):
            check_estimators(ctrl, 50)
        loss = RunConfig().replace(kl={"loss_estimator": "jsd"}, model={"logits": "chunked"})
        check_estimators(loss, 50)  # kl.placement=reward: the loss estimator is not used
        with pytest.raises(ConfigError, match=r"^kl.loss_estimator: the KL estimator 'jsd'"):
            check_estimators(loss.replace(kl={"placement": "loss"}), 50)
        with pytest.raises(ConfigError, match="'jsd' reads the full"):
            estimator_term("jsd", {"kl": 1.5})
    finally:
        ESTIMATORS.remove("jsd")


@pytest.mark.parametrize("chunk", [1, 4, 21, 64])  # 21 = B * T: one chunk; 64: more than the rows
def test_map_positions_pads_and_restores_the_shape(chunk):
    x = jnp.arange(B * T * 2, dtype=jnp.float32).reshape(B, T, 2)
    got = map_positions(lambda a, none: {"s": a.sum(-1), "a": a}, (x, None), chunk)
    np.testing.assert_array_equal(np.asarray(got["s"]), np.asarray(x.sum(-1)))
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(x))


def _inputs(model, params):
    k = jax.random.split(jax.random.key(3), 4)
    d = model.hidden_size
    hp = jax.random.normal(k[0], (B, T, d))
    hq = hp + 0.3 * jax.random.normal(k[1], (B, T, d))
    tok = jax.random.randint(k[2], (B, T), 0, model.vocab_size)
    mask = (jnp.arange(T)[None] < jnp.array([[T], [4], [1]])).astype(jnp.float32)
    ref_params = jax.tree.map(lambda a: a * 1.1, params)
    return hp, hq, tok, mask, ref_params


@pytest.mark.parametrize("name,model,params", MODELS[::2], ids=[m[0] for m in MODELS[::2]])
@pytest.mark.parametrize("chunk", [5, 128])
def test_head_terms_match_numpy_on_full_logits(name, model, params, chunk):
    hp, hq, tok, mask, ref_params = _inputs(model, params)
    got = head_terms(model, tok, mask, temperature=TEMP, chunk=chunk,
                     want=("policy_logp", "policy_entropy", "ref_logp", "kl"), policy=(params, hp),
                     ref=(ref_params, hq), clamps=(0.0, 0.5))  # fmt: skip
    zp = np.asarray(lm_head(model, params, hp), np.float64) / TEMP
    zq = np.asarray(lm_head(model, ref_params, hq), np.float64) / TEMP
    lp, lq = _log_softmax(zp), _log_softmax(zq)
    t = np.asarray(tok)[..., None]
    m = np.asarray(mask)
    np.testing.assert_allclose(got["policy_logp"], np.take_along_axis(lp, t, -1)[..., 0], atol=2e-5)
    np.testing.assert_allclose(got["ref_logp"], np.take_along_axis(lq, t, -1)[..., 0], atol=2e-5)
    np.testing.assert_allclose(got["policy_entropy"], -(np.exp(lp) * lp).sum(-1), atol=2e-5)
    kl = (np.exp(lp) * (lp - lq)).sum(-1) * m
    kl_c = np.clip((np.exp(lp) * np.clip(lp - lq, -0.5, 0.5)).sum(-1), -0.5, 0.5) * m
    np.testing.assert_allclose(got["kl"][0], kl, atol=2e-5)
    np.testing.assert_allclose(got["kl"][1], kl_c, atol=2e-5)
    assert np.all(np.asarray(got["kl"][0])[m == 0] == 0)


@pytest.mark.parametrize("name,model,params", MODELS[1:4], ids=[m[0] for m in MODELS[1:4]])
def test_gradients_match_the_full_logits_path(name, model, params):
    """d/d(params, hidden) of a loss built from the chunked (checkpointed) terms equals the same loss
    on the full [B, T, V] logits."""
    from klrl.algo.kl import full_kl

    hp, hq, tok, mask, ref_params = _inputs(model, params)
    w = jax.random.normal(jax.random.key(4), (3, B, T))

    def chunked_loss(p, h):
        want = ("policy_logp", "policy_entropy", "kl")
        t = head_terms(model, tok, mask, temperature=TEMP, chunk=4, want=want, policy=(p, h),
                       ref=(ref_params, hq), clamps=(0.2,), checkpoint=True)  # fmt: skip
        return jnp.sum(w[0] * t["policy_logp"] + w[1] * t["policy_entropy"] + w[2] * t["kl"][0])

    def full_loss(p, h):
        z = lm_head(model, p, h) / TEMP
        zq = lm_head(model, ref_params, hq) / TEMP
        terms = (token_logprobs(z, tok), entropy(z), full_kl(z, zq, mask, 0.2))
        return jnp.sum(w[0] * terms[0] + w[1] * terms[1] + w[2] * terms[2])

    (lc, gc), (lf, gf) = (
        jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, hp) for f in (chunked_loss, full_loss)
    )
    np.testing.assert_allclose(lc, lf, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gf), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * (1 + float(jnp.abs(b).max())))


def test_the_chunked_update_holds_no_vocabulary_sized_buffer():
    """The gradient through chunked, checkpointed terms needs far fewer temporaries than through the
    full logits (compiled memory analysis), on a 4096-token vocabulary."""
    model = GPT(ModelConfig(n_layers=1, d_model=32, n_heads=2), vocab_size=4096, max_len=16)
    params = model.init(jax.random.key(0))
    h = jax.random.normal(jax.random.key(1), (8, 16, 32))
    tok = jnp.zeros((8, 16), jnp.int32)

    def chunked_loss(p):
        t = head_terms(model, tok, jnp.ones((8, 16)), temperature=1.0, chunk=16, want=("policy_logp",),
                       policy=(p, h), checkpoint=True)  # fmt: skip
        return jnp.sum(t["policy_logp"])

    def full_loss(p):
        return jnp.sum(token_logprobs(lm_head(model, p, h), tok))

    def temp(f):
        return jax.jit(jax.grad(f)).lower(params).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 8 * 16 * 4096 * 4
    assert temp(full_loss) >= logits_bytes
    assert temp(chunked_loss) < logits_bytes / 2


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_chunked_step_equals_the_full_step():
    """Two PPO-KL iterations on a tiny Llama (GGUF): model.logits=chunked against full, with a
    separate value model, the exact KL in the reward and (clamped) in the loss, remat full on the
    chunked side: the same metrics (kl/exact_* included) and parameters to fp32 tolerance."""
    from klrl.step.train import make_train
    from klrl.tasks.text import make_text_task, value_models

    def run(logits, remat):
        cfg = RunConfig.from_dict({
            "model": {"path": str(GGUF), "value_model": "separate", "logits": logits, "logits_chunk": 5,
                      "remat": remat},
            "task": {"name": "text"}, "data": {"prompt_len": 16, "limit": 8},
            "sampling": {"response_len": 6, "use_eos": False}, "train": {"batch_size": 4},
            "ppo": {"epochs": 1, "minibatches": 2},
            "kl": {"placement": "reward+loss", "estimator": "full", "loss_estimator": "full",
                   "loss_coef": 0.1, "clamp": 3.0},
        })  # fmt: skip
        task = make_text_task(cfg)
        train = make_train(cfg, task, **value_models(cfg, task))
        assert train.context.chunked == (logits == "chunked")
        state = train.init(0)
        for _ in range(2):
            state, metrics = train.step(state, task.env)
        return state, {k: float(v) for k, v in metrics.items()}

    (sa, ma), (sb, mb) = run("full", "none"), run("chunked", "full")
    assert set(ma) == set(mb) and "kl/exact_seq_sum" in ma
    for k in ma:
        assert abs(ma[k] - mb[k]) <= 1e-5 * (1 + abs(ma[k])), (k, ma[k], mb[k])
    for a, b in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
