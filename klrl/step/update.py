"""The PPO update of :mod:`klrl.step.train`: the loss of one minibatch (:func:`ppo_loss`, what the update
differentiates), the minibatches' rows (:func:`minibatch_rows`) and the epochs x minibatches
(:func:`update_phase`, nested ``lax.scan``) with the in-place half of the non-finite guard.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from klrl.algo import kl as kl_lib
from klrl.algo import losses
from klrl.algo.logprobs import entropy, token_logprobs
from klrl.step import chunked
from klrl.step.heads import policy_out, policy_terms, value_out
from klrl.step.parallel import DATA, average, take_rows, total
from klrl.step.parts import Batch, Context, TrainState, all_finite, coefs, iteration_keys

Array = jax.Array


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
    if ctx.chunked:  # logit terms from hidden states, chunk by chunk (klrl.step.chunked)
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
    if ctx.kl_in_loss and ctx.chunked and ctx.full_in_loss:  # the loss estimator's declared chunked form
        kl_t = chunked.estimator_term(kl_cfg.loss_estimator, {"kl": full_kl})
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
    sharded: each minibatch's rows are fetched from their owners (:func:`klrl.step.parallel.take_rows`,
    ``ppo.shuffle=global``) or read locally (``shard``); gradients are averaged over ``data``.

    The in-place half of the non-finite guard: a minibatch's update is applied only while ``go``
    (default True: the rollout and scores were finite) holds and every minibatch so far, this one
    included, had finite loss statistics and a finite gradient norm (``grad/norm``: non-finite when
    any gradient is, or when the sum of squares overflows); from the first non-finite one on, the
    parameters and optimiser state stay as they are. The optimiser's update of a minibatch is a
    ``lax.cond`` on that decision, so no copy of the parameters and Adam moments is kept for a
    rollback (on SmolLM2 that copy was 2.7 GiB of the step's temporaries) and an applied update is
    one fused pass over parameters, gradients and moments (a ``where`` after the update, as before,
    read and wrote them all once more). From finite gradients Adam's update is finite (``m / (sqrt(v)
    + eps)``; an overflowing ``v`` gives 0), so the updates themselves are not checked. Returns
    (params, opt_state, mean stats); the stats hold ``guard/minibatches_applied`` (the fraction of
    the iteration's minibatch updates applied)."""
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
        stats["grad/norm"] = optax.tree.norm(grads)  # non-finite iff some gradient is (or it overflows)
        fine = fine & (jax.lax.pmin(all_finite(stats).astype(jnp.int32), DATA) > 0)
        apply = go & fine
        stats["guard/minibatches_applied"] = apply.astype(jnp.float32)

        def optimise(p, o):
            updates, new_o = ctx.optimizer.update(grads, o, p)
            return optax.apply_updates(p, updates), new_o

        # a cond, not a where: the update runs in place, in one pass over the parameters and moments
        # (under a sweep's vmap it becomes a select, as a where would)
        params, opt_state = jax.lax.cond(apply, optimise, lambda p, o: (p, o), params, opt_state)
        return (params, opt_state, fine), stats

    def epoch_step(carry, k):
        return jax.lax.scan(minibatch_step, carry, minibatch_rows(ctx, k, dev))

    epoch_keys = jax.random.split(k_perm, ctx.cfg.ppo.epochs)
    init = (state.params, state.opt_state, jnp.array(True))
    (params, opt_state, _), stats = jax.lax.scan(epoch_step, init, epoch_keys)
    return params, opt_state, jax.tree.map(jnp.mean, stats)
