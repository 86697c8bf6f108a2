"""Shared pieces of the throughput benchmarks: workloads, timing, phase functions, FLOP counts.

See ``benchmarks/NOTES.md`` for what each number means. In short:

* the iteration is timed through ``make_train(cfg, task).step`` (the one compiled iteration,
  AOT-compiled with ``.lower().compile()`` so the compile time is measured on its own);
* the phases (rollout, scoring, advantages, update, controller) are *separately jitted*
  functions rebuilt here from the same library pieces the step uses
  (:func:`klrl.rollout.generate`, :func:`klrl.model.forward`, :func:`klrl.advantages.gae`, the
  PPO losses and optimiser, :mod:`klrl.control`); they do not sum exactly to the iteration;
* FLOPs are matmul FLOPs from :func:`klrl.model.matmul_flops` (:func:`iteration_flops`).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from klrl import advantages as adv_lib
from klrl import kl as kl_lib
from klrl.config import (
    KLConfig,
    ModelConfig,
    PPOConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)
from klrl.control import from_config
from klrl.model import forward, matmul_flops, token_logprobs
from klrl.rollout import generate, response_slice, sequence
from klrl.shaping import sequence_returns, shaped_rewards
from klrl.tasks.base import Task
from klrl.train import Train, make_optimizer, make_train

WORKLOADS = ("default", "peer-medium", "peer-small")
PHASES = ("rollout", "scoring", "advantages", "update", "controller")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- timing and machine measurements -------------------------------------------------------------


def median_time(fn: Callable, *args: Any, n: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn(*args)`` (blocked until ready) over ``n`` calls after ``warmup``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(n, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(n: int = 1024, dtype: Any = jnp.float32, reps: int = 10) -> float:
    """FLOP/s of one jitted ``jnp.dot`` of two ``n x n`` matrices (2 n^3 FLOPs), median of ``reps``."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    f = jax.jit(jnp.dot)
    return 2.0 * n**3 / median_time(f, a, b, n=reps, warmup=2)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


# ---- workloads ---------------------------------------------------------------------------------


def peer_config(
    *,
    d_model: int,
    prompt_len: int,
    response_len: int,
    n_layers: int = 2,
    n_heads: int = 4,
    dtype: str = "float32",
    batch: int = 64,
    epochs: int = 1,
    minibatches: int = 4,
) -> RunConfig:
    """The peer-comparison setup: separate value model, exactly ``response_len`` tokens, k1 KL in
    the reward, ``epochs`` x ``minibatches`` PPO, tied embeddings."""
    return RunConfig(
        model=ModelConfig(
            n_layers=n_layers,
            n_heads=n_heads,
            d_model=d_model,
            tie_embeddings=True,
            value_model="separate",
            dtype=dtype,
        ),
        sampling=SamplingConfig(response_len=response_len, use_eos=False),
        kl=KLConfig(placement="reward", estimator="k1"),
        ppo=PPOConfig(epochs=epochs, minibatches=minibatches),
        task=TaskConfig(prompt_len=prompt_len),
        train=TrainConfig(batch_size=batch),
    )


def build_workload(name: str) -> tuple[RunConfig, Task]:
    """``default`` (RunConfig() on wordclass), ``peer-medium`` or ``peer-small``."""
    if name == "default":
        from klrl.tasks.wordclass import make_task

        cfg = RunConfig()
        return cfg, make_task(cfg, log)  # pretrains or loads the reference (KLRL_CACHE honoured)
    from klrl.tasks.peer import make_peer_task

    if name == "peer-medium":
        cfg = peer_config(d_model=128, prompt_len=16, response_len=32)
    elif name == "peer-small":
        cfg = peer_config(d_model=64, prompt_len=8, response_len=16)
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    return cfg, make_peer_task(cfg, prompt_len=cfg.task.prompt_len, vocab=256)


# ---- FLOPs ---------------------------------------------------------------------------------------


def iteration_flops(cfg: RunConfig, task: Task, reward_model: bool | None = None) -> dict[str, int]:
    """Matmul FLOPs of one iteration, by part (see NOTES.md for the formula).

    ``reward_model``: whether the task's reward is a forward of a GPT of ``cfg.model`` without LM
    head (default: true for the ``peer`` task).
    """
    m, v = cfg.model, task.vocab_size
    b, p, r = cfg.train.batch_size, task.prompt_len, cfg.sampling.response_len
    s = p + r
    critic = cfg.ppo.advantage == "gae"
    separate = critic and m.value_model == "separate"
    if reward_model is None:
        reward_model = task.name == "peer"
    # prefill of the P prompt tokens, then R - 1 single-token decode steps; step t feeds the token of
    # slot P + t, which attends to P + t + 1 keys (the last sampled token is never fed back)
    rollout = matmul_flops(m, v, b * p, p) + sum(matmul_flops(m, v, b, p + t + 1) for t in range(r - 1))
    policy_fwd = matmul_flops(m, v, b * s, s)
    value_fwd = matmul_flops(m, v, b * s, s, lm_head=False) if separate else 0
    parts = {
        "rollout": rollout,
        "reference": policy_fwd,
        "value": value_fwd,
        "reward": matmul_flops(m, v, b * s, s, lm_head=False) if reward_model else 0,
        # every epoch sees the whole batch once; forward + backward = 3 forwards
        "update": cfg.ppo.epochs * 3 * (policy_fwd + value_fwd),
    }
    parts["total"] = sum(parts.values())
    return parts


# ---- separately jitted phases --------------------------------------------------------------------


class Phases(NamedTuple):
    rollout: Callable  # (policy_params, prompts, prompt_mask, keys) -> Rollout
    scoring: Callable  # (params, ref_params, env, rollout) -> scores
    advantages: Callable  # (rollout, scores, beta) -> (batch, kl_ctrl, kl_metrics)
    update: Callable  # (params, opt_state, batch, key) -> (params, opt_state, stats)
    controller: Callable  # (ctrl_state, kl_ctrl, mask) -> ctrl_state


def build_phases(cfg: RunConfig, task: Task, train: Train) -> Phases:
    """The iteration's phases as separately jitted single-device functions.

    They mirror ``klrl.train.make_train``'s step on one device (no collectives); the update
    differentiates the trainer's own loss (``Train.loss``). They are for attributing time, not for training.
    """
    p_len, r_len = task.prompt_len, cfg.sampling.response_len
    b = cfg.train.batch_size
    n_mb = cfg.ppo.minibatches
    temp = cfg.sampling.temperature
    critic = cfg.ppo.advantage == "gae"
    head = critic and cfg.model.value_model == "head"
    separate = critic and cfg.model.value_model == "separate"
    kl_cfg, c_cfg = cfg.kl, cfg.ctrl
    kl_in_loss = kl_cfg.placement in ("loss", "reward+loss")
    policy = train.policy
    ref_model = policy.clone(scalar_head=False)
    value_model = train.value_model
    optimizer = make_optimizer(cfg)
    controller = from_config(c_cfg)

    @jax.jit
    def rollout(pol, prompts, prompt_mask, keys):
        return generate(policy, pol, prompts, prompt_mask, keys, cfg.sampling, task.eos_id, task.pad_id, True)

    @jax.jit
    def scoring(params, ref_params, env, ro):
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        ref_logits = response_slice(forward(ref_model, ref_params, tokens, key_mask).logits, p_len, r_len)
        ref_logits = ref_logits / temp
        if separate:
            out = forward(value_model, params["value"], tokens, key_mask)
            old_value = response_slice(out.value, p_len, r_len) * ro.mask
        elif head:
            old_value = ro.value
        else:
            old_value = jnp.zeros_like(ro.mask)
        return {
            "tokens": tokens,
            "key_mask": key_mask,
            "ref_logits": ref_logits,
            "ref_logp": token_logprobs(ref_logits, ro.response) * ro.mask,
            "value": old_value,
            "task_reward": task.reward_fn(env, ro),
        }

    @jax.jit
    def advantages(ro, sc, beta):
        mask = ro.mask

        def estimate(name):
            return kl_lib.estimate(
                name, ro.logp, sc["ref_logp"], mask, ro.logits, sc["ref_logits"], kl_cfg.clamp
            )

        kl_reward = estimate(kl_cfg.estimator)
        kl_ctrl = estimate(c_cfg.estimator)
        kl_metrics = {
            "k1": jnp.mean(kl_lib.seq_sum(estimate("k1"), mask)),
            "exact": jnp.mean(kl_lib.seq_sum(kl_lib.full_kl(ro.logits, sc["ref_logits"], mask), mask)),
        }
        if critic:
            rewards = shaped_rewards(sc["task_reward"], kl_reward, mask, beta, kl_cfg.placement)
            adv, ret = adv_lib.gae(rewards, sc["value"], mask, cfg.ppo.gamma, cfg.ppo.lam)
        else:
            seq_ret = sequence_returns(sc["task_reward"], kl_reward, mask, beta, kl_cfg.placement)
            if cfg.ppo.advantage == "grpo":
                a = adv_lib.grpo(seq_ret, cfg.ppo.group_size, cfg.ppo.group_std)
            else:
                a = adv_lib.rloo(seq_ret, cfg.ppo.group_size)
            adv, ret = a[:, None] * mask, jnp.zeros_like(mask)
        if cfg.ppo.whiten:
            adv = adv_lib.whiten(adv, mask)
        batch = {
            "tokens": sc["tokens"], "key_mask": sc["key_mask"], "response": ro.response, "mask": mask,
            "logp": ro.logp, "ref_logp": sc["ref_logp"], "adv": adv, "ret": ret, "value": sc["value"],
        }  # fmt: skip
        if kl_in_loss and kl_cfg.loss_estimator == "full":
            batch["ref_logits"] = sc["ref_logits"]
        return batch, kl_ctrl, kl_metrics

    # the trainer's own PPO loss (one device: this minibatch is the whole global minibatch)
    grad_fn = jax.grad(train.loss, has_aux=True)

    @jax.jit
    def update(params, opt_state, batch, key):
        beta_l = jnp.float32(kl_cfg.loss_coef)

        def minibatch_step(carry, idx):
            params, opt_state = carry
            mb = jax.tree.map(lambda x: x[idx], batch)
            n_seq = jnp.float32(mb["mask"].shape[0])
            grads, stats = grad_fn(params, mb, jnp.maximum(jnp.sum(mb["mask"]), 1.0), n_seq, beta_l)
            stats["grad_norm"] = optax.tree.norm(grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), stats

        def epoch_step(carry, k):
            perm = jax.random.permutation(k, b).reshape(n_mb, b // n_mb)
            return jax.lax.scan(minibatch_step, carry, perm)

        keys = jax.random.split(key, cfg.ppo.epochs)
        (params, opt_state), stats = jax.lax.scan(epoch_step, (params, opt_state), keys)
        return params, opt_state, jax.tree.map(jnp.mean, stats)

    @jax.jit
    def control(ctrl, kl_ctrl, mask):
        kl_seen = jnp.mean(kl_lib.reduce(kl_ctrl, mask, c_cfg.unit))
        return controller.update(ctrl, kl_seen, jnp.float32(b))

    return Phases(rollout, scoring, advantages, update, control)


def time_phases(
    cfg: RunConfig, task: Task, train: Train, state: Any, n: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median time of each phase over ``n`` calls (after one compiling call) on realistic inputs
    from the previous phase. Returns ``(phase seconds, phase compile+first-call seconds)``."""
    dev = jax.devices()[0]
    put = lambda x: jax.device_put(x, dev)
    ph = build_phases(cfg, task, train)
    b = cfg.train.batch_size
    env = put(task.env)
    params, ref_params, opt_state, ctrl = put((state.params, state.ref_params, state.opt_state, state.ctrl))
    prompts, prompt_mask = env["prompts"][:b], env["prompt_mask"][:b]
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(1), jnp.arange(b))
    beta = jnp.float32(cfg.kl.beta)
    first: dict[str, float] = {}
    out: dict[str, float] = {}

    def run(name, fn, *args):
        t0 = time.perf_counter()
        res = jax.block_until_ready(fn(*args))
        first[name] = time.perf_counter() - t0
        out[name] = median_time(fn, *args, n=n, warmup=0)
        return res

    ro = run("rollout", ph.rollout, params["policy"], prompts, prompt_mask, keys)
    sc = run("scoring", ph.scoring, params, ref_params, env, ro)
    batch, kl_ctrl, _ = run("advantages", ph.advantages, ro, sc, beta)
    run("update", ph.update, params, opt_state, batch, jax.random.PRNGKey(2))
    run("controller", ph.controller, ctrl, kl_ctrl, ro.mask)
    return out, first


# ---- the whole measurement -----------------------------------------------------------------------


def measure(
    name: str,
    cfg: RunConfig,
    task: Task,
    *,
    iterations: int,
    warmup: int = 2,
    peak_flops: float,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Compile, warm up and time ``iterations`` iterations of ``make_train(cfg, task).step``, then
    time the phases. ``peak_flops`` is the reference matmul rate for ``flop_utilisation``.
    With ``time_budget_s`` the timed loop stops early (after at least 3 iterations) once the
    budget, counted from the start of the timed loop, is spent."""
    train = make_train(cfg, task)
    state = train.init(cfg.train.seed)
    env = task.env
    log(f"[{name}] compiling the iteration")
    t0 = time.perf_counter()
    lowered = train.step.lower(state, env)
    t1 = time.perf_counter()
    step = lowered.compile()
    t2 = time.perf_counter()
    lower_s, compile_s = t1 - t0, t2 - t0

    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, env))
    first_call_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        state, metrics = jax.block_until_ready(step(state, env))

    log(f"[{name}] timing {iterations} iterations")
    times: list[float] = []
    cpu_times: list[float] = []
    lengths: list[float] = []
    skipped = 0.0
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    for i in range(max(iterations, 1)):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = jax.block_until_ready(step(state, env))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        lengths.append(float(metrics["response/length"]))
        skipped += float(metrics["guard/skipped"])
        if time_budget_s is not None and i >= 2 and time.perf_counter() - start > time_budget_s:
            log(f"[{name}] time budget spent after {i + 1} iterations")
            break
    it_s = statistics.median(times)

    log(f"[{name}] timing the phases")
    phases, phases_first = time_phases(cfg, task, train, state, n=max(min(len(times), 10), 2))

    b, p, r = cfg.train.batch_size, task.prompt_len, cfg.sampling.response_len
    flops = iteration_flops(cfg, task)
    achieved = flops["total"] / it_s
    return {
        "workload": name,
        "iterations_timed": len(times),
        "iteration_s_median": it_s,
        "iteration_s_min": min(times),
        "iteration_s_max": max(times),
        "iteration_cpu_s_median": statistics.median(cpu_times),
        "load_avg_1m": [load_start, os.getloadavg()[0]],
        "compile_s": compile_s,
        "lower_s": lower_s,
        "first_call_s": first_call_s,
        "first_call_minus_steady_s": first_call_s - it_s,
        "phases_s": phases,
        "phases_sum_s": sum(phases.values()),
        "dominant_phase": max(phases, key=phases.get),
        "phases_first_call_s": phases_first,
        "tokens_per_s": b * r / it_s,
        "total_tokens_per_s": b * (p + r) / it_s,
        "response_length_mean": statistics.fmean(lengths),
        "guard_skipped_iterations": int(skipped),
        "batch": b,
        "prompt_len": p,
        "response_len": r,
        "peak_rss_mb": peak_rss_mb(),
        "flops_per_iteration": flops["total"],
        "flops_by_part": {k: v for k, v in flops.items() if k != "total"},
        "phase_flops_per_s": {
            "rollout": flops["rollout"] / phases["rollout"],
            "scoring": (flops["reference"] + flops["value"] + flops["reward"]) / phases["scoring"],
            "update": flops["update"] / phases["update"],
        },
        "achieved_flops_per_s": achieved,
        "matmul_flops_per_s": peak_flops,
        "flop_utilisation": achieved / peak_flops,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
    }
