"""``make_train(cfg, task, *, policy=..., ...)``: pure ``init`` and the one compiled PPO-KL iteration.

One call of ``step(state, env) -> (state, metrics)`` does, inside one jitted
``shard_map`` over the ``'data'`` axis:

  prompts -> rollout (KV-cache ``lax.scan``) -> reference and reward scoring
  -> per-token KL shaping -> advantages -> PPO epochs x minibatches (nested
  ``lax.scan``) -> beta controller update -> reference refresh -> guard.

Each stage is a module-level function of a frozen :class:`Context` (what ``make_train`` fixed:
config, models, task, shapes, optimiser, controller); stages exchange NamedTuples
(:class:`~klrl.models.rollout.Rollout`, :class:`Scores`, :class:`Batch`, :class:`Advantages`), and the
metrics of an iteration are computed by :func:`klrl.step.metrics.iteration_metrics`; the PPO loss
and update live in :mod:`klrl.step.update`. The models are any
:class:`klrl.models.base.CausalLM` (train.py knows no family): the policy comes with the task or
is passed in, the value trunk and heads are built by :func:`build_models`.

beta lives in ``state.ctrl.beta`` (float32) and is only ever used as an array.

Device invariance: every example's prompt and sampling key come from its *global* index, and
with ``ppo.shuffle=global`` minibatches are drawn from the *global* batch (each device fetches its
slice of every global minibatch from the rows' owners, never the whole batch), so a run on 1 or N
devices does the same maths up to reduction order; ``ppo.shuffle=shard`` draws them within each
device's shard (no rows move). On a mesh with ``fsdp``/``tensor`` axes (:mod:`klrl.step.parallel`) the
state is sharded by the models' partition rules and XLA partitions the body over those axes.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from klrl import distributed
from klrl.algo import kl as kl_lib
from klrl.algo.advantages import ADVANTAGES, AdvantageInputs, whiten
from klrl.algo.control import ControllerState, from_config
from klrl.algo.logprobs import token_logprobs
from klrl.algo.shaping import missing_eos_penalty, sequence_returns, shaped_rewards
from klrl.config import ConfigError, RunConfig
from klrl.models import lora as lora_lib
from klrl.models import peft, quant
from klrl.models.base import CausalLM, forward
from klrl.models.heads import ValueHead, attach, detach
from klrl.models.hf import CheckpointFormatError
from klrl.models.rollout import Rollout, generate, response_slice, sequence, stop_set
from klrl.registry import is_adaptive
from klrl.rewards import running
from klrl.step import chunked
from klrl.step.context import (
    Context,
    Models,
    as_ref_dtype,
    build_models,
    coefs,
    full_params,
    init_state,
    state_shardings,
)
from klrl.step.heads import score_terms, value_out
from klrl.step.metrics import iteration_metrics
from klrl.step.optim import make_optimizer, set_learning_rate
from klrl.step.parallel import DATA, average, mesh_from_config, shard_step
from klrl.step.samples import sample_rows
from klrl.step.stages import (
    Advantages,
    Batch,
    Phases,
    Scores,
    Train,
    TrainState,
    all_finite,
    iteration_keys,
    where,
)
from klrl.step.update import ppo_loss, update_phase
from klrl.tasks.base import JaxReward, Task

Array = jax.Array

__all__ = [
    "Advantages", "Batch", "Context", "Models", "Phases", "Scores", "Train", "TrainState",
    "build_models", "make_optimizer", "make_train", "ppo_loss", "set_learning_rate", "update_phase",
]  # fmt: skip


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
    model, policy = rollout_policy(ctx, state)
    ro = generate(
        model, policy, env["prompts"][p_idx], env["prompt_mask"][p_idx], ex_keys,
        ctx.cfg.sampling, ctx.stop_ids, ctx.task.pad_id, ctx.keep_logits, value_head=head,
        keep_hidden=ctx.keep_hidden,
    )  # fmt: skip
    return ro._replace(prompt_idx=p_idx.astype(jnp.int32))


def merges_for_rollout(ctx: Context, state: TrainState) -> bool:
    """Whether the rollout samples from the adapters folded into the base (:func:`rollout_policy`): a
    LoRA policy on a float32, unquantised base, outside a sweep's ``vmap`` (there each member would hold
    a merged copy of the base; the members share one base otherwise)."""
    if not ctx.lora or ctx.models.policy.quant != "none" or ctx.ref_dtype != jnp.float32:
        return False
    return ctx.fold_rollout  # (make_train's ``fold_rollout``: False for a sweep's program)


def rollout_policy(ctx: Context, state: TrainState) -> tuple[Any, Any]:
    """``(model, params)`` the rollout samples with: the policy with its adapters on the frozen base, or
    (:func:`merges_for_rollout`) the base model with ``W + (alpha / r) A B`` folded into every adapted
    kernel once per iteration (:func:`klrl.models.lora.merged_kernels`, float32), the same policy up to
    float32 rounding. Decoding runs a single token per step, where each adapter's two skinny matmuls and
    add cost about as much as the base's matmul of the same layer reads; merged, a decode step is the
    base's (on SmolLM2 16 x (32 + 32), interleaved: rollout 1.13x -> 1.0x the base's; the merged copy
    is 0.4 GiB of temporaries)."""
    if not merges_for_rollout(ctx, state):
        return ctx.models.policy, full_params(ctx, state.params, state.ref_params)["policy"]
    adapters, head = detach(state.params["policy"]) if ctx.head else (state.params["policy"], None)
    merged = lora_lib.merged_kernels(state.ref_params, adapters, ctx.models.policy.scale)
    return ctx.models.policy.base, merged if head is None else attach(merged, head)


def score_phase(ctx: Context, state: TrainState, env: Any, ro: Rollout) -> Scores:
    """Reference log-probs (and logits, or on the chunked path the exact KL from hidden states), old
    values, task reward (less ``reward.missing_eos_penalty`` for a response without a stop token) and
    evaluations."""
    mask = ro.mask
    tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, mask)
    ref_hidden = exact = full = None
    if ctx.chunked:  # no [B, R, V] logits (klrl.step.chunked)
        ref_out = forward(ctx.ref_model, state.ref_params, tokens, key_mask, logits=False)
        ref_h = response_slice(ref_out.hidden, ctx.p_len, ctx.r_len)
        ref_logits, (ref_logp, exact, full) = None, score_terms(ctx, state, ro, ref_h)
        ref_hidden = ref_h if ctx.full_in_loss else None
    else:
        ref_out = forward(ctx.ref_model, state.ref_params, tokens, key_mask)
        ref_logits = response_slice(ref_out.logits, ctx.p_len, ctx.r_len) / ctx.cfg.sampling.temperature
        ref_logp = token_logprobs(ref_logits, ro.response) * mask
    if ctx.separate:
        value = full_params(ctx, state.params, state.ref_params)["value"]
        old_value = value_out(ctx, value, tokens, key_mask) * mask
    elif ctx.head:
        old_value = ro.value
    else:
        old_value = jnp.zeros_like(mask)
    evaluate = ctx.task.eval_fn
    reward_metrics = {}
    if ctx.reward_on_reference:  # its trunk is the reference's: read from the forward above
        task_reward = ctx.task.reward.from_hidden(env, ro, ref_out.hidden)
    elif getattr(ctx.task.reward, "with_metrics", None) is not None:  # e.g. reward/all_none_frac
        task_reward, reward_metrics = ctx.task.reward.with_metrics(env, ro)
    else:
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
        evals={**(evaluate(env, ro) if evaluate is not None else {}), **reward_metrics},
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
            # its declared chunked form; full's is "kl", the exact KL under kl.clamp (score_phase)
            return chunked.estimator_term(name, {"kl": sc.full_kl})
        return kl_lib.estimate(name, ro.logp, sc.ref_logp, mask, ro.logits, sc.ref_logits, kl_cfg.clamp)

    kl_reward = estimate(kl_cfg.estimator)
    task_reward, moments = sc.task_reward, None
    if ctx.cfg.ppo.normalize_reward:  # the running mean and std of the task reward (klrl.rewards.running)
        task_reward, moments = running.normalized_reward(state.opt_state, sc.task_reward, DATA)
    rewards = shaped_rewards(task_reward, kl_reward, mask, beta_r, kl_cfg.placement)
    seq_ret = sequence_returns(task_reward, kl_reward, mask, beta_r, kl_cfg.placement)
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
        reward_moments=moments,
    )


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
    return new._replace(
        ref_params=ref_params, ctrl=ctrl, other_coef=other_coef, iteration=iteration, skipped=skipped
    )


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
    if ad.reward_moments is not None:  # the moments move with an applied iteration only
        kept = running.read(state.opt_state)
        opt_state = running.write(opt_state, where(ok, ad.reward_moments, kept))
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
    fold_rollout: bool = True,
) -> Train:
    """Build pure ``init`` and the jitted ``step`` for ``cfg`` on ``task``.

    Any causal LM trains here, whatever its family: ``policy`` (default ``task.policy``) is a
    :class:`klrl.models.base.CausalLM` and ``policy_params`` (default ``task.policy_params``) its
    initial parameters, which are also the frozen KL reference. ``value`` (a trunk without LM head)
    and ``value_params`` (its parameters with a :class:`~klrl.models.heads.ValueHead` attached) set
    the separate value model of ``model.value_model=separate``; by default :func:`build_models`
    builds a fresh klrl GPT of ``cfg.model``. ``reward`` replaces the task's reward (its parameters
    then travel in ``train.context.task.env``, the env to step with). ``stop_ids`` (default: the
    task's tokenizer's) is the set of tokens that end a response. The task's parts are not checked
    here: ``klrl.run`` and ``klrl.sweep`` check them against the policy at their entry
    (:func:`klrl.checks.check_program`; a mismatch is a :class:`ConfigError` naming the part), and a
    direct caller can call :func:`klrl.checks.check_parts` first. ``log_target`` (default:
    ``is_adaptive(cfg.ctrl.kind)``) logs ``ctrl/target`` (a sweep sets it when any member is adaptive;
    fixed members then log NaN).
    ``samples`` (> 0) adds the first that many rows of each iteration's batch to the step's outputs as
    ``_samples/*`` arrays (:func:`klrl.step.samples.sample_rows`; the run loop decodes and writes them).
    ``fold_rollout``: a LoRA policy's rollout samples from the adapters folded into the base
    (:func:`rollout_policy`); a sweep's program (one base for all members, vmapped) sets it False."""
    if cfg.model.remat == "auto":  # the first mode whose compiled step fits model.memory_gb
        kwargs = dict(policy=policy, policy_params=policy_params, value=value, value_params=value_params,
                      reward=reward, stop_ids=stop_ids, log_target=log_target, samples=samples,
                      fold_rollout=fold_rollout)  # fmt: skip
        return auto_remat(cfg, task, mesh, **kwargs)
    mesh = mesh_from_config(cfg.train) if mesh is None else mesh
    task = task if reward is None else dataclasses.replace(task, reward=reward)
    policy = task.policy if policy is None else policy
    policy_params = task.policy_params if policy_params is None else policy_params
    models, adapters, ref_init = _models(cfg, policy, policy_params, value)
    n_dev = mesh.shape[DATA]
    _check_grad_accum(cfg, n_dev)
    ctx = Context(
        cfg=cfg,
        task=task,
        models=models,
        policy_params=policy_params,
        value_params=value_params,
        stop_ids=stop_set(task.stop_ids if stop_ids is None else stop_ids),
        controller=from_config(cfg.ctrl),
        optimizer=make_optimizer(cfg),
        n_dev=n_dev,
        log_target=is_adaptive(cfg.ctrl.kind) if log_target is None else log_target,
        samples=min(int(samples), cfg.train.batch_size),
        policy_adapters=adapters,
        ref_init=ref_init,
        fold_rollout=fold_rollout,
    )
    return _train(ctx, mesh, policy)


def _models(cfg: RunConfig, policy: CausalLM, policy_params: Any, value: CausalLM | None):
    """``(models, policy adapters, reference init)``: :func:`build_models` with the caller's separate
    ``value`` trunk (if any), then the frozen base of LoRA or ``model.ref_quant``
    (:func:`frozen_base`)."""
    models = build_models(cfg, policy)
    if value is not None:
        if not models.value:
            raise ConfigError("value: a separate value model needs model.value_model=separate and a critic")
        models = models._replace(value=value, value_head=ValueHead(value.hidden_size))
    return frozen_base(cfg, models, policy_params)


def _check_grad_accum(cfg: RunConfig, n_dev: int) -> None:
    """``ppo.grad_accum`` divides each of the ``n_dev`` data devices' share of a minibatch (one device:
    :class:`RunConfig` checked that it divides the minibatch)."""
    share, k = cfg.train.batch_size // cfg.ppo.minibatches // n_dev, cfg.ppo.grad_accum
    if share % k:
        raise ConfigError(
            f"ppo.grad_accum: must divide each device's share of a minibatch ({share} rows "
            f"on each of {n_dev} devices; {share} % {k} != 0)"
        )


def _train(ctx: Context, mesh: Any, policy: CausalLM) -> Train:
    """The :class:`Train` of ``ctx`` on ``mesh``: its init, placement, sharded step, phases and loss."""
    one = partial(step_fn, ctx)
    fns = (rollout_phase, score_phase, advantage_phase, update_phase, control_phase)
    phases = Phases(*(partial(f, ctx) for f in fns))
    shardings = state_shardings(ctx, mesh)
    return Train(
        init=partial(init_state, ctx, mesh),
        place=partial(place_state, ctx, shardings),
        step=shard_step(one, mesh, state_shardings=shardings, kept="ref_params" if ctx.ref_frozen else None),
        shard_step=one,
        loss=partial(ppo_loss, ctx),
        policy=policy,
        value_model=ctx.models.value,
        mesh=mesh,
        phases=phases,
        context=ctx,
        state_shardings=shardings,
    )


AUTO_ORDER = ("none", "dots", "block", "full")  # least recomputation first (docs/pretrained.md's table)


def memory_budget(cfg: RunConfig, resident: int = 0) -> float:
    """Bytes the compiled step may use (``model.memory_gb``; 0: what the device has free: the accelerator's
    ``bytes_limit - bytes_in_use``, or on a CPU the host's ``MemAvailable`` plus ``resident``, the bytes of
    the step's arguments already loaded, e.g. the task's frozen weights)."""
    if cfg.model.memory_gb > 0:
        return cfg.model.memory_gb * 1e9
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):  # pragma: no cover (not Linux): no limit known
        return float("inf")
    return float(avail + resident)


def step_bytes(train: Train) -> int:
    """Bytes the compiled step needs: its arguments, temporaries and outputs (less those aliasing a donated
    argument), from XLA's ``memory_analysis`` of the step lowered on the state's shapes."""
    ctx = train.context
    shapes = jax.eval_shape(lambda: train.init(ctx.cfg.train.seed))
    abstract = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, train.state_shardings
    )
    ma = train.step.lower(abstract, ctx.task.env).compile().memory_analysis()
    if ma is None:  # pragma: no cover (a backend without it)
        return 0
    return int(
        ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    )


def auto_remat(cfg: RunConfig, task: Task, mesh: Any = None, **kwargs: Any) -> Train:
    """``model.remat=auto``: :func:`make_train` with the first mode of :data:`AUTO_ORDER` (less
    recomputation first: on this CPU the fastest first, ``docs/pretrained.md``) whose compiled step
    (:func:`step_bytes`) fits :func:`memory_budget`; ``full`` when none does. Each mode tried is one
    compile of the step. The chosen mode is ``train.context.cfg.model.remat``."""
    params = kwargs.get("policy_params") or task.policy_params
    resident = sum(x.nbytes for x in jax.tree.leaves((params, task.env)) if hasattr(x, "nbytes"))
    budget = memory_budget(cfg, resident)
    for mode in AUTO_ORDER:
        train = make_train(cfg.replace(model={"remat": mode}), task, mesh, **kwargs)
        if mode == AUTO_ORDER[-1] or step_bytes(train) <= budget:
            return train
    raise AssertionError("unreachable")  # pragma: no cover


def frozen_base(cfg: RunConfig, models: Models, params: Any) -> tuple[Models, Any, Any]:
    """``(models, initial adapters or None, quantised reference or None)``: the policy's adapters of
    ``model.adapter`` (a PEFT directory), the ``model.ref_quant`` reference (and a LoRA run's base), and
    every adapted model's targets checked against the base, before anything compiles."""
    adapters = ref_init = None
    if cfg.model.adapter:
        policy, adapters = initial_adapters(cfg, models.policy, params)
        models = models._replace(policy=policy)
    if cfg.model.ref_quant != "none":
        ref, ref_init = quantized_reference(cfg, models.ref, params)
        models = models._replace(ref=ref)
    check_adapters(models, params if ref_init is None else ref_init, cfg.lora.critic_rank)
    return models, adapters, ref_init


def initial_adapters(cfg: RunConfig, policy: CausalLM, base_params: Any) -> tuple[CausalLM, Any]:
    """``(LoRA policy, adapters)`` of ``model.adapter`` on the base ``policy`` (its targets, rank and alpha;
    the base's quantisation of ``model.ref_quant``); a bad directory is a :class:`ConfigError`."""
    base = policy.base if isinstance(policy, lora_lib.LoRA) else policy
    try:
        model, adapters = peft.load_adapter(cfg.model.adapter, base, base_params, base_name=cfg.model.path)
    except CheckpointFormatError as e:
        raise ConfigError(f"model.adapter: {e}") from None
    return dataclasses.replace(model, quant=cfg.model.ref_quant), adapters


def quantized_reference(cfg: RunConfig, base: CausalLM, params: Any) -> tuple[CausalLM, Any]:
    """``(model, parameters)`` of the ``model.ref_quant`` reference (:func:`klrl.models.quant.quantize`);
    a family it does not support is a :class:`ConfigError`."""
    try:
        return quant.quantize(base, params, cfg.model.ref_quant)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_adapters(models: Models, base_params: Any, critic_rank: int = 0) -> None:
    """Each adapted model's ``lora.targets`` matches some linear layer of its family and its rank is at
    most the width of every layer it adapts (a :class:`ConfigError` naming the field otherwise), before
    any adapter is built or anything compiles."""
    critic = "lora.critic_rank" if critic_rank else "lora.rank"
    for m, field in ((models.policy, "lora.rank"), (models.value, critic)):
        if isinstance(m, lora_lib.LoRA):
            try:
                lora_lib.check(m, base_params, field)
            except ValueError as e:
                raise ConfigError(str(e)) from None


def place_state(ctx: Context, shardings: Any, state: TrainState) -> TrainState:
    """``state`` (host values, e.g. a restored checkpoint) laid out like ``init``'s
    (:func:`klrl.distributed.put` onto ``shardings``). A frozen reference equal to the task's loaded
    parameters then takes those very arrays, as ``init``'s does: a resumed or rolled-back run holds
    one copy of them, not two (one process; with several the restored copy is kept)."""
    placed = distributed.put(state, shardings)
    if not ctx.ref_frozen or distributed.is_multiprocess():
        return placed
    ref_sh = shardings if isinstance(shardings, jax.sharding.Sharding) else shardings.ref_params
    loaded = jax.device_put(as_ref_dtype(ctx, ctx.policy_params), ref_sh)
    if jax.tree.structure(loaded) != jax.tree.structure(placed.ref_params):
        return placed
    pairs = list(zip(jax.tree.leaves(placed.ref_params), jax.tree.leaves(loaded), strict=True))
    if all(a.shape == b.shape and a.dtype == b.dtype and bool(jnp.array_equal(a, b)) for a, b in pairs):
        return placed._replace(ref_params=loaded)
    return placed
