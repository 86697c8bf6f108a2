"""The PPO update of :mod:`klrl.step.train`: the loss of one minibatch (:func:`ppo_loss`, what the update
differentiates), the minibatches' rows (:func:`minibatch_rows`), a minibatch's gradient, accumulated
over ``ppo.grad_accum`` micro-batches (:func:`minibatch_gradients`) and the epochs x minibatches
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
from klrl.step.context import Context, coefs, full_params
from klrl.step.heads import policy_out, policy_terms, value_out
from klrl.step.optim import is_critic
from klrl.step.parallel import DATA, average, take_rows, total
from klrl.step.stages import Batch, TrainState, all_finite, iteration_keys

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
    params = full_params(ctx, params, ref_params)  # LoRA: adapters on the frozen base; gradients reach them
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


def policy_critic_norms(grads: Any) -> tuple[Array, Array]:
    """``(||g_policy||, ||g_critic||)``: the global norms of the policy's and the critic's gradients
    (:func:`klrl.step.optim.is_critic`; the critic's is 0 without one), before any clip. Logged as
    ``grad/policy_norm`` and ``grad/critic_norm``; ``grad/norm`` is ``sqrt`` of their squares' sum."""
    sq = [jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)]
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        sq[is_critic(path)] += jnp.sum(jnp.square(g.astype(jnp.float32)))
    return jnp.sqrt(sq[0]), jnp.sqrt(sq[1])


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


def minibatch_gradients(
    ctx: Context, grad_fn: Any, params: Any, fetch: Any, fetch_mask: Any, idx: Array, beta_l: Array
) -> tuple[Any, dict[str, Array]]:
    """This device's gradient and statistics of the minibatch whose rows it holds are ``idx [m]``
    (``fetch(i)``: the :class:`Batch` of rows ``i``, ``fetch_mask(i)``: their response mask), before
    the average over ``data``.

    With ``ppo.grad_accum = k > 1`` the rows are taken ``m / k`` at a time (``lax.scan`` over ``k``
    micro-batches: the activations of one micro-batch live at a time) and the gradients and statistics
    summed. Each micro-batch's loss is normalised by the *whole* minibatch's token count ``n_tok`` (and
    sequence count), so the sum is the minibatch's loss ``sum over all its tokens / n_tok``: the same
    gradient, update and statistics as one minibatch of ``m`` rows up to float rounding (an average of
    per-micro-batch token means would weight a micro-batch's tokens by its own count instead). ``k = 1``:
    the one pass as before, bit for bit."""
    k, n_dev, n_seq = ctx.cfg.ppo.grad_accum, ctx.n_dev, ctx.mb_glob / ctx.n_dev
    if k == 1:
        mb = fetch(idx)
        n_tok = total(jnp.sum(mb.mask)) / n_dev
        return grad_fn(params, mb, jnp.maximum(n_tok, 1.0), n_seq, beta_l)
    n_tok = jnp.maximum(total(jnp.sum(fetch_mask(idx))) / n_dev, 1.0)  # the whole minibatch's tokens

    def micro(acc, micro_idx):
        grads, stats = grad_fn(params, fetch(micro_idx), n_tok, n_seq, beta_l)
        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), stats

    # the sum in float32 at least (a bfloat16 parameter's gradient summed in float32, then cast back)
    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    acc, stats = jax.lax.scan(micro, acc, idx.reshape(k, -1))
    grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
    return grads, jax.tree.map(lambda x: jnp.sum(x, axis=0), stats)


def update_phase(
    ctx: Context, state: TrainState, batch: Batch, go: Array | None = None
) -> tuple[Any, Any, dict[str, Array]]:
    """PPO epochs x minibatches (nested ``lax.scan``); ``batch`` is this device's share and stays
    sharded: each minibatch's rows are fetched from their owners (:func:`klrl.step.parallel.take_rows`,
    ``ppo.shuffle=global``) or read locally (``shard``), ``ppo.grad_accum`` micro-batches at a time
    (:func:`minibatch_gradients`); gradients are averaged over ``data``, one optimiser update a minibatch.

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
    k_perm = iteration_keys(state)[2]
    _, beta_l = coefs(ctx, state)
    dev = jax.lax.axis_index(DATA)
    local = ctx.cfg.ppo.shuffle == "shard"
    go = jnp.array(True) if go is None else go
    grad_fn = jax.grad(partial(ppo_loss, ctx, ref_params=state.ref_params), has_aux=True)

    def rows(tree, idx):  # this device's rows ``idx`` (global indices) of ``tree``
        return jax.tree.map(lambda x: x[idx - dev * ctx.b_loc], tree) if local else take_rows(tree, idx)

    def minibatch_step(carry, idx):
        params, opt_state, fine = carry
        grads, stats = minibatch_gradients(
            ctx, grad_fn, params, lambda i: rows(batch, i), lambda i: rows(batch.mask, i), idx, beta_l
        )
        grads, stats = average((grads, stats))
        stats["grad/norm"] = optax.tree.norm(grads)  # non-finite iff some gradient is (or it overflows)
        stats["grad/policy_norm"], stats["grad/critic_norm"] = policy_critic_norms(grads)
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
