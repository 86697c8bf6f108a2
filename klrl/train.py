"""``make_train(cfg, task, *, policy=..., ...)``: pure ``init`` and the one compiled PPO-KL iteration.

One call of ``step(state, env) -> (state, metrics)`` does, inside one jitted
``shard_map`` over the ``'data'`` axis:

  prompts -> rollout (KV-cache ``lax.scan``) -> reference and reward scoring
  -> per-token KL shaping -> advantages -> PPO epochs x minibatches (nested
  ``lax.scan``) -> beta controller update -> reference refresh -> guard.

Each stage is a module-level function of a frozen :class:`Context` (what ``make_train`` fixed:
config, models, task, shapes, optimiser, controller); stages exchange NamedTuples
(:class:`~klrl.rollout.Rollout`, :class:`Scores`, :class:`Batch`, :class:`Advantages`), and the
metrics of an iteration are computed by :func:`iteration_metrics`. The models are any
:class:`klrl.models.base.CausalLM` (train.py knows no family): the policy comes with the task or
is passed in, the value trunk and heads are built by :func:`build_models`.

beta lives in ``state.ctrl.beta`` (float32) and is only ever used as an array.

Device invariance: every example's prompt and sampling key come from its *global* index, and
with ``ppo.shuffle=global`` minibatches are drawn from the *global* batch (each device fetches its
slice of every global minibatch from the rows' owners, never the whole batch), so a run on 1 or N
devices does the same maths up to reduction order; ``ppo.shuffle=shard`` draws them within each
device's shard (no rows move). On a mesh with ``fsdp``/``tensor`` axes (:mod:`klrl.parallel`) the
state is sharded by the models' partition rules and XLA partitions the body over those axes.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from klrl import kl as kl_lib
from klrl import losses
from klrl.advantages import ADVANTAGES, AdvantageInputs, whiten
from klrl.config import ConfigError, RunConfig
from klrl.control import ControllerState, from_config
from klrl.models.base import CausalLM, forward
from klrl.models.gpt import entropy, token_logprobs
from klrl.models.heads import ValueHead, detach
from klrl.parallel import DATA, average, mesh_from_config, shard_step, take_rows, total
from klrl.rollout import Rollout, generate, response_slice, sequence, stop_set
from klrl.samples import sample_rows
from klrl.shaping import missing_eos_penalty, sequence_returns, shaped_rewards
from klrl.tasks.base import JaxReward, Task, check_task
from klrl.train_heads import policy_out, policy_terms, score_terms, value_out
from klrl.train_parts import (
    Advantages,
    Batch,
    Context,
    Models,
    Phases,
    Scores,
    Train,
    TrainState,
    all_finite,
    build_models,
    init_state,
    iteration_metrics,
    make_optimizer,
    set_learning_rate,
    state_shardings,
    where,
)

Array = jax.Array

__all__ = [
    "Advantages", "Batch", "Context", "Models", "Phases", "Scores", "Train", "TrainState",
    "build_models", "make_optimizer", "make_train", "set_learning_rate",
]  # fmt: skip


# ---- small pieces -------------------------------------------------------------------------------------


def iteration_keys(state: TrainState) -> tuple[Array, Array, Array]:
    """(prompt, sampling, minibatch-permutation) keys of this iteration."""
    k_prompt, k_sample, k_perm = jax.random.split(jax.random.fold_in(state.rng, state.iteration), 3)
    return k_prompt, k_sample, k_perm


def coefs(ctx: Context, state: TrainState) -> tuple[Array, Array]:
    """(reward-side beta, loss-side coefficient)."""
    if ctx.drives_reward:
        return state.ctrl.beta, state.other_coef
    return state.other_coef, state.ctrl.beta


# ---- the stages ------------------------------------------------------------------------------------


def rollout_phase(ctx: Context, state: TrainState, env: Any) -> Rollout:
    """Prompts and responses for this device's share of the global batch; ``prompt_idx`` holds the
    rows of the prompt pool each example was drawn from (host rewards read their columns by it)."""
    k_prompt, k_sample, _ = iteration_keys(state)
    b_loc, group = ctx.b_loc, ctx.cfg.ppo.group_size
    g_idx = jax.lax.axis_index(DATA) * b_loc + jnp.arange(b_loc)
    n_pool = env["prompts"].shape[0]
    p_idx = jax.vmap(lambda g: jax.random.randint(jax.random.fold_in(k_prompt, g // group), (), 0, n_pool))(
        g_idx
    )
    ex_keys = jax.vmap(jax.random.fold_in, (None, 0))(k_sample, g_idx)
    head = ctx.models.value_head if ctx.head else None
    ro = generate(
        ctx.models.policy, state.params["policy"], env["prompts"][p_idx], env["prompt_mask"][p_idx], ex_keys,
        ctx.cfg.sampling, ctx.stop_ids, ctx.task.pad_id, ctx.keep_logits, value_head=head,
        keep_hidden=ctx.keep_hidden,
    )  # fmt: skip
    return ro._replace(prompt_idx=p_idx.astype(jnp.int32))


def score_phase(ctx: Context, state: TrainState, env: Any, ro: Rollout) -> Scores:
    """Reference log-probs (and logits, or on the chunked path the exact KL from hidden states), old
    values, task reward (less ``reward.missing_eos_penalty`` for a response without a stop token) and
    evaluations."""
    mask = ro.mask
    tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, mask)
    ref_hidden = exact = full = None
    if ctx.chunked:  # no [B, R, V] logits (klrl.chunked)
        ref_h = forward(ctx.models.policy, state.ref_params, tokens, key_mask, logits=False).hidden
        ref_h = response_slice(ref_h, ctx.p_len, ctx.r_len)
        ref_logits, (ref_logp, exact, full) = None, score_terms(ctx, state, ro, ref_h)
        ref_hidden = ref_h if ctx.full_in_loss else None
    else:
        ref = forward(ctx.models.policy, state.ref_params, tokens, key_mask).logits
        ref_logits = response_slice(ref, ctx.p_len, ctx.r_len) / ctx.cfg.sampling.temperature
        ref_logp = token_logprobs(ref_logits, ro.response) * mask
    if ctx.separate:
        old_value = value_out(ctx, state.params["value"], tokens, key_mask) * mask
    elif ctx.head:
        old_value = ro.value
    else:
        old_value = jnp.zeros_like(mask)
    evaluate = ctx.task.eval_fn
    task_reward = ctx.task.reward_fn(env, ro)
    if ctx.cfg.reward.missing_eos_penalty:  # static: off leaves the program as it was
        task_reward = missing_eos_penalty(
            task_reward, ro.response, mask, ctx.stop_ids, ctx.cfg.reward.missing_eos_penalty
        )
    return Scores(
        tokens=tokens,
        key_mask=key_mask,
        ref_logits=ref_logits,
        ref_logp=ref_logp,
        value=old_value,
        task_reward=task_reward,
        evals=evaluate(env, ro) if evaluate is not None else {},
        ref_hidden=ref_hidden,
        exact=exact,
        full_kl=full,
    )


def advantage_phase(ctx: Context, state: TrainState, ro: Rollout, sc: Scores) -> Advantages:
    """KL estimates, shaped rewards, advantages and returns; ``batch`` is this device's share of
    what the update reads."""
    mask, kl_cfg = ro.mask, ctx.cfg.kl
    beta_r, _ = coefs(ctx, state)

    def estimate(name):
        if ctx.chunked and kl_lib.ESTIMATORS.meta(name)["inputs"] == "logits":
            return sc.full_kl  # the exact KL under kl.clamp, from hidden states (score_phase)
        return kl_lib.estimate(name, ro.logp, sc.ref_logp, mask, ro.logits, sc.ref_logits, kl_cfg.clamp)

    kl_reward = estimate(kl_cfg.estimator)
    rewards = shaped_rewards(sc.task_reward, kl_reward, mask, beta_r, kl_cfg.placement)
    seq_ret = sequence_returns(sc.task_reward, kl_reward, mask, beta_r, kl_cfg.placement)
    inputs = AdvantageInputs(rewards, seq_ret, sc.value, mask)
    advantages, returns = ADVANTAGES.get(ctx.cfg.ppo.advantage)(inputs, ctx.cfg.ppo)
    if ctx.cfg.ppo.whiten:
        advantages = whiten(advantages, mask, DATA)
    full_in_loss = ctx.kl_in_loss and kl_lib.ESTIMATORS.meta(kl_cfg.loss_estimator)["inputs"] == "logits"
    batch = Batch(
        tokens=sc.tokens, key_mask=sc.key_mask, response=ro.response, mask=mask, logp=ro.logp,
        ref_logp=sc.ref_logp, adv=advantages, ret=returns, value=sc.value,
        ref_logits=sc.ref_logits if full_in_loss else None, ref_hidden=sc.ref_hidden,
    )  # fmt: skip
    exact = None  # kl.exact_metric off (and no `full` estimator)
    if ctx.exact_kl:
        exact = sc.exact if ctx.chunked else kl_lib.full_kl(ro.logits, sc.ref_logits, mask)
    return Advantages(
        batch=batch,
        rewards=rewards,
        kl_reward=kl_reward,
        kl_ctrl=estimate(ctx.cfg.ctrl.estimator),
        k1=estimate("k1"),
        exact=exact,
    )


def ppo_loss(
    ctx: Context, params: Any, mb: Batch, n_tok: Array, n_seq: Array, beta_l: Array, *, ref_params: Any = None
):
    """PPO loss of one (per-device) minibatch ``mb``, normalised by ``n_tok`` tokens and ``n_seq``
    sequences (this device's share of the global minibatch's), and its statistics. ``ref_params``:
    the reference, read only on the chunked path by a ``full`` loss estimator (its LM head).

    ``loss = sum_t m_t (pg_t - ent_coef H_t) / n_tok + vf_coef sum_t m_t vl_t / n_tok
    + beta_l * KL_term``, ``KL_term = sum_t m_t kl_t / n_tok`` (``token_mean``) or
    ``sum_b token_mean_b(kl) / n_seq`` (``seq_mean``).
    """
    ppo, kl_cfg = ctx.cfg.ppo, ctx.cfg.kl
    if ctx.chunked:  # logit terms from hidden states, chunk by chunk (klrl.chunked)
        logits, (logp, ent_c, value, full_kl) = None, policy_terms(ctx, params["policy"], mb, ref_params)
    else:
        logits, value = policy_out(ctx, params["policy"], mb.tokens, mb.key_mask)
    m = mb.mask
    if not ctx.chunked:
        logp = token_logprobs(logits, mb.response)
    pg, clipped = losses.clipped_surrogate(logp, mb.logp, mb.adv, ppo.clip)
    ent = ent_c if ctx.chunked else entropy(logits)
    # normalise by the per-device share of the global minibatch so that pmean is the global mean
    loss = losses.masked_sum(pg - ppo.ent_coef * ent, m) / n_tok
    stats = {
        "loss/policy": losses.masked_sum(pg, m) / n_tok,
        "policy/clipfrac": losses.masked_sum(clipped, m) / n_tok,
        "policy/approx_kl": losses.masked_sum(losses.approx_kl(logp, mb.logp), m) / n_tok,
        "policy/entropy": losses.masked_sum(ent, m) / n_tok,
    }
    if ctx.critic:
        if ctx.separate:
            value = value_out(ctx, params["value"], mb.tokens, mb.key_mask, ctx.update_value)
        vl, vclip = losses.clipped_value_loss(value, mb.value, mb.ret, ppo.vf_clip)
        loss = loss + ppo.vf_coef * losses.masked_sum(vl, m) / n_tok
        stats["loss/value"] = losses.masked_sum(vl, m) / n_tok
        stats["value/clipfrac"] = losses.masked_sum(vclip, m) / n_tok
    if ctx.kl_in_loss and ctx.chunked and ctx.full_in_loss:
        kl_t = full_kl
    elif ctx.kl_in_loss:
        kl_t = kl_lib.estimate(
            kl_cfg.loss_estimator, logp, mb.ref_logp, m, logits, mb.ref_logits, kl_cfg.clamp
        )
    if ctx.kl_in_loss:
        if kl_cfg.loss_agg == "token_mean":
            kl_term = losses.masked_sum(kl_t, m) / n_tok
        else:
            kl_term = jnp.sum(kl_lib.token_mean(kl_t, m)) / n_seq
        loss = loss + beta_l * kl_term
        stats[f"kl/loss_{kl_cfg.loss_agg}"] = kl_term
    stats["loss/total"] = loss
    return loss, stats


def minibatch_rows(ctx: Context, key: Array, dev: Array) -> Array:
    """Global row indices ``[n_mb, m]`` (``m = mb_glob / n_dev``) of this device's share of every
    minibatch of one epoch. ``ppo.shuffle=global``: ``perm = permutation(key, B)``, minibatch ``j``
    is ``perm[j mb_glob : (j + 1) mb_glob]``, device ``d`` takes its ``d``-th slice (the same maths
    on any device count). ``shard``: device ``d`` permutes its own rows,
    ``d B_loc + permutation(fold_in(key, d), B_loc)``, and takes them ``m`` at a time."""
    n_dev, n_mb, m = ctx.n_dev, ctx.cfg.ppo.minibatches, ctx.mb_glob // ctx.n_dev
    if ctx.cfg.ppo.shuffle == "shard":
        own = jax.random.permutation(jax.random.fold_in(key, dev), ctx.b_loc)
        return dev * ctx.b_loc + own.reshape(n_mb, m)
    return jax.random.permutation(key, ctx.b_glob).reshape(n_mb, n_dev, m)[:, dev]


def update_phase(
    ctx: Context, state: TrainState, batch: Batch, go: Array | None = None
) -> tuple[Any, Any, dict[str, Array]]:
    """PPO epochs x minibatches (nested ``lax.scan``); ``batch`` is this device's share and stays
    sharded: each minibatch's rows are fetched from their owners (:func:`klrl.parallel.take_rows`,
    ``ppo.shuffle=global``) or read locally (``shard``); gradients are averaged over ``data``.

    The in-place half of the non-finite guard: a minibatch's update is applied only while ``go``
    (default True: the rollout and scores were finite) holds and every minibatch so far, this one
    included, had finite loss statistics, gradients and updates; from the first non-finite one on,
    the parameters and optimiser state stay as they are. Skipped updates are a ``where`` on the
    scan's carry, so no copy of the parameters and Adam moments is kept for a rollback (on SmolLM2
    that copy was 2.7 GiB of the step's temporaries). Returns (params, opt_state, mean stats); the stats hold
    ``guard/minibatches_applied`` (the fraction of the iteration's minibatch updates applied)."""
    n_dev, mb_glob = ctx.n_dev, ctx.mb_glob
    k_perm = iteration_keys(state)[2]
    _, beta_l = coefs(ctx, state)
    dev = jax.lax.axis_index(DATA)
    local = ctx.cfg.ppo.shuffle == "shard"
    go = jnp.array(True) if go is None else go
    grad_fn = jax.grad(partial(ppo_loss, ctx, ref_params=state.ref_params), has_aux=True)

    def minibatch_step(carry, idx):
        params, opt_state, fine = carry
        if local:
            mb = jax.tree.map(lambda x: x[idx - dev * ctx.b_loc], batch)
        else:
            mb = take_rows(batch, idx)
        n_tok = total(jnp.sum(mb.mask)) / n_dev
        grads, stats = grad_fn(params, mb, jnp.maximum(n_tok, 1.0), mb_glob / n_dev, beta_l)
        grads, stats = average((grads, stats))
        stats["grad/norm"] = optax.tree.norm(grads)
        updates, new_opt = ctx.optimizer.update(grads, opt_state, params)
        fine = fine & (jax.lax.pmin(all_finite((grads, updates, stats)).astype(jnp.int32), DATA) > 0)
        apply = go & fine
        stats["guard/minibatches_applied"] = apply.astype(jnp.float32)
        params = where(apply, optax.apply_updates(params, updates), params)
        return (params, where(apply, new_opt, opt_state), fine), stats

    def epoch_step(carry, k):
        return jax.lax.scan(minibatch_step, carry, minibatch_rows(ctx, k, dev))

    epoch_keys = jax.random.split(k_perm, ctx.cfg.ppo.epochs)
    init = (state.params, state.opt_state, jnp.array(True))
    (params, opt_state, _), stats = jax.lax.scan(epoch_step, init, epoch_keys)
    return params, opt_state, jax.tree.map(jnp.mean, stats)


def control_phase(
    ctx: Context, state: TrainState, kl_ctrl: Array, mask: Array
) -> tuple[ControllerState, Array]:
    """The controller's update from this iteration's KL (in ``ctrl.unit``, averaged over the
    global batch). Returns (controller state, the KL it saw)."""
    kl_seen = average(jnp.mean(kl_lib.reduce(kl_ctrl, mask, ctx.cfg.ctrl.unit)))
    return ctx.controller.update(state.ctrl, kl_seen, jnp.float32(ctx.b_glob)), kl_seen


def refresh_reference(ctx: Context, state: TrainState, policy: Any) -> Any:
    """Every ``kl.ref_update_every`` iterations, ``ref <- (1 - ref_mix) ref + ref_mix policy`` (mixed
    in float32, stored back in the reference's dtype, ``model.ref_dtype``)."""
    kl_cfg = ctx.cfg.kl
    if kl_cfg.ref_update_every <= 0:
        return state.ref_params
    refresh = (state.iteration + 1) % kl_cfg.ref_update_every == 0
    mix = jnp.where(refresh, kl_cfg.ref_mix, 0.0)
    trunk = detach(policy)[0] if ctx.head else policy
    return jax.tree.map(
        lambda r, p: ((1 - mix) * r.astype(p.dtype) + mix * p).astype(r.dtype), state.ref_params, trunk
    )


def guard(ctx: Context, state: TrainState, new: TrainState, ok: Array) -> TrainState:
    """The non-finite guard's bookkeeping: ``new`` if ``ok``, else the old controller, reference and
    coefficients with one more consecutive skip. The parameters and optimiser state are ``new``'s
    either way: :func:`update_phase` already left them untouched from the first non-finite
    minibatch on (and entirely when the rollout or scores were non-finite or the skip limit was
    reached). Once ``train.max_consecutive_skips`` skips are counted the step is a no-op (the
    iteration counter stops too), so the run loop (which sees the metrics one step late) stops
    after exactly that many."""

    def small(s: TrainState) -> tuple:
        return s.ref_params, s.ctrl, s.other_coef, s.iteration, s.skipped

    kept = (state.ref_params, state.ctrl, state.other_coef, state.iteration + 1, state.skipped + 1)
    out = where(ok, small(new), kept)
    limit = ctx.cfg.train.max_consecutive_skips
    if limit > 0:
        out = where(state.skipped >= limit, small(state), out)
    ref_params, ctrl, other_coef, iteration, skipped = out
    return new._replace(ref_params=ref_params, ctrl=ctrl, other_coef=other_coef, iteration=iteration,
                        skipped=skipped)  # fmt: skip


def step_fn(ctx: Context, state: TrainState, env: Any) -> tuple[TrainState, dict[str, Array]]:
    """One iteration on this device's shard (see the module docstring)."""
    ro = rollout_phase(ctx, state, env)
    sc = score_phase(ctx, state, env, ro)
    ad = advantage_phase(ctx, state, ro, sc)
    ctrl, kl_seen = control_phase(ctx, state, ad.kl_ctrl, ro.mask)
    # the rollout's per-row numbers (not the [B, R, V] logits: a NaN there reaches the loss, which
    # update_phase checks per minibatch)
    ok = all_finite((sc.task_reward, ad.kl_reward, ad.batch.adv, ad.batch.ret, kl_seen))
    ok = jax.lax.pmin(ok.astype(jnp.int32), DATA) > 0
    limit = ctx.cfg.train.max_consecutive_skips
    go = ok & (state.skipped < limit) if limit > 0 else ok
    params, opt_state, stats = update_phase(ctx, state, ad.batch, go)
    ok = ok & (stats["guard/minibatches_applied"] == 1.0)
    ref_params = refresh_reference(ctx, state, params["policy"])
    new = TrainState(params, ref_params, opt_state, ctrl, state.other_coef, state.rng,
                     state.iteration + 1, jnp.zeros((), jnp.int32))  # fmt: skip
    out = guard(ctx, state, new, ok)
    metrics = iteration_metrics(ctx, env, state, out, ok, ro, sc, ad, stats, kl_seen)
    if ctx.samples:  # a few rows' token ids for the host to decode (klrl.samples), not logged
        metrics.update(sample_rows(ctx.samples, ro, sc.task_reward, ad.k1, ad.exact, sc.ref_logp))
    return out, metrics


# ---- the entry point ------------------------------------------------------------------------------


def make_train(
    cfg: RunConfig,
    task: Task,
    mesh: Any = None,
    *,
    policy: CausalLM | None = None,
    policy_params: Any = None,
    value: CausalLM | None = None,
    value_params: Any = None,
    reward: JaxReward | None = None,
    stop_ids: tuple[int, ...] | None = None,
    log_target: bool | None = None,
    samples: int = 0,
) -> Train:
    """Build pure ``init`` and the jitted ``step`` for ``cfg`` on ``task``.

    Any causal LM trains here, whatever its family: ``policy`` (default ``task.policy``) is a
    :class:`klrl.models.base.CausalLM` and ``policy_params`` (default ``task.policy_params``) its
    initial parameters, which are also the frozen KL reference. ``value`` (a trunk without LM head)
    and ``value_params`` (its parameters with a :class:`~klrl.models.heads.ValueHead` attached) set
    the separate value model of ``model.value_model=separate``; by default :func:`build_models`
    builds a fresh klrl GPT of ``cfg.model``. ``reward`` replaces the task's reward (its parameters
    then travel in ``train.context.task.env``, the env to step with). ``stop_ids`` (default: the
    task's tokenizer's) is the set of tokens that end a response. The task's parts are checked
    against the policy first (:func:`klrl.tasks.base.check_task`): a mismatch is a
    :class:`ConfigError` naming the part. ``log_target`` (default: ``cfg.ctrl.kind != 'fixed'``) logs
    ``ctrl/target`` (a sweep sets it when any member is adaptive; fixed members then log NaN).
    ``samples`` (> 0) adds the first that many rows of each iteration's batch to the step's outputs
    as ``_samples/*`` arrays (:func:`klrl.samples.sample_rows`; the run loop decodes and writes them).
    """
    mesh = mesh_from_config(cfg.train) if mesh is None else mesh
    task = task if reward is None else dataclasses.replace(task, reward=reward)
    policy = task.policy if policy is None else policy
    models = build_models(cfg, policy)
    if value is not None:
        if not models.value:
            raise ConfigError("value: a separate value model needs model.value_model=separate and a critic")
        models = Models(policy, value, ValueHead(value.hidden_size))
    n_dev = mesh.shape[DATA]
    check_task(task, policy, cfg.sampling.response_len, cfg.train.batch_size // n_dev)
    ctx = Context(
        cfg=cfg,
        task=task,
        models=models,
        policy_params=task.policy_params if policy_params is None else policy_params,
        value_params=value_params,
        stop_ids=stop_set(task.stop_ids if stop_ids is None else stop_ids),
        controller=from_config(cfg.ctrl),
        optimizer=make_optimizer(cfg),
        n_dev=n_dev,
        log_target=cfg.ctrl.kind != "fixed" if log_target is None else log_target,
        samples=min(int(samples), cfg.train.batch_size),
    )
    one = partial(step_fn, ctx)
    phases = Phases(
        partial(rollout_phase, ctx), partial(score_phase, ctx), partial(advantage_phase, ctx),
        partial(update_phase, ctx), partial(control_phase, ctx),
    )  # fmt: skip
    shardings = state_shardings(ctx, mesh)
    return Train(
        init=partial(init_state, ctx, mesh),
        step=shard_step(one, mesh, state_shardings=shardings),
        shard_step=one,
        loss=partial(ppo_loss, ctx),
        policy=policy,
        value_model=models.value,
        mesh=mesh,
        phases=phases,
        context=ctx,
        state_shardings=shardings,
    )
