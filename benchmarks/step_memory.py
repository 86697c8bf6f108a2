"""Where the step's memory goes: the compiled program's buffers and the process's RSS by stage.

    python benchmarks/step_memory.py [--workload smollm2] [--steps 2] [--compile-only]
                                     [--remat MODE] [--no-trim]

Builds the workload, the train state, compiles the step (``memory_analysis()``: arguments, outputs,
donated aliases and temporaries of the one compiled iteration), hands the compiler's freed heap
back (:func:`klrl.loop.hostmem.release_freed_memory`, as the run loop does; ``--no-trim``: not) and runs
``--steps`` steps, printing the resident set size (``/proc/self/statm``) and the peak
(``ru_maxrss``) after each stage and the train state's bytes by field; for each step also its wall
and process-CPU seconds, its minor page faults and system seconds (the pages it touches for the
first time: the temporaries are mapped anew on every call). ``--compile-only`` compiles from
``jax.eval_shape`` of the state (nothing allocated for it) and skips the steps. Prints one JSON
line; sizes in GiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import common
import jax

from klrl.loop.hostmem import release_freed_memory
from klrl.step.train import make_train
from klrl.tasks.text import value_models

GIB = 2**30


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * resource.getpagesize() / GIB, 3)


def peak_gib() -> float:
    return round(common.peak_rss_mb() / 1024, 3)


def tree_gib(tree) -> float:
    return round(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / GIB, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="smollm2", choices=common.WORKLOADS)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-trim", action="store_true", help="keep the compiler's freed heap (no malloc_trim)")
    ap.add_argument(
        "--remat", default=None, choices=("none", "block", "dots", "full"), help="set model.remat"
    )
    args = ap.parse_args(argv)
    out: dict = {"workload": args.workload, "stages": {}}

    def stage(name: str) -> None:
        out["stages"][name] = {"rss_gib": rss_gib(), "peak_rss_gib": peak_gib()}
        common.log(f"[{name}] rss {rss_gib()} GiB, peak {peak_gib()} GiB")

    cfg, task = common.build_workload(args.workload)
    cfg = cfg.replace(model={"remat": args.remat}) if args.remat else cfg
    out["model_remat"] = cfg.model.remat
    stage("workload")
    train = make_train(cfg, task, **value_models(cfg, task))
    env = train.context.task.env
    if args.compile_only:
        state = jax.eval_shape(lambda: train.init(cfg.train.seed))
    else:
        state = jax.block_until_ready(train.init(cfg.train.seed))
        stage("init")
    out["state_gib"] = {k: tree_gib(getattr(state, k)) for k in state._fields}
    out["env_gib"] = tree_gib(env)
    t0 = time.perf_counter()
    compiled = train.step.lower(state, env).compile()
    out["compile_s"] = round(time.perf_counter() - t0, 1)
    ma = compiled.memory_analysis()
    out["compiled_gib"] = {
        "arguments": round(ma.argument_size_in_bytes / GIB, 3),
        "outputs": round(ma.output_size_in_bytes / GIB, 3),
        "aliased": round(ma.alias_size_in_bytes / GIB, 3),
        "temporaries": round(ma.temp_size_in_bytes / GIB, 3),
    }
    if not args.no_trim:
        release_freed_memory()  # the compiler's freed heap, as the run loop does (klrl.loop.hostmem)
    stage("compiled")
    if not args.compile_only:
        for i in range(args.steps):
            r0, t0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
            state, metrics = jax.block_until_ready(compiled(state, env))
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            stage(f"step{i}")
            out["stages"][f"step{i}"].update(
                wall_s=round(time.perf_counter() - t0, 2), cpu_s=round(time.process_time() - c0, 2),
                minor_faults=r1.ru_minflt - r0.ru_minflt, system_s=round(r1.ru_stime - r0.ru_stime, 2),
            )  # fmt: skip
    out["cpu"] = common.cpu_model()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
