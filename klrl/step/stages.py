"""The types the stages of :mod:`klrl.step.train` exchange, and the helpers over them.

Stages pass NamedTuples, not string-keyed dicts: :class:`~klrl.models.rollout.Rollout` (rollout) ->
:class:`Scores` (scoring) -> :class:`Advantages` with its :class:`Batch` (what the update reads)
-> the update's statistics (:mod:`klrl.step.update`); :func:`klrl.step.metrics.iteration_metrics`
turns one iteration into the flat metrics dict. :class:`TrainState` is what a step carries (and a
checkpoint holds), :class:`Train` what ``make_train`` returns. The frozen context every stage reads is
:mod:`klrl.step.context`; the optimiser, :mod:`klrl.step.optim`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from klrl.algo.control import ControllerState

Array = jax.Array


class TrainState(NamedTuple):
    params: Any  # {'policy': ..., 'value': ... or None}: what the optimiser trains (adapters with LoRA)
    ref_params: Any  # the reference policy (a copy of the initial policy); with LoRA the frozen base
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
    ref_logits: Array | None  # [B, R, V] tempered reference logits (model.logits=full), else None
    ref_logp: Array  # [B, R] reference log-probs of the sampled tokens (0 where masked)
    value: Array  # [B, R] old values (zeros without a critic)
    task_reward: Array  # [B] float32
    evals: dict[str, Array]  # per-example evaluations {name: [B]}
    # model.logits=chunked (klrl.step.chunked): no [B, R, V] logits; what is read of them instead
    ref_hidden: Array | None = None  # [B, R, D] reference hidden states (a logits KL in the loss)
    exact: Array | None = None  # [B, R] exact full-vocabulary KL(pi || pi_ref), no clamp
    full_kl: Array | None = None  # [B, R] the same under kl.clamp (what the estimator `full` gives)


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
    ref_hidden: Array | None = None  # [B, R, D] instead of ref_logits on the chunked path


class Advantages(NamedTuple):
    """The advantage stage: the update's batch and the KL terms the metrics and controller read."""

    batch: Batch
    rewards: Array  # [B, R] shaped rewards
    kl_reward: Array  # [B, R] per-token KL of kl.estimator
    kl_ctrl: Array  # [B, R] per-token KL of ctrl.estimator (what the controller sees)
    k1: Array  # [B, R]
    exact: Array | None  # [B, R] exact per-position KL from the full logits (None: kl.exact_metric off)
    reward_moments: Any = None  # ppo.normalize_reward: the running moments with this batch merged in


class Phases(NamedTuple):
    """The stages ``step`` is composed of, as per-shard functions (call them under ``shard_map``
    over ``'data'``, as the step does; ``benchmarks/`` times each one compiled on its own)."""

    rollout: Any  # (state, env) -> Rollout
    score: Any  # (state, env, rollout) -> Scores
    advantages: Any  # (state, rollout, scores) -> Advantages
    update: Any  # (state, batch) -> (params, opt_state, stats): PPO epochs x minibatches
    control: Any  # (state, kl_ctrl, mask) -> (controller state, observed KL)


class Train(NamedTuple):
    init: Any  # (seed | key, beta=None) -> TrainState (a frozen reference: the task's arrays, not a copy)
    place: Any  # host (restored) TrainState -> placed as ``init``'s, a frozen reference adopted likewise
    step: Any  # jitted (state, env) -> (state, metrics): donates the state but a frozen reference
    shard_step: Any  # the per-shard function, for vmap (sweeps) and custom wrapping (donate no init'ed ref)
    loss: Any  # (params, minibatch: Batch, n_tok, n_seq, beta_l) -> (loss, stats): the PPO loss
    policy: Any  # the policy's CausalLM
    value_model: Any  # the separate value trunk, or None
    mesh: Any
    phases: Phases
    context: Any = None  # the frozen klrl.step.train.Context every stage reads
    state_shardings: Any = None  # NamedSharding pytree of the TrainState on ``mesh`` (step's in/out)


def iteration_keys(state: TrainState) -> tuple[Array, Array, Array]:
    """(prompt, sampling, minibatch-permutation) keys of this iteration."""
    k_prompt, k_sample, k_perm = jax.random.split(jax.random.fold_in(state.rng, state.iteration), 3)
    return k_prompt, k_sample, k_perm


# ---- the non-finite guard ----------------------------------------------------------------------------


def where(ok: Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def all_finite(tree: Any) -> Array:
    leaves = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
