"""Throughput of one PPO-KL iteration: time per iteration, compile time, where the time goes.

    python benchmarks/throughput.py [--workload default|peer-medium|peer-small] [--iterations N]

Progress goes to stderr; the result is one JSON object on the last line of stdout. Workloads:

* ``default``: ``RunConfig()`` on the wordclass task (pretrains or loads a cached reference;
  ``KLRL_CACHE`` is honoured).
* ``peer-medium``: GPT-2-shaped policy, 2 layers, 4 heads, width 128, vocab 256, tied
  embeddings, separate value model and frozen reward model (``klrl.tasks.peer``), 64 prompts of
  16 tokens, exactly 32 response tokens, 1 PPO epoch of 4 minibatches, fp32, k1 KL in the reward.
* ``peer-small``: the same with width 64, 8 prompt tokens and 16 response tokens.

How each number is computed: ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import argparse
import json
import time

import common


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="default", choices=common.WORKLOADS)
    ap.add_argument("--iterations", type=int, default=10, help="timed iterations (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations after compiling")
    ap.add_argument(
        "--remat", default=None, choices=("none", "block", "dots", "full"), help="set model.remat"
    )
    ap.add_argument("--logits", default=None, choices=("auto", "full", "chunked"), help="set model.logits")
    ap.add_argument("--no-phases", action="store_true", help="skip the per-phase timing (less memory)")
    args = ap.parse_args(argv)

    common.log("measuring the fp32 1024x1024 matmul rate")
    rate = common.matmul_rate(1024, reps=10)
    common.log(f"matmul: {rate / 1e9:.1f} GFLOP/s")
    t0 = time.perf_counter()
    cfg, task = common.build_workload(args.workload)
    task_s = time.perf_counter() - t0
    model = {k: v for k, v in (("remat", args.remat), ("logits", args.logits)) if v is not None}
    cfg = cfg.replace(model=model) if model else cfg
    result = common.measure(
        args.workload,
        cfg,
        task,
        iterations=args.iterations,
        warmup=args.warmup,
        peak_flops=rate,
        phases=not args.no_phases,
    )
    result["task_build_s"] = task_s
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
