"""A beta sweep as one compiled program vs the same runs one after another.

    python benchmarks/sweep.py [--members 8] [--iterations 20] [--phases]

Workload: ``RunConfig()`` defaults on the wordclass task (the reference is pretrained once or
loaded from the cache; ``KLRL_CACHE`` is honoured), on every local device; the members differ in
``kl.beta`` (log-spaced from 1e-3 to 1). Both sides run the same loop as :func:`klrl.run` and
:func:`klrl.sweep` (build, ``init``, then ``step`` per iteration with the metrics fetched to
the host one iteration behind), without writing anything:

* sequential: for each member ``make_train`` -> ``init`` -> compile -> ``iterations`` steps;
* sweep: :func:`klrl.loop.build.make_program` (``stacked=True``) -> ``init`` -> compile -> ``iterations``
  steps.

The compile is done ahead of time (``step.lower(...).compile()``) so that it is timed on its own;
one untimed ``init`` first compiles the eager ops every process pays for once (``warmup_init_s``).
``*_s`` is the wall time as a user sees it (build + init + compile + iterations); ``*_run_s``
leaves out build, init and compile. ``speedup = sequential_s / sweep_s``. ``--phases`` also times
a rollout-only and an update-only program for 1 member and for the vmapped members (where a sweep
gains or loses per iteration). Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from klrl.config import RunConfig  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed_loop(init, step, env, iterations: int) -> dict[str, Any]:
    """``init`` -> AOT compile -> ``iterations`` steps, metrics fetched one iteration behind."""
    t0 = time.perf_counter()
    state = init()
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    compiled = step.lower(state, env).compile()
    t2 = time.perf_counter()
    pending = None
    per_iter = []
    for _ in range(iterations):
        ti = time.perf_counter()
        state, metrics = compiled(state, env)
        if pending is not None:
            jax.device_get(pending)
        pending = metrics
        per_iter.append(time.perf_counter() - ti)
    jax.device_get(pending)
    jax.block_until_ready(state)
    t3 = time.perf_counter()
    return {"init_s": t1 - t0, "compile_s": t2 - t1, "run_s": t3 - t2, "state": state, "per_iter": per_iter}


def phase_times(cfg: RunConfig, task: Any, n_members: int, reps: int = 3) -> dict[str, float]:
    """Median seconds of the rollout and of the PPO update, 1 member vs ``n_members`` vmapped."""
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    from klrl.step.train import make_train

    train = make_train(cfg, task)
    ph = common.build_phases(train)
    state, env = train.init(0), task.env
    ro = jax.block_until_ready(ph["rollout"](state, env))
    batch = ph["advantages"](state, ro, ph["scoring"](state, env, ro)).batch

    def stacked(x):
        return jax.tree.map(lambda v: jnp.broadcast_to(v, (n_members, *v.shape)), x)

    # (phase, its arguments, which of them are per member)
    progs = {
        "rollout": (ph["rollout"], (state, env), (0, None)),
        "update": (ph["update"], (state, batch), (0, 0)),
    }
    out = {}
    for name, (fn, args, axes) in progs.items():
        vfn = jax.jit(jax.vmap(fn, in_axes=axes))
        vargs = tuple(stacked(a) if ax == 0 else a for a, ax in zip(args, axes, strict=True))
        out[f"{name}_1_s"] = common.median_time(fn, *args, n=reps)
        out[f"{name}_{n_members}_vmapped_s"] = common.median_time(vfn, *vargs, n=reps)
        out[f"{name}_batching_gain"] = n_members * out[f"{name}_1_s"] / out[f"{name}_{n_members}_vmapped_s"]
        log(f"phase {name}: 1 member {out[f'{name}_1_s'] * 1e3:.1f} ms, {n_members} vmapped "
            f"{out[f'{name}_{n_members}_vmapped_s'] * 1e3:.1f} ms "
            f"(gain x{out[f'{name}_batching_gain']:.2f} over {n_members} separate calls)")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=8, help="sweep members (beta values)")
    ap.add_argument("--iterations", type=int, default=20, help="PPO iterations of every run")
    ap.add_argument("--phases", action="store_true", help="also time rollout and update, 1 vs vmapped")
    args = ap.parse_args(argv)

    from klrl.loop.build import make_program
    from klrl.step.train import make_train
    from klrl.tasks.wordclass import make_task

    train_cfg = {"iterations": args.iterations, "quiet": True}
    cfg = RunConfig().replace(task={"name": "wordclass"}, train=train_cfg)
    betas = [float(b) for b in np.geomspace(1e-3, 1.0, args.members)]
    members = [cfg.replace(kl={"beta": b}) for b in betas]
    t0 = time.perf_counter()
    task = make_task(cfg, log)  # shared by both sides; not part of either time
    task_s = time.perf_counter() - t0
    env = task.env
    # the first ``init`` of a process compiles its eager ops (parameter init, optimiser state):
    # paid once, here, so that neither side below carries it
    t0 = time.perf_counter()
    jax.block_until_ready(make_train(cfg, task).init(0))
    warmup_s = time.perf_counter() - t0
    log(f"task ready in {task_s:.1f}s; {args.members} members x {args.iterations} iterations, "
        f"{jax.device_count()} device(s), {os.cpu_count()} CPU(s)")  # fmt: skip

    # ---- the sweep: one program ----
    t0 = time.perf_counter()
    prog, _ = make_program(members, task, stacked=True, write=False)
    init, step = prog.init, prog.step
    build_s = time.perf_counter() - t0
    sw = timed_loop(init, step, env, args.iterations)
    sweep_s = build_s + sw["init_s"] + sw["compile_s"] + sw["run_s"]
    log(f"sweep: build {build_s:.1f}s init {sw['init_s']:.1f}s compile {sw['compile_s']:.1f}s "
        f"run {sw['run_s']:.1f}s = {sweep_s:.1f}s")  # fmt: skip
    sweep_beta = np.asarray(jax.device_get(sw["state"].ctrl.beta))

    # ---- the same runs one after another ----
    seq = {"build_s": 0.0, "init_s": 0.0, "compile_s": 0.0, "run_s": 0.0}
    seq_beta = []
    for j, m in enumerate(members):
        t0 = time.perf_counter()
        train = make_train(m, task)
        seq["build_s"] += time.perf_counter() - t0
        r = timed_loop(lambda m=m, train=train: train.init(m.train.seed), train.step, env, args.iterations)
        for k in ("init_s", "compile_s", "run_s"):
            seq[k] += r[k]
        seq_beta.append(float(jax.device_get(r["state"].ctrl.beta)))
        log(f"run {j} (beta {m.kl.beta:.3g}): compile {r['compile_s']:.1f}s run {r['run_s']:.1f}s")
    sequential_s = sum(seq.values())
    log(f"sequential: build {seq['build_s']:.1f}s init {seq['init_s']:.1f}s compile {seq['compile_s']:.1f}s "
        f"run {seq['run_s']:.1f}s = {sequential_s:.1f}s")  # fmt: skip

    result: dict[str, Any] = {
        "benchmark": "sweep",
        "members": args.members,
        "iterations": args.iterations,
        "devices": jax.device_count(),
        "cpus": os.cpu_count(),
        "model": {k: getattr(cfg.model, k) for k in ("n_layers", "d_model", "n_heads")},
        "batch_size": cfg.train.batch_size,
        "response_len": cfg.sampling.response_len,
        "task_build_s": round(task_s, 3),
        "warmup_init_s": round(warmup_s, 3),
        "sequential_s": round(sequential_s, 3),
        "sweep_s": round(sweep_s, 3),
        "speedup": round(sequential_s / sweep_s, 3),
        "sequential_compile_s": round(seq["compile_s"], 3),
        "sweep_compile_s": round(sw["compile_s"], 3),
        "sequential_run_s": round(seq["run_s"], 3),
        "sweep_run_s": round(sw["run_s"], 3),
        "speedup_excluding_compile": round(seq["run_s"] / sw["run_s"], 3),
        "sequential_init_build_s": round(seq["init_s"] + seq["build_s"], 3),
        "sweep_init_build_s": round(sw["init_s"] + build_s, 3),
        "final_beta_max_rel_diff": float(
            np.max(np.abs(sweep_beta - np.array(seq_beta)) / np.abs(np.array(seq_beta)))
        ),
    }
    if args.phases:
        result["phases"] = phase_times(cfg, task, args.members)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
