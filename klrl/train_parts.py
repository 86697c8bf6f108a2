"""The types the stages of :mod:`klrl.train` exchange, the optimiser, and the iteration's metrics.

Stages pass NamedTuples, not string-keyed dicts: :class:`~klrl.rollout.Rollout` (rollout) ->
:class:`Scores` (scoring) -> :class:`Advantages` with its :class:`Batch` (what the update reads)
-> the update's statistics. :func:`iteration_metrics` turns one iteration into the flat metrics
dict (slash names, KL unit in the name).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from klrl import kl as kl_lib
from klrl import losses
from klrl.config import RunConfig
from klrl.control import ControllerState
from klrl.parallel import average, gather, total

Array = jax.Array


class TrainState(NamedTuple):
    params: Any  # {'policy': ..., 'value': ... or None}: what the optimiser trains
    ref_params: Any  # frozen reference policy (a copy of the initial policy)
    opt_state: Any
    ctrl: ControllerState  # beta and the controller's own state
    other_coef: Array  # float32: the KL coefficient the controller does not drive
    rng: Array  # base PRNG key of the run; iteration keys are fold_in(rng, iteration)
    iteration: Array  # int32
    skipped: Array  # int32: consecutive iterations skipped by the non-finite guard


class Scores(NamedTuple):
    """The scoring stage: reference and old values over the sampled sequences, task reward, evals."""

    tokens: Array  # [B, P + R] prompt + response
    key_mask: Array  # [B, P + R]
    ref_logits: Array  # [B, R, V] tempered reference logits
    ref_logp: Array  # [B, R] reference log-probs of the sampled tokens (0 where masked)
    value: Array  # [B, R] old values (zeros without a critic)
    task_reward: Array  # [B] float32
    evals: dict[str, Array]  # per-example evaluations {name: [B]}


class Batch(NamedTuple):
    """What the PPO update reads, per sequence (minibatches are row slices of it)."""

    tokens: Array
    key_mask: Array
    response: Array  # [B, R]
    mask: Array  # [B, R]
    logp: Array  # [B, R] behaviour log-probs
    ref_logp: Array  # [B, R]
    adv: Array  # [B, R]
    ret: Array  # [B, R] value targets
    value: Array  # [B, R] old values
    ref_logits: Array | None  # [B, R, V] only for a logits-based KL estimator in the loss


class Advantages(NamedTuple):
    """The advantage stage: the update's batch and the KL terms the metrics and controller read."""

    batch: Batch
    rewards: Array  # [B, R] shaped rewards
    kl_reward: Array  # [B, R] per-token KL of kl.estimator
    kl_ctrl: Array  # [B, R] per-token KL of ctrl.estimator (what the controller sees)
    k1: Array  # [B, R]
    exact: Array  # [B, R] exact per-position KL from the full logits


class Phases(NamedTuple):
    """The stages ``step`` is composed of, as per-shard functions (call them under ``shard_map``
    over ``'data'``, as the step does; ``benchmarks/`` times each one compiled on its own)."""

    rollout: Any  # (state, env) -> Rollout
    score: Any  # (state, env, rollout) -> Scores
    advantages: Any  # (state, rollout, scores) -> Advantages
    update: Any  # (state, batch) -> (params, opt_state, stats): PPO epochs x minibatches
    control: Any  # (state, kl_ctrl, mask) -> (controller state, observed KL)


class Train(NamedTuple):
    init: Any  # (seed | key, beta=None) -> TrainState
    step: Any  # jitted (state, env) -> (state, metrics)
    shard_step: Any  # the per-shard function, for vmap (sweeps) and custom wrapping
    loss: Any  # (params, minibatch: Batch, n_tok, n_seq, beta_l) -> (loss, stats): the PPO loss
    policy: Any  # the policy's CausalLM
    value_model: Any  # the separate value trunk, or None
    mesh: Any
    phases: Phases
    context: Any = None  # the frozen klrl.train.Context every stage reads


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """Adam(W) with global-norm clipping and a schedule; the peak learning rate is an
    injected hyper-parameter (``opt_state[-1].hyperparams['step_size']`` = -lr) so a
    sweep can give each member its own."""
    o = cfg.optim
    total_steps = cfg.train.iterations * cfg.ppo.epochs * cfg.ppo.minibatches
    decay = max(total_steps - o.warmup_steps, 1)
    if o.schedule == "constant":
        shape = optax.constant_schedule(1.0)
    elif o.schedule == "linear":
        shape = optax.linear_schedule(1.0, 0.0, decay)
    else:
        shape = optax.cosine_decay_schedule(1.0, decay)
    if o.warmup_steps:
        shape = optax.join_schedules(
            [optax.linear_schedule(0.0, 1.0, o.warmup_steps), shape], [o.warmup_steps]
        )
    parts = [optax.clip_by_global_norm(o.max_grad_norm)] if o.max_grad_norm > 0 else []
    parts += [optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)]
    if o.weight_decay > 0:
        parts += [optax.add_decayed_weights(o.weight_decay)]
    parts += [optax.scale_by_schedule(shape), optax.inject_hyperparams(optax.scale)(step_size=-o.lr)]
    return optax.chain(*parts)


def set_learning_rate(opt_state: Any, lr: Array | float) -> Any:
    """Return ``opt_state`` with the peak learning rate replaced (see :func:`make_optimizer`)."""
    last = opt_state[-1]
    hp = dict(last.hyperparams, step_size=-jnp.asarray(lr, jnp.float32))
    return (*opt_state[:-1], last._replace(hyperparams=hp))


def where(ok: Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def all_finite(tree: Any) -> Array:
    leaves = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def iteration_metrics(
    ctx: Any,
    env: Any,
    state: TrainState,
    out: TrainState,
    ok: Array,
    ro: Any,
    sc: Scores,
    ad: Advantages,
    stats: dict[str, Array],
    kl_seen: Array,
) -> dict[str, Array]:
    """The flat metrics of one iteration (global means over the batch). ``state`` is the state the
    iteration started from, ``out`` the one it leaves after the guard (the coefficients logged are
    those ``out`` holds: a skipped iteration logs the beta kept, not the one rejected)."""
    cfg = ctx.cfg
    kl_cfg, c_cfg = cfg.kl, cfg.ctrl
    mask = ro.mask

    def seq_mean(x):
        return average(jnp.mean(x))

    length = jnp.sum(mask, axis=-1)
    k1, kl_reward, exact = ad.k1, ad.kl_reward, ad.exact
    driven, other = out.ctrl.beta, out.other_coef
    explained = (ad.batch.value, ad.batch.ret, mask)  # gathered for the metric
    est = kl_cfg.estimator
    metrics = {
        "reward/task": seq_mean(sc.task_reward),
        "reward/shaped_mean": seq_mean(jnp.sum(ad.rewards, axis=-1)),
        "kl/seq_sum": seq_mean(kl_lib.seq_sum(k1, mask)),
        "kl/token_mean": seq_mean(kl_lib.token_mean(k1, mask)),
        f"kl/reward_{est}_seq_sum": seq_mean(kl_lib.seq_sum(kl_reward, mask)),
        f"kl/reward_{est}_token_mean": seq_mean(kl_lib.token_mean(kl_reward, mask)),
        "kl/exact_seq_sum": seq_mean(kl_lib.seq_sum(exact, mask)),
        "kl/exact_token_mean": seq_mean(kl_lib.token_mean(exact, mask)),
        f"ctrl/kl_observed_{c_cfg.unit}": kl_seen,
        "ctrl/beta": driven if ctx.drives_reward else other,
        "ctrl/loss_coef": other if ctx.drives_reward else driven,
        "ctrl/target": state.ctrl.params.target,
        "response/length": seq_mean(length),
        "response/eos_frac": seq_mean((length < ctx.r_len).astype(jnp.float32)),
        "value/explained_variance": losses.explained_variance(*gather(explained))
        if ctx.critic
        else jnp.float32(0.0),
        "eval/ref_ppl": jnp.exp(-total(jnp.sum(sc.ref_logp)) / jnp.maximum(total(jnp.sum(mask)), 1.0)),
        **{k: seq_mean(v) for k, v in sc.evals.items() if not k.startswith("_")},
        **stats,
    }
    batch_eval = ctx.task.batch_eval_fn
    if batch_eval is not None:
        tokens_only = ro._replace(logits=None, value=None)  # batch metrics read tokens, not [B, R, V] logits
        metrics.update(batch_eval(env, gather(tokens_only), gather(sc.task_reward), gather(sc.evals)))
    metrics["guard/skipped"] = (~ok).astype(jnp.float32)
    metrics["guard/consecutive_skips"] = out.skipped.astype(jnp.float32)
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
