"""The beta testbed: a proxy reward model, an exact gold reward, and exact perplexity.

* Language: the synthetic HMM of :mod:`klrl.tasks.language` (exact likelihood).
* Reference: a small GPT pretrained on it (cached by config hash).
* Gold reward (:mod:`klrl.tasks.gold`): distinct positive words with diminishing
  returns minus a fluency penalty from the oracle likelihood. PPO never sees it.
* Proxy reward: a reward model of the same family (the reference trunk plus a
  scalar head, read at the last response token) trained with the Bradley-Terry
  loss on ``task.rm_pairs`` pairs of *reference* responses, labelled by gold with
  Bradley-Terry noise (P(a > b) = sigmoid((g_a - g_b) / task.rm_label_temp)).
  It never sees text off the reference distribution, so it extrapolates wrongly
  there: that is where reward hacking comes from (Gao et al. 2023).
* Independent evaluator: a second LM (other seed, other width) trained on the
  language, giving the perplexity a practitioner could measure on real text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from klrl.algo.logprobs import token_logprobs
from klrl.algo.metrics import spearman
from klrl.algo.textmetrics import distinct_n
from klrl.config import RunConfig, SamplingConfig
from klrl.data.prompts import check_unused
from klrl.models.base import CausalLM, forward
from klrl.models.gpt import GPT
from klrl.models.heads import ScalarHead, attach, detach
from klrl.models.rollout import generate, sequence
from klrl.rewards.train import heldout_warning
from klrl.tasks import gold as G
from klrl.tasks import language as L
from klrl.tasks.base import Evaluators, JaxReward, Task, TokenPool, register_task
from klrl.tasks.pretrain import cached, fingerprint, model_payload
from klrl.tasks.wordclass import pretrain_on, pretraining, reference_policy, tokenizer

Array = jax.Array


def rm_score(
    rm: CausalLM, params: Any, prompt: Array, prompt_mask: Array, response: Array, mask: Array
) -> Array:
    """``[B]``: the reward model's scalar at the last response token (sequence classification):
    the trunk ``rm`` with a :class:`ScalarHead` (``params``: the trunk's with the head attached)."""
    tokens, key_mask = sequence(prompt, prompt_mask, response, mask)
    trunk, head = detach(params)
    hidden = forward(rm, trunk, tokens, key_mask, logits=False).hidden
    return ScalarHead(rm.hidden_size).score(head, hidden, mask)


def lm_response_ll(
    lm: CausalLM, params: Any, prompt: Array, prompt_mask: Array, response: Array, mask: Array
) -> Array:
    """``[B]``: sum over response tokens of log p_lm(y_t | x, y_<t) (temperature 1)."""
    tokens, key_mask = sequence(prompt, prompt_mask, response, mask)
    p = prompt.shape[1]
    logits = forward(lm, params, tokens, key_mask).logits[:, p - 1 : -1]
    return jnp.sum(token_logprobs(logits, response) * mask, axis=-1)


def preference_data(cfg: RunConfig, lang, ref_model, ref_params, gold_params, n: int, key: Array) -> dict:
    """``n`` prompts, two reference responses each, gold scores and a noisy BT label."""
    t = cfg.task
    kp, ka, kb, kl = jax.random.split(key, 4)
    prompt, pmask = L.prompts(lang, kp, n, t.prompt_len)
    samp = SamplingConfig(response_len=cfg.sampling.response_len)

    @jax.jit
    def two(prompt, pmask):
        outs = []
        for k in (ka, kb):
            ro = generate(ref_model, ref_params, prompt, pmask, jax.random.split(k, n), samp, L.EOS, L.PAD)
            outs.append(
                (ro.response, ro.mask, G.gold_reward(lang, prompt, pmask, ro.response, ro.mask, gold_params))
            )
        return outs

    (ra, ma, ga), (rb, mb, gb) = two(prompt, pmask)
    p_a = jax.nn.sigmoid((ga - gb) / t.rm_label_temp)
    a_wins = jax.random.uniform(kl, (n,)) < p_a
    return {"prompt": prompt, "pmask": pmask, "ra": ra, "ma": ma, "rb": rb, "mb": mb, "ga": ga, "gb": gb,
            "a_wins": a_wins}  # fmt: skip


def train_reward_model(cfg: RunConfig, lang, ref_model, ref_params, gold_params, log=None):
    """Bradley-Terry reward model on finite reference pairs; returns params and held-out accuracy."""
    t = cfg.task
    rm = GPT(cfg.model, ref_model.vocab_size, ref_model.max_len, lm_head=False)
    key = jax.random.key(t.seed + 4000)
    k_train, k_test, k_init, k_perm = jax.random.split(key, 4)
    train = preference_data(cfg, lang, ref_model, ref_params, gold_params, t.rm_pairs, k_train)
    test = preference_data(cfg, lang, ref_model, ref_params, gold_params, t.rm_heldout, k_test)
    fresh = attach(rm.init(k_init), ScalarHead(rm.hidden_size).init(k_init))
    params = {k: (ref_params[k] if k in ref_params else v) for k, v in fresh.items()}  # reference trunk
    opt = optax.adamw(t.rm_lr, weight_decay=0.01)
    opt_state = opt.init(params)

    def scores(p, d, idx=None):
        sel = (lambda x: x[idx]) if idx is not None else (lambda x: x)
        sa = rm_score(rm, p, sel(d["prompt"]), sel(d["pmask"]), sel(d["ra"]), sel(d["ma"]))
        sb = rm_score(rm, p, sel(d["prompt"]), sel(d["pmask"]), sel(d["rb"]), sel(d["mb"]))
        return sa, sb

    def loss_fn(p, idx):
        sa, sb = scores(p, train, idx)
        margin = jnp.where(train["a_wins"][idx], sa - sb, sb - sa)
        return -jnp.mean(jax.nn.log_sigmoid(margin))

    bs = 64
    n_mb = t.rm_pairs // bs

    @jax.jit
    def epoch(params, opt_state, k):
        perm = jax.random.permutation(k, t.rm_pairs)[: n_mb * bs].reshape(n_mb, bs)

        def one(carry, idx):
            params, opt_state = carry
            loss, g = jax.value_and_grad(loss_fn)(params, idx)
            upd, opt_state = opt.update(g, opt_state, params)
            return (optax.apply_updates(params, upd), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(one, (params, opt_state), perm)
        return params, opt_state, losses.mean()

    for e, k in enumerate(jax.random.split(k_perm, t.rm_epochs)):
        params, opt_state, loss = epoch(params, opt_state, k)
        if log:
            log(f"reward model epoch {e + 1}/{t.rm_epochs}: BT loss {float(loss):.4f}")
    sa, sb = jax.jit(lambda p: scores(p, test))(params)
    ref_scores = np.concatenate([np.asarray(sa), np.asarray(sb)])
    decided = np.asarray(test["ga"] != test["gb"])
    truth = np.asarray(test["ga"] > test["gb"])
    acc = float(np.mean((np.asarray(sa > sb) == truth)[decided]))
    label_acc = float(np.mean((np.asarray(test["a_wins"]) == truth)[decided]))
    info = {"rm_heldout_accuracy": acc, "rm_label_accuracy": label_acc, "rm_final_loss": float(loss),
            "rm_ref_mean": float(ref_scores.mean()), "rm_ref_std": float(ref_scores.std())}  # fmt: skip
    if log:
        log(f"reward model held-out pairwise accuracy vs gold {acc:.3f} (noisy labels agree {label_acc:.3f})")
        warning = heldout_warning(acc, int(decided.sum()))  # the pairs the gold reward decides
        if warning:
            log(warning.replace("--rm.eval_fraction", "--task.rm_heldout"))
    return params, info


def _gold(cfg: RunConfig, lang) -> G.GoldParams:
    """The gold reward's parameters (its own key: task seed + 5000)."""
    t = cfg.task
    return G.make_gold_params(
        lang,
        jax.random.key(t.seed + 5000),
        prompt_len=t.prompt_len,
        response_len=cfg.sampling.response_len,
        quantile=t.gold_quantile,
        fluency_weight=t.gold_fluency_weight,
    )


def _proxy_rm(cfg: RunConfig, lang, ref_model, ref_params, ref_info: dict, gold_params, log) -> tuple:
    """``(params, info)`` of the Bradley-Terry proxy, cached by everything that determines it."""
    t = cfg.task
    rm_payload = {
        "kind": "reward_model",
        "reference": ref_info.get("payload"),
        "gold": [float(x) for x in gold_params],
        "response_len": cfg.sampling.response_len,
        **{
            k: getattr(t, k)
            for k in ("rm_pairs", "rm_heldout", "rm_epochs", "rm_lr", "rm_label_temp", "prompt_len")
        },
    }
    return cached(
        "rm",
        rm_payload,
        lambda: train_reward_model(cfg, lang, ref_model, ref_params, gold_params, log),
        t.cache_dir,
        log,
    )


def _independent_lm(cfg: RunConfig, lang, max_len: int, log) -> tuple:
    """``(model, params, info)`` of the independent evaluator: other seed, other width, same
    data-generating language (cached)."""
    t = cfg.task
    ind_cfg = dataclasses.replace(cfg.model, d_model=t.indep_d_model, n_heads=max(1, t.indep_d_model // 16))
    ind_model = GPT(ind_cfg, lang.vocab_size, max_len)
    ind_payload = {
        "kind": "independent",
        "language_seed": t.seed,
        "language": fingerprint(lang),
        **model_payload(ind_cfg, lang.vocab_size, max_len),
        **pretraining(t),
    }
    build = lambda: pretrain_on(ind_model, lang, t, max_len, 7000, log)
    ind_params, ind_info = cached("indep", ind_payload, build, t.cache_dir, log)
    return ind_model, ind_params, ind_info


def _proxy_reward(rm: CausalLM, rm_params: Any, rm_info: dict, rm_scale: float) -> JaxReward:
    """The proxy reward, standardised on reference responses: mean 0, std ``rm_scale``."""
    norm = jnp.array([rm_info["rm_ref_mean"], rm_scale / max(rm_info["rm_ref_std"], 1e-6)], jnp.float32)

    def reward_fn(env, ro):
        raw = rm_score(rm, env["rm"], ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        return (raw - env["rm_norm"][0]) * env["rm_norm"][1]

    return JaxReward(reward_fn, {"rm": rm_params, "rm_norm": norm})


def _eval_fn(ind_model: CausalLM) -> Callable:
    """Per example: the gold reward and its terms, the oracle's and the independent LM's
    log-likelihoods (``_``-prefixed: reduced by :func:`_batch_eval_fn`)."""

    def eval_fn(env, ro):
        terms = G.gold_terms(env["lang"], ro.prompt, ro.prompt_mask, ro.response, ro.mask, env["gold"])
        oracle_lp = G.response_log_probs(env["lang"], ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        floor = env["gold"].min_token_logp  # impossible tokens count at the floor, not as -inf
        return {
            "reward/gold": terms.reward,
            "gold/sentiment": terms.sentiment,
            "gold/fluency_penalty": terms.fluency_penalty,
            "_oracle_ll": jnp.sum(jnp.maximum(oracle_lp, floor) * ro.mask, -1),
            # per sequence: the fraction of its tokens at or below the floor (batch metric: the mean
            # over sequences); ``_oracle_n_zero``: its tokens of oracle probability exactly 0
            "eval/oracle_floored_frac": jnp.sum((oracle_lp <= floor) * ro.mask, -1)
            / jnp.maximum(jnp.sum(ro.mask, -1), 1.0),
            "_oracle_n_zero": jnp.sum(jnp.isneginf(oracle_lp) * ro.mask, -1),
            "_indep_ll": lm_response_ll(
                ind_model, env["indep"], ro.prompt, ro.prompt_mask, ro.response, ro.mask
            ),
        }

    return eval_fn


def _batch_eval_fn(env, ro, proxy, ev):
    """Over the batch: the perplexities, distinct-n and the proxy-gold rank correlation."""
    n_tok = jnp.maximum(jnp.sum(ro.mask), 1.0)
    return {
        "reward/proxy": jnp.mean(proxy),
        "eval/oracle_ppl_floored": jnp.exp(-jnp.sum(ev["_oracle_ll"]) / n_tok),
        "eval/oracle_zero_prob_token_frac": jnp.sum(ev["_oracle_n_zero"]) / n_tok,
        "eval/independent_ppl": jnp.exp(-jnp.sum(ev["_indep_ll"]) / n_tok),
        "eval/distinct_1": distinct_n(ro.response, ro.mask, 1),
        "eval/distinct_2": distinct_n(ro.response, ro.mask, 2),
        "reward/proxy_gold_spearman": spearman(proxy, ev["reward/gold"]),
    }


@register_task("testbed")
def make_testbed(cfg: RunConfig, log: Callable[[str], None] | None = None) -> Task:
    """The testbed task of ``cfg`` (module docstring): every model trained or read from the cache.
    The task generates its prompts: a ``data`` field set is an error (before anything is built)."""
    check_unused(cfg.data, "testbed")
    t = cfg.task
    lang = L.make_language(t.seed)
    max_len = max(t.pretrain_len, t.prompt_len + cfg.sampling.response_len)
    ref_params, ref_info = reference_policy(cfg, lang, max_len, log)
    ref_model = GPT(cfg.model, lang.vocab_size, max_len)
    gold_params = _gold(cfg, lang)
    rm_params, rm_info = _proxy_rm(cfg, lang, ref_model, ref_params, ref_info, gold_params, log)
    ind_model, ind_params, ind_info = _independent_lm(cfg, lang, max_len, log)
    rm = GPT(cfg.model, lang.vocab_size, max_len, lm_head=False)
    prompts, pmask = L.prompts(lang, jax.random.key(t.seed + 2000), t.prompt_pool, t.prompt_len)
    info = {
        "reference_loss": ref_info.get("eval_loss"),
        "independent_loss": ind_info.get("eval_loss"),
        "entropy_rate": L.entropy_rate(lang, jax.random.key(t.seed + 3000), 2048, 128),
        "gold_ll_threshold": float(gold_params.ll_threshold),
        **{k: v for k, v in rm_info.items() if k != "payload"},
    }
    info["reference_gap"] = info["reference_loss"] - info["entropy_rate"]
    return Task(
        name="testbed",
        tokenizer=tokenizer(lang),
        prompts=TokenPool(prompts, pmask),
        prompt_len=t.prompt_len,
        reward=_proxy_reward(rm, rm_params, rm_info, t.rm_scale),
        policy=ref_model,
        policy_params=ref_params,
        evaluators=Evaluators(
            _eval_fn(ind_model), _batch_eval_fn, {"lang": lang, "gold": gold_params, "indep": ind_params}
        ),
        info=info,
    )
