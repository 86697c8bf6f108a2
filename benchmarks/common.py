"""Shared pieces of the throughput benchmarks: workloads, timing, phase functions, FLOP counts.

See ``benchmarks/NOTES.md`` for what each number means. In short:

* the iteration is timed through ``make_train(cfg, task).step`` (the one compiled iteration,
  AOT-compiled with ``.lower().compile()`` so the compile time is measured on its own);
* the phases (rollout, scoring, advantages, update, controller) are the step's own stages
  (``Train.phases``, the functions ``step`` is composed of), each compiled on its own; they do not
  sum exactly to the iteration;
* FLOPs are matmul FLOPs from :func:`klrl.models.gpt.matmul_flops` (:func:`iteration_flops`).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from klrl.advantages import needs_critic
from klrl.config import (
    KLConfig,
    ModelConfig,
    PPOConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)
from klrl.models.gpt import matmul_flops
from klrl.tasks.base import Task
from klrl.train import Train, make_train

WORKLOADS = ("default", "peer-medium", "peer-small")


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
    critic = needs_critic(cfg.ppo.advantage)
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


def build_phases(train: Train) -> dict[str, Callable]:
    """The step's own phases (``Train.phases``), each compiled on its own: ``jit(shard_map(phase))``
    over the trainer's mesh, replicated in and out (the benchmark runs on one device)."""
    if train.mesh.size != 1:
        raise ValueError(f"phase timing runs on one device; the trainer's mesh has {train.mesh.size}")

    def compiled(fn: Callable, n_args: int) -> Callable:
        specs = (PartitionSpec(),) * n_args
        return jax.jit(
            jax.shard_map(fn, mesh=train.mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False)
        )

    ph = train.phases
    return {
        "rollout": compiled(ph.rollout, 2),
        "scoring": compiled(ph.score, 3),
        "advantages": compiled(ph.advantages, 3),
        "update": compiled(ph.update, 2),
        "controller": compiled(ph.control, 3),
    }


def time_phases(train: Train, state: Any, env: Any, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median time of each phase over ``n`` calls (after one compiling call), each fed the real
    output of the previous one. Returns ``(phase seconds, phase compile+first-call seconds)``."""
    ph = build_phases(train)
    first: dict[str, float] = {}
    out: dict[str, float] = {}

    def run(name: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        res = jax.block_until_ready(ph[name](*args))
        first[name] = time.perf_counter() - t0
        out[name] = median_time(ph[name], *args, n=n, warmup=0)
        return res

    ro = run("rollout", state, env)
    sc = run("scoring", state, env, ro)
    ad = run("advantages", state, ro, sc)
    run("update", state, ad.batch)
    run("controller", state, ad.kl_ctrl, ro.mask)
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
    phases, phases_first = time_phases(train, state, env, n=max(min(len(times), 10), 2))

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
