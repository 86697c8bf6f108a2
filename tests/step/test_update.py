"""The PPO loss as a whole (``klrl.step.update.ppo_loss``, what the update differentiates) against an
independent NumPy reference written here: clipped surrogate + entropy bonus + clipped value loss +
the KL-in-loss term, each ``kl.loss_agg``, the token/sequence normalisation, temperature, the value
head on the trunk and a separate value model. The model's forward is not under test: its logits and
hidden states come from the model; everything after them is recomputed in NumPy."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import RunConfig
from klrl.data.vocab import WordTokenizer
from klrl.models.base import forward
from klrl.models.gpt import GPT
from klrl.models.heads import detach
from klrl.step.train import Batch, make_train
from klrl.tasks.base import JaxReward, Task, TokenPool

V, P, R, B = 11, 3, 5, 8
TEMP = 1.3


def _task(cfg: RunConfig) -> Task:
    policy = GPT(cfg.model, V, P + R)
    prompts = jax.random.randint(jax.random.PRNGKey(9), (16, P), 2, V)
    return Task(
        name="toy",
        tokenizer=WordTokenizer(tuple(f"w{i}" for i in range(V)), pad_id=0, stop_ids=(1,)),
        prompts=TokenPool(prompts, jnp.ones((16, P), jnp.float32)),
        prompt_len=P,
        reward=JaxReward(lambda env, ro: jnp.zeros(ro.response.shape[:1], jnp.float32)),
        policy=policy,
        policy_params=policy.init(jax.random.PRNGKey(0)),
    )


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(name, logp, ref_logp, logits, ref_logits):
    lr = logp - ref_logp
    if name == "k1":
        return lr
    if name == "k2":
        return 0.5 * lr**2
    if name == "k3":
        return np.exp(-lr) - 1 + lr
    if name == "abs":
        return np.abs(lr)
    lp, lq = _log_softmax(logits), _log_softmax(ref_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def reference(cfg, logits_full, value_full, mb, n_tok, n_seq, beta_l, ref_logits=None):
    """Every term in NumPy (float64), from the model's full-sequence logits and values."""
    ppo, klc = cfg.ppo, cfg.kl
    m = np.asarray(mb.mask, np.float64)
    logits = np.asarray(logits_full, np.float64)[:, P - 1 : P + R - 1] / TEMP
    lsm = _log_softmax(logits)
    logp = np.take_along_axis(lsm, np.asarray(mb.response)[..., None], -1)[..., 0]
    old, adv = np.asarray(mb.logp, np.float64), np.asarray(mb.adv, np.float64)
    ratio = np.exp(logp - old)
    pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - ppo.clip, 1 + ppo.clip))
    ent = -(np.exp(lsm) * lsm).sum(-1)
    loss = ((pg - ppo.ent_coef * ent) * m).sum() / n_tok
    if value_full is not None:
        v = np.asarray(value_full, np.float64)[:, P - 1 : P + R - 1]
        ov, ret = np.asarray(mb.value, np.float64), np.asarray(mb.ret, np.float64)
        vc = ov + np.clip(v - ov, -ppo.vf_clip, ppo.vf_clip)
        vl = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2)
        loss += ppo.vf_coef * (vl * m).sum() / n_tok
    if klc.placement in ("loss", "reward+loss"):
        ref_logits = None if ref_logits is None else np.asarray(ref_logits, np.float64)
        k = _kl(klc.loss_estimator, logp, np.asarray(mb.ref_logp, np.float64), logits, ref_logits) * m
        if klc.loss_agg == "token_mean":
            term = k.sum() / n_tok
        else:
            term = (k.sum(-1) / np.maximum(m.sum(-1), 1)).sum() / n_seq
        loss += beta_l * term
    return loss


GAE, GRPO, RLOO = (
    {"advantage": "gae"},
    {"advantage": "grpo", "group_size": 2},
    {"advantage": "rloo", "group_size": 2},
)
CASES = {
    "gae_head_k3_token": dict(ppo=GAE, kl={"loss_estimator": "k3", "loss_agg": "token_mean"}),
    "gae_separate_full_seq": dict(
        ppo=GAE, model={"value_model": "separate"}, kl={"loss_estimator": "full", "loss_agg": "seq_mean"}
    ),
    "grpo_k2_seq": dict(ppo=GRPO, kl={"loss_estimator": "k2", "loss_agg": "seq_mean"}),
    "rloo_abs_token_reward_only": dict(ppo=RLOO, kl={"loss_estimator": "abs", "placement": "reward"}),
    "gae_head_k1_token": dict(ppo=GAE, kl={"loss_estimator": "k1", "placement": "reward+loss"}),
    # model.logits=chunked (klrl.step.chunked): the same loss from hidden states, 7 positions at a time
    "chunked_gae_separate_full_seq": dict(
        ppo=GAE, model={"value_model": "separate", "logits": "chunked", "logits_chunk": 7},
        kl={"loss_estimator": "full", "loss_agg": "seq_mean"},
    ),
    "chunked_gae_head_k3_token": dict(
        ppo=GAE, model={"logits": "chunked", "logits_chunk": 7}, kl={"loss_estimator": "k3"}
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_ppo_loss_matches_numpy(case):
    upd = CASES[case]
    cfg = RunConfig().replace(
        model={"n_layers": 1, "d_model": 16, "n_heads": 2, **upd.get("model", {})},
        sampling={"response_len": R, "temperature": TEMP},
        train={"batch_size": B, "devices": 1},
        ppo={"minibatches": 1, "ent_coef": 0.03, "vf_coef": 0.7, "clip": 0.1, "vf_clip": 0.05, **upd["ppo"]},
        kl={"placement": "loss", "loss_coef": 0.2, **upd["kl"]},
    )
    task = _task(cfg)
    train = make_train(cfg, task)
    state = train.init(3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, V, (B, P + R)).astype(np.int32)
    mask = (np.arange(R)[None] < np.array([5, 3, 1, 0, 4, 5, 2, 5])[:, None]).astype(np.float32)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    full = task.policy_params
    # the reference's hidden states (perturbed) and its tempered logits from them
    ref_hidden = forward(task.policy, full, jnp.asarray(tokens), jnp.ones((B, P + R))).hidden
    ref_hidden = jnp.asarray(
        np.asarray(ref_hidden)[:, P - 1 : P + R - 1] + 0.3 * f32(B, R, cfg.model.d_model)
    )
    ref_logits = task.policy.head(full, ref_hidden) / TEMP
    needs_logits = cfg.kl.loss_estimator == "full" and cfg.kl.placement != "reward"
    chunked = cfg.model.logits == "chunked"
    assert train.context.chunked == chunked
    mb = Batch(
        tokens=jnp.asarray(tokens), key_mask=jnp.ones((B, P + R), jnp.float32),
        response=jnp.asarray(tokens[:, P:]), mask=jnp.asarray(mask),
        logp=jnp.asarray(-2.0 + 0.3 * f32(B, R)), ref_logp=jnp.asarray(-2.0 + 0.3 * f32(B, R)),
        adv=jnp.asarray(f32(B, R)), ret=jnp.asarray(f32(B, R)), value=jnp.asarray(0.1 * f32(B, R)),
        ref_logits=ref_logits if needs_logits and not chunked else None,
        ref_hidden=ref_hidden if needs_logits and chunked else None,
    )  # fmt: skip
    params = jax.tree.map(
        lambda x: x + 0.02 * jnp.asarray(rng.standard_normal(x.shape), x.dtype), state.params
    )
    n_tok, n_seq, beta_l = (
        float(mask.sum()) / 1.5,
        B / 2.0,
        0.37,
    )  # any normalisers: they must be used as given
    loss, stats = jax.jit(partial(train.loss, ref_params=full))(params, mb, n_tok, n_seq, beta_l)

    # the model's outputs for the reference (policy logits; values from the head it sits on)
    ctx = train.context
    trunk, head = detach(params["policy"]) if ctx.head else (params["policy"], None)
    out = forward(task.policy, trunk, mb.tokens, mb.key_mask)
    value_full = None
    if ctx.head:
        value_full = ctx.models.value_head.apply(head, out.hidden)
    elif ctx.separate:
        vt, vh = detach(params["value"])
        value_full = ctx.models.value_head.apply(
            vh, forward(ctx.models.value, vt, mb.tokens, mb.key_mask).hidden
        )
    want = reference(
        cfg, out.logits, value_full, mb, n_tok, n_seq, beta_l, ref_logits if needs_logits else None
    )
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    assert float(stats["loss/total"]) == float(loss)
    assert ("loss/value" in stats) is (value_full is not None)
    assert (f"kl/loss_{cfg.kl.loss_agg}" in stats) is (cfg.kl.placement != "reward")


def test_with_a_critic_clip_a_large_value_loss_leaves_the_policy_s_step_alone():
    """One step with a separate critic at vf_coef 1e3 and at 1e-3: the same advantages (the old values
    are the initial critic's), so the policy's gradient is the same; with optim.critic_max_grad_norm the
    policy's parameters end bit for bit equal (one global clip: tests/step/test_optim.py shows the large value
    loss shrinking the policy's step). grad/norm^2 = grad/policy_norm^2 + grad/critic_norm^2."""
    clip = {"max_grad_norm": 0.5, "critic_max_grad_norm": 0.5}
    policies, stats = [], []
    for vf in (1e3, 1e-3):
        cfg = RunConfig().replace(
            model={"n_layers": 1, "d_model": 16, "n_heads": 2, "value_model": "separate"},
            sampling={"response_len": R}, train={"batch_size": B, "devices": 1},
            ppo={"minibatches": 1, "epochs": 1, "vf_coef": vf}, optim={"lr": 1e-2, **clip},
        )  # fmt: skip
        task = _task(cfg)
        train = make_train(cfg, task)
        state, metrics = train.step(train.init(3), task.env)
        policies.append(state.params["policy"])
        stats.append({k: float(metrics[k]) for k in ("grad/norm", "grad/policy_norm", "grad/critic_norm")})
    for s in stats:
        assert s["grad/norm"] ** 2 == pytest.approx(s["grad/policy_norm"] ** 2 + s["grad/critic_norm"] ** 2)
    assert stats[0]["grad/policy_norm"] == pytest.approx(stats[1]["grad/policy_norm"], rel=1e-5)
    assert stats[0]["grad/critic_norm"] > 1e3 * stats[0]["grad/policy_norm"]
    for a, b in zip(*map(jax.tree.leaves, policies), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
