"""The flat metrics of one iteration of :mod:`klrl.step.train` (slash names, the KL unit in the name),
from what its stages exchanged (:class:`~klrl.step.stages.Scores`,
:class:`~klrl.step.stages.Advantages`, the update's statistics)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from klrl.algo import kl as kl_lib
from klrl.algo import losses
from klrl.algo.control import branch, kinds
from klrl.registry import is_adaptive
from klrl.rewards import running
from klrl.step.parallel import average, gather, total
from klrl.step.stages import Advantages, Scores, TrainState

Array = jax.Array


def _seq_mean(x: Array) -> Array:
    """The global mean over the batch (all devices) of per-sequence values."""
    return average(jnp.mean(x))


def _kl_metrics(ctx: Any, state: TrainState, ad: Advantages, mask: Array, k1_seq: Array) -> dict[str, Array]:
    """The KL metrics (``k1_t = log pi(y_t) - log pi_ref(y_t)``, ``m`` the response mask, ``B``
    sequences over all devices, ``L_b = sum_t m_bt``; ``k1_seq`` is ``kl/k1_seq_sum``):

    * ``kl/k1_seq_sum = (1/B) sum_b sum_t m_bt k1_bt`` (nats/sequence);
    * ``kl/k1_seq_token_mean = (1/B) sum_b (sum_t m_bt k1_bt) / max(L_b, 1)``: the mean over
      sequences of per-sequence token means (nats/token), the unit a ``token_mean`` controller sees;
    * ``kl/k1_token_mean = (sum_b sum_t m_bt k1_bt) / max(sum_b L_b, 1)``: the global per-token mean
      over every response token on every device (nats/token; differs from the previous on ragged masks);
    * ``kl/beta_x_k1_seq_sum = beta_r * kl/k1_seq_sum``: the size of the reward's KL penalty in k1
      terms (nats/sequence times beta, comparable to ``reward/task``), ``beta_r`` the reward-side beta
      this iteration's rewards were shaped with (before the controller's update);
    * ``kl/reward_<est>_*`` the same two per-sequence reductions of the reward's estimator.
    """
    k1, kl_reward, est = ad.k1, ad.kl_reward, ctx.cfg.kl.estimator
    beta_r = state.ctrl.beta if ctx.drives_reward else state.other_coef
    return {
        "kl/k1_seq_sum": k1_seq,
        "kl/k1_seq_token_mean": _seq_mean(kl_lib.token_mean(k1, mask)),
        "kl/k1_token_mean": total(jnp.sum(kl_lib.seq_sum(k1, mask))) / jnp.maximum(total(jnp.sum(mask)), 1.0),
        "kl/beta_x_k1_seq_sum": beta_r * k1_seq,
        f"kl/reward_{est}_seq_sum": _seq_mean(kl_lib.seq_sum(kl_reward, mask)),
        f"kl/reward_{est}_token_mean": _seq_mean(kl_lib.token_mean(kl_reward, mask)),
    }


def _ctrl_metrics(ctx: Any, out: TrainState, kl_seen: Array) -> dict[str, Array]:
    """The KL the controller observed (in its unit) and the coefficients ``out`` holds."""
    driven, other = out.ctrl.beta, out.other_coef
    return {
        f"ctrl/kl_observed_{ctx.cfg.ctrl.unit}": kl_seen,
        "ctrl/beta": driven if ctx.drives_reward else other,
        "ctrl/loss_coef": other if ctx.drives_reward else driven,
    }


def _batch_metrics(ctx: Any, ad: Advantages, sc: Scores, mask: Array, length: Array) -> dict[str, Array]:
    """Response length and stop fraction, the critic's explained variance (on the gathered batch),
    the reference's perplexity of the samples and the per-example evaluators' means."""
    explained = (ad.batch.value, ad.batch.ret, mask)  # gathered for the metric
    return {
        "response/length": _seq_mean(length),
        "response/eos_frac": _seq_mean((length < ctx.r_len).astype(jnp.float32)),
        "value/explained_variance": losses.explained_variance(*gather(explained))
        if ctx.critic
        else jnp.float32(0.0),
        "eval/ref_ppl": jnp.exp(-total(jnp.sum(sc.ref_logp)) / jnp.maximum(total(jnp.sum(mask)), 1.0)),
        **{k: _seq_mean(v) for k, v in sc.evals.items() if not k.startswith("_")},
    }


def _optional_metrics(
    ctx: Any, env: Any, state: TrainState, out: TrainState, ro: Any, sc: Scores, ad: Advantages
) -> dict:
    """``kl/exact_*`` (with ``kl.exact_metric`` or a ``full`` estimator), ``ctrl/target`` (when some
    run of the program has an adaptive controller, ``ctx.log_target``; a ``fixed`` member of a mixed
    sweep logs NaN: a fixed beta has no target), ``reward/running_mean`` and ``reward/running_std``
    (``ppo.normalize_reward``: the moments ``out`` holds) and the task's batch evaluators."""
    metrics = {}
    if ad.exact is not None:
        metrics["kl/exact_seq_sum"] = _seq_mean(kl_lib.seq_sum(ad.exact, ro.mask))
        metrics["kl/exact_token_mean"] = _seq_mean(kl_lib.token_mean(ad.exact, ro.mask))
    if ctx.log_target:
        p = state.ctrl.params
        static = jnp.asarray([not is_adaptive(k) for k in kinds()])  # by branch (klrl.algo.control)
        metrics["ctrl/target"] = jnp.where(static[branch(p.kind)], jnp.nan, p.target)
    if ctx.cfg.ppo.normalize_reward:  # the task reward's running moments after this iteration
        moments = running.read(out.opt_state)
        metrics["reward/running_mean"] = moments.mean
        metrics["reward/running_std"] = jnp.sqrt(moments.var)
    batch_eval = ctx.task.batch_eval_fn
    if batch_eval is not None:
        tokens_only = ro._replace(logits=None, value=None, hidden=None)  # batch metrics read tokens only
        metrics.update(batch_eval(env, gather(tokens_only), gather(sc.task_reward), gather(sc.evals)))
    return metrics


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
    """The flat metrics of one iteration (global means over the batch), float32. ``state`` is the
    state the iteration started from, ``out`` the one it leaves after the guard (the coefficients
    logged are those ``out`` holds: a skipped iteration logs the beta kept, not the one rejected).
    The KL metrics: :func:`_kl_metrics`; ``kl/exact_*``, ``ctrl/target`` and the task's batch
    evaluators: :func:`_optional_metrics`; ``guard/*``: whether this iteration was applied and the
    consecutive skips so far."""
    mask = ro.mask
    length = jnp.sum(mask, axis=-1)
    k1_seq = _seq_mean(kl_lib.seq_sum(ad.k1, mask))
    metrics = {
        "reward/task": _seq_mean(sc.task_reward),
        "reward/shaped_mean": _seq_mean(jnp.sum(ad.rewards, axis=-1)),
        **_kl_metrics(ctx, state, ad, mask, k1_seq),
        **_ctrl_metrics(ctx, out, kl_seen),
        **_batch_metrics(ctx, ad, sc, mask, length),
        **stats,
    }
    metrics.update(_optional_metrics(ctx, env, state, out, ro, sc, ad))
    metrics["guard/skipped"] = (~ok).astype(jnp.float32)
    metrics["guard/consecutive_skips"] = out.skipped.astype(jnp.float32)
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
