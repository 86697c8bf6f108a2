"""``make_train(cfg, task)``: pure ``init`` and the one compiled PPO-KL iteration.

One call of ``step(state, env) -> (state, metrics)`` does, inside one jitted
``shard_map`` over the ``'data'`` axis:

  prompts -> rollout (KV-cache ``lax.scan``) -> reference and reward scoring
  -> per-token KL shaping -> advantages -> PPO epochs x minibatches (nested
  ``lax.scan``) -> beta controller update -> reference refresh -> guard.

beta lives in ``state.ctrl.beta`` (float32) and is only ever used as an array.

Device invariance: every example's prompt and sampling key come from its
*global* index, and minibatches are drawn from the *global* batch (the scored
batch is all-gathered, each device takes its slice of every global minibatch),
so a run on 1 or N devices does the same maths up to reduction order.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from klrl import advantages as adv_lib
from klrl import kl as kl_lib
from klrl import losses
from klrl.config import RunConfig
from klrl.control import ControllerState, from_config
from klrl.model import GPT, entropy, forward, init_params, token_logprobs
from klrl.parallel import DATA, average, gather, make_mesh, shard_step, total
from klrl.rollout import Rollout, generate, response_slice, sequence
from klrl.shaping import sequence_returns, shaped_rewards
from klrl.tasks.base import Task

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


class Phases(NamedTuple):
    """The stages ``step`` is composed of, as per-shard functions (call them under ``shard_map``
    over ``'data'``, as the step does; ``benchmarks/`` times each one compiled on its own)."""

    rollout: Any  # (state, env) -> Rollout
    score: Any  # (state, env, rollout) -> {tokens, key_mask, ref_logits, ref_logp, value, task_reward, evals}
    advantages: Any  # (state, rollout, scores) -> {batch, rewards, kl_reward, kl_ctrl, k1, exact}
    update: Any  # (state, batch) -> (params, opt_state, stats): PPO epochs x minibatches
    control: Any  # (state, kl_ctrl, mask) -> (controller state, observed KL)


class Train(NamedTuple):
    init: Any  # (seed | key, beta=None) -> TrainState
    step: Any  # jitted (state, env) -> (state, metrics)
    shard_step: Any  # the per-shard function, for vmap (sweeps) and custom wrapping
    loss: Any  # (params, minibatch, n_tok, n_seq, beta_l) -> (loss, stats): the PPO loss of the update
    policy: GPT
    value_model: GPT | None
    mesh: Any
    phases: Phases


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


def _where(ok: Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _all_finite(tree: Any) -> Array:
    leaves = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_train(cfg: RunConfig, task: Task, mesh: Any = None) -> Train:
    """Build pure ``init`` and the jitted ``step`` for ``cfg`` on ``task``."""
    mesh = make_mesh(cfg.train.devices) if mesh is None else mesh
    n_dev = mesh.shape[DATA]
    b_glob = cfg.train.batch_size
    b_loc = b_glob // n_dev
    n_mb = cfg.ppo.minibatches
    mb_glob = b_glob // n_mb
    mb_loc = mb_glob // n_dev
    group = cfg.ppo.group_size
    p_len, r_len = task.prompt_len, cfg.sampling.response_len
    temp = cfg.sampling.temperature
    critic = cfg.ppo.advantage == "gae"
    head = critic and cfg.model.value_model == "head"
    separate = critic and cfg.model.value_model == "separate"
    kl_cfg, c_cfg = cfg.kl, cfg.ctrl
    keep_logits = True  # exact KL is a metric of every run; small vocabularies make it cheap
    kl_in_loss = kl_cfg.placement in ("loss", "reward+loss")
    drives_reward = c_cfg.drives == "reward"

    max_len = p_len + r_len
    policy = GPT(cfg.model, task.vocab_size, max(max_len, task.max_len), lm_head=True, scalar_head=head)
    ref_model = policy.clone(scalar_head=False)
    value_model = GPT(cfg.model, task.vocab_size, policy.max_len, lm_head=False, scalar_head=True)
    controller = from_config(c_cfg)
    optimizer = make_optimizer(cfg)

    def init(seed: int | Array = 0, beta: float | Array | None = None) -> TrainState:
        # raw uint32 keys: plain arrays that checkpoint, vmap and compare like any other leaf
        key = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        k_head, k_value, k_run = jax.random.split(key, 3)
        pol = jax.tree.map(jnp.copy, task.ref_params)  # own buffers: the step donates the state
        if head:  # graft a fresh scalar head onto the pretrained trunk
            fresh = init_params(policy, k_head, max_len)
            pol = dict(pol, v_head=fresh["v_head"])
        params = {"policy": pol, "value": init_params(value_model, k_value, max_len) if separate else None}
        b_r = kl_cfg.beta if beta is None else beta
        driven, other = (b_r, kl_cfg.loss_coef) if drives_reward else (kl_cfg.loss_coef, b_r)
        state = TrainState(
            params=params,
            ref_params=jax.tree.map(jnp.copy, task.ref_params),
            opt_state=optimizer.init(params),
            ctrl=jax.tree.map(jnp.copy, controller.init(jnp.asarray(driven, jnp.float32))),  # own buffers
            other_coef=jnp.asarray(other, jnp.float32),
            rng=k_run,
            iteration=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
        )
        # replicated on the mesh, as ``step`` returns it: otherwise the second call recompiles
        return jax.device_put(state, NamedSharding(mesh, PartitionSpec()))

    def policy_out(pol_params, tokens, key_mask):
        out = forward(policy, pol_params, tokens, key_mask)
        logits = response_slice(out.logits, p_len, r_len) / temp
        value = response_slice(out.value, p_len, r_len) if head else None
        return logits, value

    def loss_fn(params, mb, n_tok, n_seq, beta_l):
        """PPO loss of one (per-device) minibatch ``mb``, normalised by ``n_tok`` tokens and
        ``n_seq`` sequences (this device's share of the global minibatch's), and its statistics."""
        logits, value = policy_out(params["policy"], mb["tokens"], mb["key_mask"])
        m = mb["mask"]
        logp = token_logprobs(logits, mb["response"])
        pg, clipped = losses.clipped_surrogate(logp, mb["logp"], mb["adv"], cfg.ppo.clip)
        ent = entropy(logits)
        # normalise by the per-device share of the global minibatch so that pmean is the global mean
        loss = losses.masked_sum(pg - cfg.ppo.ent_coef * ent, m) / n_tok
        stats = {
            "loss/policy": losses.masked_sum(pg, m) / n_tok,
            "policy/clipfrac": losses.masked_sum(clipped, m) / n_tok,
            "policy/approx_kl": losses.masked_sum(losses.approx_kl(logp, mb["logp"]), m) / n_tok,
            "policy/entropy": losses.masked_sum(ent, m) / n_tok,
        }
        if critic:
            if separate:
                value = response_slice(
                    forward(value_model, params["value"], mb["tokens"], mb["key_mask"]).value,
                    p_len,
                    r_len,
                )
            vl, vclip = losses.clipped_value_loss(value, mb["value"], mb["ret"], cfg.ppo.vf_clip)
            loss = loss + cfg.ppo.vf_coef * losses.masked_sum(vl, m) / n_tok
            stats["loss/value"] = losses.masked_sum(vl, m) / n_tok
            stats["value/clipfrac"] = losses.masked_sum(vclip, m) / n_tok
        if kl_in_loss:
            kl_t = kl_lib.estimate(
                kl_cfg.loss_estimator, logp, mb["ref_logp"], m, logits, mb.get("ref_logits"), kl_cfg.clamp
            )
            if kl_cfg.loss_agg == "token_mean":
                kl_term = losses.masked_sum(kl_t, m) / n_tok
            else:
                kl_term = jnp.sum(kl_lib.token_mean(kl_t, m)) / n_seq
            loss = loss + beta_l * kl_term
            stats[f"kl/loss_{kl_cfg.loss_agg}"] = kl_term
        stats["loss/total"] = loss
        return loss, stats

    def iteration_keys(state: TrainState) -> tuple[Array, Array, Array]:
        """(prompt, sampling, minibatch-permutation) keys of this iteration."""
        k_prompt, k_sample, k_perm = jax.random.split(jax.random.fold_in(state.rng, state.iteration), 3)
        return k_prompt, k_sample, k_perm

    def coefs(state: TrainState) -> tuple[Array, Array]:
        """(reward-side beta, loss-side coefficient)."""
        if drives_reward:
            return state.ctrl.beta, state.other_coef
        return state.other_coef, state.ctrl.beta

    def rollout_phase(state: TrainState, env: Any) -> Rollout:
        """Prompts and responses for this device's share of the global batch."""
        k_prompt, k_sample, _ = iteration_keys(state)
        g_idx = jax.lax.axis_index(DATA) * b_loc + jnp.arange(b_loc)
        n_pool = env["prompts"].shape[0]
        p_idx = jax.vmap(
            lambda g: jax.random.randint(jax.random.fold_in(k_prompt, g // group), (), 0, n_pool)
        )(g_idx)
        ex_keys = jax.vmap(jax.random.fold_in, (None, 0))(k_sample, g_idx)
        return generate(
            policy, state.params["policy"], env["prompts"][p_idx], env["prompt_mask"][p_idx], ex_keys,
            cfg.sampling, task.eos_id, task.pad_id, keep_logits,
        )  # fmt: skip

    def score_phase(state: TrainState, env: Any, ro: Rollout) -> dict[str, Any]:
        """Reference log-probs (and logits), old values, task reward and evaluations."""
        mask = ro.mask
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, mask)
        ref_logits = (
            response_slice(forward(ref_model, state.ref_params, tokens, key_mask).logits, p_len, r_len) / temp
        )
        if separate:
            old_value = response_slice(
                forward(value_model, state.params["value"], tokens, key_mask).value, p_len, r_len
            )
            old_value = old_value * mask
        elif head:
            old_value = ro.value
        else:
            old_value = jnp.zeros_like(mask)
        return {
            "tokens": tokens,
            "key_mask": key_mask,
            "ref_logits": ref_logits,
            "ref_logp": token_logprobs(ref_logits, ro.response) * mask,
            "value": old_value,
            "task_reward": task.reward_fn(env, ro),
            "evals": task.eval_fn(env, ro) if task.eval_fn is not None else {},
        }

    def advantage_phase(state: TrainState, ro: Rollout, sc: dict[str, Any]) -> dict[str, Any]:
        """KL estimates, shaped rewards, advantages and returns; ``batch`` is this device's
        share of what the update reads."""
        mask = ro.mask
        beta_r, _ = coefs(state)

        def estimate(name):
            lg, ref_lg = ro.logits, sc["ref_logits"]
            return kl_lib.estimate(name, ro.logp, sc["ref_logp"], mask, lg, ref_lg, kl_cfg.clamp)

        kl_reward = estimate(kl_cfg.estimator)
        rewards = shaped_rewards(sc["task_reward"], kl_reward, mask, beta_r, kl_cfg.placement)
        if critic:
            advantages, returns = adv_lib.gae(rewards, sc["value"], mask, cfg.ppo.gamma, cfg.ppo.lam)
        else:
            seq_ret = sequence_returns(sc["task_reward"], kl_reward, mask, beta_r, kl_cfg.placement)
            fn = adv_lib.grpo if cfg.ppo.advantage == "grpo" else adv_lib.rloo
            a = fn(seq_ret, group, cfg.ppo.group_std) if cfg.ppo.advantage == "grpo" else fn(seq_ret, group)
            advantages = a[:, None] * mask
            returns = jnp.zeros_like(mask)
        if cfg.ppo.whiten:
            advantages = adv_lib.whiten(advantages, mask, DATA)
        batch = {
            "tokens": sc["tokens"], "key_mask": sc["key_mask"], "response": ro.response, "mask": mask,
            "logp": ro.logp, "ref_logp": sc["ref_logp"], "adv": advantages, "ret": returns,
            "value": sc["value"],
        }  # fmt: skip
        if kl_in_loss and kl_cfg.loss_estimator == "full":
            batch["ref_logits"] = sc["ref_logits"]
        return {
            "batch": batch,
            "rewards": rewards,
            "kl_reward": kl_reward,
            "kl_ctrl": estimate(c_cfg.estimator),
            "k1": estimate("k1"),
            "exact": kl_lib.full_kl(ro.logits, sc["ref_logits"], mask),
        }

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def update_phase(state: TrainState, batch: dict[str, Array]) -> tuple[Any, Any, dict[str, Array]]:
        """PPO epochs x minibatches (nested ``lax.scan``) over the global batch (``batch`` is
        this device's share; it is all-gathered first). Returns (params, opt_state, mean stats)."""
        k_perm = iteration_keys(state)[2]
        _, beta_l = coefs(state)
        dev = jax.lax.axis_index(DATA)
        batch = gather(batch)  # every device sees the global batch

        def minibatch_step(carry, idx):
            params, opt_state = carry
            mb = jax.tree.map(lambda x: x[idx], batch)
            n_tok = total(jnp.sum(mb["mask"])) / n_dev
            grads, stats = grad_fn(params, mb, jnp.maximum(n_tok, 1.0), mb_glob / n_dev, beta_l)
            grads, stats = average((grads, stats))
            stats["grad/norm"] = optax.tree.norm(grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), stats

        def epoch_step(carry, k):
            perm = jax.random.permutation(k, b_glob).reshape(n_mb, n_dev, mb_loc)[:, dev]
            return jax.lax.scan(minibatch_step, carry, perm)

        epoch_keys = jax.random.split(k_perm, cfg.ppo.epochs)
        (params, opt_state), stats = jax.lax.scan(epoch_step, (state.params, state.opt_state), epoch_keys)
        return params, opt_state, jax.tree.map(jnp.mean, stats)

    def control_phase(state: TrainState, kl_ctrl: Array, mask: Array) -> tuple[ControllerState, Array]:
        """The controller's update from this iteration's KL (in ``ctrl.unit``, averaged over the
        global batch). Returns (controller state, the KL it saw)."""
        kl_seen = average(jnp.mean(kl_lib.reduce(kl_ctrl, mask, c_cfg.unit)))
        return controller.update(state.ctrl, kl_seen, jnp.float32(b_glob)), kl_seen

    def step_fn(state: TrainState, env: Any) -> tuple[TrainState, dict[str, Array]]:
        ro = rollout_phase(state, env)
        mask = ro.mask
        sc = score_phase(state, env, ro)
        ad = advantage_phase(state, ro, sc)
        params, opt_state, stats = update_phase(state, ad["batch"])
        ctrl, kl_seen = control_phase(state, ad["kl_ctrl"], mask)
        task_reward, evals, ref_logp = sc["task_reward"], sc["evals"], sc["ref_logp"]
        kl_reward, rewards, k1, exact = ad["kl_reward"], ad["rewards"], ad["k1"], ad["exact"]
        explained = (ad["batch"]["value"], ad["batch"]["ret"], mask)  # gathered for the metric

        # ---- reference refresh ----
        ref_params = state.ref_params
        if kl_cfg.ref_update_every > 0:
            refresh = (state.iteration + 1) % kl_cfg.ref_update_every == 0
            mix = jnp.where(refresh, kl_cfg.ref_mix, 0.0)
            ref_params = jax.tree.map(
                lambda r, p: (1 - mix) * r + mix * p, state.ref_params, params["policy"]
            )

        # ---- metrics (global) ----
        def seq_mean(x):
            return average(jnp.mean(x))

        length = jnp.sum(mask, axis=-1)
        metrics = {
            "reward/task": seq_mean(task_reward),
            "reward/shaped_mean": seq_mean(jnp.sum(rewards, axis=-1)),
            "kl/seq_sum": seq_mean(kl_lib.seq_sum(k1, mask)),
            "kl/token_mean": seq_mean(kl_lib.token_mean(k1, mask)),
            f"kl/reward_{kl_cfg.estimator}_seq_sum": seq_mean(kl_lib.seq_sum(kl_reward, mask)),
            f"kl/reward_{kl_cfg.estimator}_token_mean": seq_mean(kl_lib.token_mean(kl_reward, mask)),
            "kl/exact_seq_sum": seq_mean(kl_lib.seq_sum(exact, mask)),
            "kl/exact_token_mean": seq_mean(kl_lib.token_mean(exact, mask)),
            f"ctrl/kl_observed_{c_cfg.unit}": kl_seen,
            "ctrl/beta": ctrl.beta if drives_reward else state.other_coef,
            "ctrl/loss_coef": state.other_coef if drives_reward else ctrl.beta,
            "ctrl/target": state.ctrl.params.target,
            "response/length": seq_mean(length),
            "response/eos_frac": seq_mean((length < r_len).astype(jnp.float32)),
            "value/explained_variance": losses.explained_variance(*gather(explained))
            if critic
            else jnp.float32(0.0),
            "eval/ref_ppl": jnp.exp(-total(jnp.sum(ref_logp)) / jnp.maximum(total(jnp.sum(mask)), 1.0)),
            **{k: seq_mean(v) for k, v in evals.items() if not k.startswith("_")},
            **stats,
        }
        if task.batch_eval_fn is not None:
            tokens_only = ro._replace(
                logits=None, value=None
            )  # batch metrics read tokens, not [B, R, V] logits
            metrics.update(task.batch_eval_fn(env, gather(tokens_only), gather(task_reward), gather(evals)))

        # ---- non-finite guard: skip the whole update if anything is NaN/inf ----
        ok = _all_finite((params, task_reward, kl_reward, kl_seen, stats))
        ok = jax.lax.pmin(ok.astype(jnp.int32), DATA) > 0
        new_state = TrainState(params, ref_params, opt_state, ctrl, state.other_coef, state.rng,
                               state.iteration + 1, jnp.zeros((), jnp.int32))  # fmt: skip
        kept = state._replace(iteration=state.iteration + 1, skipped=state.skipped + 1)
        state = _where(ok, new_state, kept)
        metrics["guard/skipped"] = (~ok).astype(jnp.float32)
        metrics["guard/consecutive_skips"] = state.skipped.astype(jnp.float32)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return state, metrics

    step = shard_step(step_fn, mesh)
    phases = Phases(rollout_phase, score_phase, advantage_phase, update_phase, control_phase)
    return Train(init, step, step_fn, loss_fn, policy, value_model if separate else None, mesh, phases)
