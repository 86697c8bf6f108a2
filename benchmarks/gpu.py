"""GPU throughput of a GPT-2-small-sized policy in bf16 (one script, a few minutes).

    python benchmarks/gpu.py [--iterations N] [--budget-s S]

Workload (the peer setup of ``throughput.py`` scaled up, ``klrl.tasks.peer``): policy of 12
layers, 12 heads, width 768, vocabulary 50304 (GPT-2's 50257 padded to a multiple of 64, as is
usual for tensor cores), tied embeddings, ``ModelConfig(dtype='bfloat16')`` (parameters and
optimiser in float32, compute in bf16); separate value model and frozen reward model of the same
shape; 128 prompts of 64 random tokens, exactly 128 response tokens; 1 PPO epoch of 4 minibatches;
k1 KL in the reward.

Reports (last stdout line, JSON): the iteration time, the rollout's generated tokens/s (from the
separately compiled rollout phase, and over the whole iteration), and the update phase's model
FLOP utilisation ``update_mfu`` = matmul FLOPs of the update (``3 x`` forward of policy and value
model over the batch) / update phase time / the chip's measured bf16 matmul rate (an 8192 x 8192
bf16 ``jnp.dot``, measured at the start). Everything else is as in ``throughput.py``
(``benchmarks/NOTES.md``).

Without a GPU it prints ``{"skipped": "no gpu", ...}`` and exits 0. ``--cpu-smoke`` runs the same
code on a tiny bf16 model on whatever backend there is (to test this script without a GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp


def gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend (CPU-only jaxlib, or no device visible)
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10, help="timed iterations (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations after compiling")
    ap.add_argument(
        "--budget-s", type=float, default=60.0, help="stop the timed loop early once it has run this long"
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on any backend (tests this script)")
    args = ap.parse_args(argv)
    if not gpus() and not args.cpu_smoke:
        print(json.dumps({"skipped": "no gpu", "backend": jax.default_backend()}), flush=True)
        return 0

    import common

    from klrl.tasks.peer import make_peer_task

    t_start = time.perf_counter()
    if args.cpu_smoke:
        shape = dict(n_layers=2, n_heads=4, d_model=64, prompt_len=8, response_len=8, batch=16)
        vocab, mm_n, name = 512, 512, "gpu-smoke-bf16"
    else:
        shape = dict(n_layers=12, n_heads=12, d_model=768, prompt_len=64, response_len=128, batch=128)
        vocab, mm_n, name = 50304, 8192, "gpt2-small-bf16"
    cfg = common.peer_config(dtype="bfloat16", **shape)

    common.log(f"measuring the bf16 {mm_n}x{mm_n} matmul rate")
    rate = common.matmul_rate(mm_n, jnp.bfloat16, reps=20)
    common.log(f"bf16 matmul: {rate / 1e12:.1f} TFLOP/s")
    t0 = time.perf_counter()
    task = make_peer_task(cfg, prompt_len=cfg.task.prompt_len, vocab=vocab)
    task_s = time.perf_counter() - t0
    res = common.measure(
        name, cfg, task, iterations=args.iterations, warmup=args.warmup, peak_flops=rate,
        time_budget_s=args.budget_s,
    )  # fmt: skip
    b, r = cfg.train.batch_size, cfg.sampling.response_len
    ph, fl = res["phases_s"], res["flops_by_part"]
    res.update(
        task_build_s=task_s,
        vocab=vocab,
        bf16_matmul_flops_per_s=rate,
        rollout_tokens_per_s=b * r / ph["rollout"],
        update_flops=fl["update"],
        update_flops_per_s=fl["update"] / ph["update"],
        update_mfu=fl["update"] / ph["update"] / rate,
        script_s=time.perf_counter() - t_start,
    )
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
