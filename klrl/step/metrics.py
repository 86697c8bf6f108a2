"""The flat metrics of one iteration of :mod:`klrl.step.train` (slash names, the KL unit in the name),
from what its stages exchanged (:class:`~klrl.step.parts.Scores`,
:class:`~klrl.step.parts.Advantages`, the update's statistics)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from klrl.algo import kl as kl_lib
from klrl.algo import losses
from klrl.algo.control import KINDS
from klrl.step.parallel import average, gather, total
from klrl.step.parts import Advantages, Scores, TrainState

Array = jax.Array


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
    those ``out`` holds: a skipped iteration logs the beta kept, not the one rejected).

    KL metrics (``k1_t = log pi(y_t) - log pi_ref(y_t)``, ``m`` the response mask, ``B`` sequences
    over all devices, ``L_b = sum_t m_bt``):

    * ``kl/k1_seq_sum = (1/B) sum_b sum_t m_bt k1_bt`` (nats/sequence);
    * ``kl/k1_seq_token_mean = (1/B) sum_b (sum_t m_bt k1_bt) / max(L_b, 1)``: the mean over
      sequences of per-sequence token means (nats/token), the unit a ``token_mean`` controller sees;
    * ``kl/k1_token_mean = (sum_b sum_t m_bt k1_bt) / max(sum_b L_b, 1)``: the global per-token mean
      over every response token on every device (nats/token; differs from the previous on ragged masks);
    * ``kl/beta_x_k1_seq_sum = beta_r * kl/k1_seq_sum``: the size of the reward's KL penalty in k1
      terms (nats/sequence times beta, comparable to ``reward/task``), ``beta_r`` the reward-side beta
      this iteration's rewards were shaped with (before the controller's update);
    * ``kl/reward_<est>_*`` the same two per-sequence reductions of the reward's estimator,
      ``kl/exact_*`` of the exact full-vocabulary KL.

    ``ctrl/target`` is logged only when some run of the program has an adaptive controller
    (``ctx.log_target``); then a ``fixed`` member of a mixed sweep logs NaN (a fixed beta has no target).
    """
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
    k1_seq = seq_mean(kl_lib.seq_sum(k1, mask))
    beta_r = state.ctrl.beta if ctx.drives_reward else state.other_coef
    metrics = {
        "reward/task": seq_mean(sc.task_reward),
        "reward/shaped_mean": seq_mean(jnp.sum(ad.rewards, axis=-1)),
        "kl/k1_seq_sum": k1_seq,
        "kl/k1_seq_token_mean": seq_mean(kl_lib.token_mean(k1, mask)),
        "kl/k1_token_mean": total(jnp.sum(kl_lib.seq_sum(k1, mask))) / jnp.maximum(total(jnp.sum(mask)), 1.0),
        "kl/beta_x_k1_seq_sum": beta_r * k1_seq,
        f"kl/reward_{est}_seq_sum": seq_mean(kl_lib.seq_sum(kl_reward, mask)),
        f"kl/reward_{est}_token_mean": seq_mean(kl_lib.token_mean(kl_reward, mask)),
        f"ctrl/kl_observed_{c_cfg.unit}": kl_seen,
        "ctrl/beta": driven if ctx.drives_reward else other,
        "ctrl/loss_coef": other if ctx.drives_reward else driven,
        "response/length": seq_mean(length),
        "response/eos_frac": seq_mean((length < ctx.r_len).astype(jnp.float32)),
        "value/explained_variance": losses.explained_variance(*gather(explained))
        if ctx.critic
        else jnp.float32(0.0),
        "eval/ref_ppl": jnp.exp(-total(jnp.sum(sc.ref_logp)) / jnp.maximum(total(jnp.sum(mask)), 1.0)),
        **{k: seq_mean(v) for k, v in sc.evals.items() if not k.startswith("_")},
        **stats,
    }
    if exact is not None:  # kl.exact_metric (or a `full` estimator)
        metrics["kl/exact_seq_sum"] = seq_mean(kl_lib.seq_sum(exact, mask))
        metrics["kl/exact_token_mean"] = seq_mean(kl_lib.token_mean(exact, mask))
    if ctx.log_target:
        p = state.ctrl.params
        metrics["ctrl/target"] = jnp.where(p.kind == KINDS.index("fixed"), jnp.nan, p.target)
    batch_eval = ctx.task.batch_eval_fn
    if batch_eval is not None:
        tokens_only = ro._replace(logits=None, value=None, hidden=None)  # batch metrics read tokens only
        metrics.update(batch_eval(env, gather(tokens_only), gather(sc.task_reward), gather(sc.evals)))
    metrics["guard/skipped"] = (~ok).astype(jnp.float32)
    metrics["guard/consecutive_skips"] = out.skipped.astype(jnp.float32)
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
