"""The held-out evaluation: the task's held-out prompts (``data.eval_path`` or ``data.eval_fraction``)
answered by the policy at temperature 0, scored, every ``data.eval_every`` iterations.

:func:`make_heldout_eval` builds ``evaluate(state, env) -> {name: scalar}`` (jitted; a sweep's
version maps over the stacked members), called by the run loop on the state *before* an iteration's
update, i.e. the state after ``i`` updates for row ``i`` (as every other metric of row ``i``).

Decoding is greedy: ``top_k = 1`` at temperature 1 (the argmax of the logits; the limit of
temperature -> 0). Every held-out prompt is answered once per evaluation (one batch). Metrics (the
means over the held-out prompts, ``m`` the response mask):

* ``eval/heldout/reward``: the task reward (the held-out rows' host reward functions or the reward
  model, after ``reward.missing_eos_penalty``);
* ``eval/heldout/kl_k1_seq_sum``: ``sum_t m_t (log pi(y_t) - log pi_ref(y_t))``, nats/sequence
  (both at temperature 1);
* ``eval/heldout/ref_ppl``: ``exp(-sum m log pi_ref / sum m)``, the reference's perplexity of the
  greedy answers;
* ``eval/heldout/length``, ``eval/heldout/distinct_1``, ``eval/heldout/distinct_2``,
  ``eval/heldout/rep_4`` (:mod:`klrl.algo.textmetrics`; ``rep_4`` when ``sampling.response_len >= 4``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from klrl.algo import kl as kl_lib
from klrl.algo.logprobs import token_logprobs
from klrl.algo.shaping import missing_eos_penalty
from klrl.algo.textmetrics import distinct_n, rep_n
from klrl.models.base import forward
from klrl.models.rollout import generate, response_slice, sequence
from klrl.step.context import full_params

PREFIX = "eval/heldout/"


def heldout_metrics(train: Any, state: Any, env: Any) -> dict[str, jax.Array]:
    """The held-out metrics of one (unstacked) ``state`` (module docstring)."""
    ctx = train.context
    task, cfg = ctx.task, ctx.cfg
    prompts, pmask = env["heldout_prompts"], env["heldout_prompt_mask"]
    n, p, r = prompts.shape[0], prompts.shape[1], cfg.sampling.response_len
    greedy = dataclasses.replace(cfg.sampling, temperature=1.0, top_k=1)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(n))
    head = ctx.models.value_head if ctx.head else None
    policy = full_params(ctx, state.params, state.ref_params)["policy"]
    ro = generate(ctx.models.policy, policy, prompts, pmask, keys, greedy, ctx.stop_ids,
                  task.pad_id, False, value_head=head)  # fmt: skip
    ro = ro._replace(prompt_idx=jnp.arange(n, dtype=jnp.int32))
    m = ro.mask
    tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, m)
    ref_out = forward(ctx.ref_model, state.ref_params, tokens, key_mask)
    if ctx.reward_on_reference and task.heldout.reward is task.reward:  # as the train step reads it
        reward = task.reward.from_hidden(env, ro, ref_out.hidden)
    else:
        reward = task.heldout.reward.fn(env, ro)
    if cfg.reward.missing_eos_penalty:
        reward = missing_eos_penalty(reward, ro.response, m, ctx.stop_ids, cfg.reward.missing_eos_penalty)
    ref = response_slice(ref_out.logits, p, r)
    ref_logp = token_logprobs(ref, ro.response) * m
    out = {
        "reward": jnp.mean(reward),
        "kl_k1_seq_sum": jnp.mean(kl_lib.seq_sum(ro.logp - ref_logp, m)),
        "ref_ppl": jnp.exp(-jnp.sum(ref_logp) / jnp.maximum(jnp.sum(m), 1.0)),
        "length": jnp.mean(jnp.sum(m, axis=-1)),
        "distinct_1": distinct_n(ro.response, m, 1),
    }
    if r >= 2:
        out["distinct_2"] = distinct_n(ro.response, m, 2)
    if r >= 4:
        out["rep_4"] = rep_n(ro.response, m, 4)
    return {PREFIX + k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def make_heldout_eval(train: Any, stacked: bool = False) -> Any:
    """``evaluate(state, env)`` for ``train`` (a :class:`klrl.step.train.Train`) or None when its task has
    no held-out prompts or ``data.eval_every`` is 0; ``stacked``: over a sweep's stacked members."""
    ctx = train.context
    if ctx.task.heldout is None or ctx.cfg.data.eval_every <= 0:
        return None

    def one(state, env):
        return heldout_metrics(train, state, env)

    if not stacked:
        return jax.jit(one)
    if not ctx.ref_frozen:
        return jax.jit(jax.vmap(one, in_axes=(0, None)))
    # a sweep's frozen reference is one copy for all members (klrl.step.context.state_shardings)
    member = lambda rest, ref, env: one(rest._replace(ref_params=ref), env)
    mapped = jax.vmap(member, in_axes=(0, None, None))
    return jax.jit(lambda state, env: mapped(state._replace(ref_params=None), state.ref_params, env))
