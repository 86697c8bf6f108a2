"""Issue 49 in one process and one JSON: full vs LoRA iterations at defaults, interleaved; the machine's
matmul rate and memory bandwidth; the rollout against its floor; the full iteration's share of the
matmul rate; the LoRA step's base-gradient check.

    python benchmarks/speed.py [--workload smollm2|tiny] [--rounds N] [--batch B] [--response-len R]

What it does, in one process (so that every ratio is read on the same machine in the same minutes):

1. probes: the fp32 1024 x 1024 ``jnp.dot`` (``2 n^3`` FLOPs over the median of 10 calls) and the
   memory bandwidth: a jitted sum over a 256 MiB float32 array (bytes read / median time; ``read``) and
   ``x * a + b`` over it (bytes read + written / median time; ``copy``). Repeated at the end; both
   reported;
2. the ``smollm2`` workload (``common.smollm2_workload``: SmolLM2-135M-Instruct fp32, 16 prompts x (32 +
   32), separate value model, 1 epoch x 2 minibatches) at default settings, full fine-tuning, and the
   same with ``lora.rank=8, lora.alpha=16, model.value_model=lora`` (``benchmarks/lora.py``'s
   ``smollm2-lora``); both steps AOT-compiled, one warm-up call each, then ``--rounds`` rounds of
   (full iteration, LoRA iteration, full rollout phase, LoRA rollout phase), wall and process-CPU
   seconds, min and median;
3. the rollout's floor (:func:`rollout_floor`): per decode step ``max(FLOPs / matmul rate, bytes read /
   read bandwidth)`` with the bytes every weight once (the tied LM head's embedding included) plus the
   KV cache's ``S`` slots of every layer (as the decode reads them, masked), and the prefill's
   ``max(FLOPs / rate, weight bytes / bandwidth)``; ``rollout_over_floor`` = the rollout phase's median
   over it;
4. ``full_flop_share``: the full iteration's matmul FLOPs (``common.iteration_flops``; the reward read
   from the reference's forward when the step does so) over its median time, over the matmul rate;
5. ``lora_base_gradient_dots``: the dots of the LoRA step's jaxpr whose output is a base kernel's
   ``[in, out]`` and which contract the tokens (not a kernel's width, not the rank: the adapters folded
   into the base for the rollout contract the rank); the same count for full
   fine-tuning, which has one per kernel; and the optimiser state's bytes of both.

Progress on stderr; the result is one JSON object on the last line of stdout. ``--workload tiny`` runs the
same code on ``tests/data/tiny_gguf`` (the benchmarks' smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

import common
import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny_gguf", "tiny.gguf")
LORA = {"rank": 8, "alpha": 16.0}


def bandwidth(mib: int = 256, reps: int = 10) -> dict[str, float]:
    """Bytes per second over ``mib`` MiB of float32: a jitted sum (``read``), ``x * a + b`` (``copy``:
    read + write) and a matrix times 16 vectors, ``[n, n] @ [n, 16]`` (``gemv``: the matrix read once,
    the shape of a decode step's matmuls at batch 16)."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    n = int(math.isqrt(x.size))
    m, v = x[: n * n].reshape(n, n), jnp.ones((n, 16), jnp.float32)
    nbytes = x.size * 4
    return {
        "read": nbytes / common.median_time(jax.jit(jnp.sum), x, n=reps, warmup=2),
        "copy": 2 * nbytes / common.median_time(jax.jit(lambda a: a * 1.0001 + 0.5), x, n=reps, warmup=2),
        "gemv": n * n * 4 / common.median_time(jax.jit(jnp.dot), m, v, n=reps, warmup=2),
    }


def probes() -> dict[str, float]:
    rate = common.matmul_rate(1024, reps=10)
    bw = bandwidth()
    common.log(
        f"matmul {rate / 1e9:.1f} GFLOP/s, bandwidth GB/s "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items())
    )
    return {"matmul_flops_per_s": rate, **{f"{k}_bytes_per_s": v for k, v in bw.items()}}


def tree_bytes(tree: Any) -> int:
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def rollout_floor(cfg, task, weight_bytes: int, rate: float, bw: float) -> dict[str, float]:
    """The rollout's floor: the prefill (``B P`` tokens, the LM head on the last slot) and ``R - 1`` decode
    steps of ``B`` tokens, each ``max(matmul FLOPs / rate, bytes / bw)``; a decode step reads every weight
    once and the KV cache's ``L x B x Hkv x S x Dh`` keys and values."""
    c, v = task.policy.config, task.policy.vocab_size
    b, p, r = cfg.train.batch_size, task.prompt_len, cfg.sampling.response_len
    s = p + r
    prefill_fl = common.llama_matmul_flops(c, v, b * p, p, lm_head=False) + 2 * c.hidden_size * v * b
    prefill = max(prefill_fl / rate, weight_bytes / bw)
    kv = 2 * c.num_hidden_layers * b * c.num_key_value_heads * s * c.head_dim * 4
    steps, flops, nbytes = [], prefill_fl, weight_bytes
    for t in range(r - 1):
        fl = common.llama_matmul_flops(c, v, b, p + t + 1)
        steps.append(max(fl / rate, (weight_bytes + kv) / bw))
        flops, nbytes = flops + fl, nbytes + weight_bytes + kv
    bound = "memory" if (weight_bytes + kv) / bw > common.llama_matmul_flops(c, v, b, s) / rate else "matmul"
    return {
        "floor_s": prefill + sum(steps),
        "prefill_floor_s": prefill,
        "decode_step_floor_s": statistics.median(steps),
        "decode_bound_by": bound,
        "flops": float(flops),
        "bytes_read": float(nbytes),
        "decode_step_bytes": float(weight_bytes + kv),
        "decode_step_flops": float(common.llama_matmul_flops(c, v, b, p + r // 2)),
    }


def base_gradient_dots(train, state, env, kernels: set, rank: int) -> int:
    """Dots of the step's jaxpr with a base kernel's output shape (sorted) that contract neither a kernel's
    width (a forward or an input gradient does) nor ``rank`` (the adapters folded into the base): a weight
    gradient, which contracts the tokens."""
    from jax.extend import core as jcore

    dims = {d for k in kernels for d in k} | {rank}  # a forward or input-gradient dot contracts one

    def walk(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                size = math.prod(eqn.invars[0].aval.shape[i] for i in contract)
                shape = tuple(eqn.outvars[0].aval.shape)
                n += len(shape) == 2 and tuple(sorted(shape)) in kernels and size not in dims
            for prm in eqn.params.values():
                for sub in prm if isinstance(prm, tuple | list) else (prm,):
                    if isinstance(sub, jcore.ClosedJaxpr):
                        n += walk(sub.jaxpr)
                    elif isinstance(sub, jcore.Jaxpr):
                        n += walk(sub)
        return n

    return walk(jax.make_jaxpr(train.step)(state, env).jaxpr)


def kernel_shapes(params) -> set:
    """``(in, out)`` sorted of every dense kernel (per layer: a scanned ``[L, in, out]`` counts as
    ``[in, out]``)."""
    out = set()
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if str(getattr(path[-1], "key", "")) == "kernel" and x.ndim >= 2:
            out.add(tuple(sorted(x.shape[-2:])))
    return out


def workload(args) -> tuple:
    if args.workload == "tiny":
        return common.smollm2_workload(batch=4, prompt_len=8, response_len=8, path=TINY, vocab=256)
    return common.smollm2_workload("float32", args.batch, args.prompt_len, args.response_len)


def compile_step(name: str, train, state, env):
    t0 = time.perf_counter()
    c = train.step.lower(state, env).compile()
    common.log(f"[{name}] compiled in {time.perf_counter() - t0:.1f} s")
    ma = c.memory_analysis()
    return c, (ma.temp_size_in_bytes if ma is not None else None)


def main(argv: list[str] | None = None) -> int:
    from klrl.loop.hostmem import release_freed_memory
    from klrl.step.train import make_train
    from klrl.tasks.text import value_models

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (min and median reported)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=32)
    args = ap.parse_args(argv)

    load0 = os.getloadavg()[0]
    before = probes()
    cfg, task = workload(args)
    lcfg = cfg.replace(lora=LORA, model={"value_model": "lora"})
    full = make_train(cfg, task, **value_models(cfg, task))
    lora = make_train(lcfg, task, **value_models(lcfg, task))
    env = task.env
    s_full, s_lora = full.init(cfg.train.seed), lora.init(cfg.train.seed)
    kernels = kernel_shapes(task.policy_params)
    grad_dots = {
        "lora_base_gradient_dots": base_gradient_dots(lora, s_lora, env, kernels, LORA["rank"]),
        "full_base_gradient_dots": base_gradient_dots(full, s_full, env, kernels, LORA["rank"]),
    }
    common.log(f"base-kernel-shaped gradient dots: {grad_dots}")
    state_bytes = {
        "full_opt_state_bytes": tree_bytes(s_full.opt_state),
        "lora_opt_state_bytes": tree_bytes(s_lora.opt_state),
        "lora_trained_bytes": tree_bytes(s_lora.params),
        "base_bytes": tree_bytes(s_lora.ref_params),
        "lora_base_is_the_loaded_arrays": [
            x.unsafe_buffer_pointer() for x in jax.tree.leaves(s_lora.ref_params)
        ]
        == [x.unsafe_buffer_pointer() for x in jax.tree.leaves(task.policy_params)],
    }
    c_full, temp_full = compile_step("full", full, s_full, env)
    c_lora, temp_lora = compile_step("lora", lora, s_lora, env)
    r_full = common.build_phases(full)["rollout"].lower(s_full, env).compile()
    r_lora = common.build_phases(lora)["rollout"].lower(s_lora, env).compile()
    release_freed_memory()
    states = {"full": s_full, "lora": s_lora}
    steps = {"full": c_full, "lora": c_lora}
    calls = ["full", "lora", "rollout_full", "rollout_lora"]
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for rnd in range(args.rounds + 1):  # round 0: warm-up
        for k in calls:
            t0, c0 = time.perf_counter(), time.process_time()
            if k in steps:
                states[k], _ = jax.block_until_ready(steps[k](states[k], env))
            else:
                which = k.split("_")[1]
                jax.block_until_ready((r_full if which == "full" else r_lora)(states[which], env))
            if rnd:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        if rnd:
            common.log(f"round {rnd}: " + ", ".join(f"{k} {wall[k][-1]:.2f} s" for k in calls))
    after = probes()
    out = report(args, cfg, task, full, before, after, wall, cpu, state_bytes, grad_dots)
    out.update(
        {"temp_bytes": {"full": temp_full, "lora": temp_lora}, "load_avg_1m": [load0, os.getloadavg()[0]]}
    )
    print(json.dumps(out), flush=True)
    return 0


def report(args, cfg, task, full, before, after, wall, cpu, state_bytes, grad_dots) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in wall.items()}
    rate = max(before["matmul_flops_per_s"], after["matmul_flops_per_s"])
    bw = max(p[f"{k}_bytes_per_s"] for p in (before, after) for k in ("read", "copy", "gemv"))
    shared = bool(full.context.reward_on_reference)
    flops = common.iteration_flops(cfg, task, reward_model=False if shared else None)
    floor = rollout_floor(cfg, task, tree_bytes(task.policy_params), rate, bw)
    pairs = [lo / fu for fu, lo in zip(wall["full"], wall["lora"], strict=True)]
    return {
        "benchmark": "speed",
        "workload": args.workload,
        "batch": cfg.train.batch_size,
        "prompt_len": task.prompt_len,
        "response_len": cfg.sampling.response_len,
        "rounds": args.rounds,
        "probes_before": before,
        "probes_after": after,
        "matmul_flops_per_s": rate,
        "read_bytes_per_s": bw,
        "seconds": {k: {"min": min(v), "median": med[k], "all": v} for k, v in wall.items()},
        "cpu_seconds": {k: {"min": min(v), "median": statistics.median(v)} for k, v in cpu.items()},
        "lora_over_full": med["lora"] / med["full"],
        "lora_over_full_min": min(wall["lora"]) / min(wall["full"]),
        "lora_over_full_per_round": pairs,
        "lora_over_full_cpu": statistics.median(cpu["lora"]) / statistics.median(cpu["full"]),
        "full_flops": flops["total"],
        "full_flop_share": flops["total"] / med["full"] / rate,
        "full_flop_share_best": flops["total"] / min(wall["full"]) / rate,
        "rollout_floor": floor,
        "rollout_over_floor": med["rollout_full"] / floor["floor_s"],
        "rollout_over_floor_best": min(wall["rollout_full"]) / floor["floor_s"],
        "rollout_lora_over_floor": med["rollout_lora"] / floor["floor_s"],
        **grad_dots,
        **state_bytes,
        "reward_on_reference": shared,
        "cpu": common.cpu_model(),
        "jax": jax.__version__,
    }


if __name__ == "__main__":
    raise SystemExit(main())
