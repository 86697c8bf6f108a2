"""Process CPU time of each stage of the step, with the update donated and chained (low memory).

    python benchmarks/phase_cpu.py [--workload smollm2] [--remat none|block|full] [--calls 2]

The stages are the step's own (``Train.phases``), each compiled on its own as in ``common.time_phases``,
but timed by process CPU seconds (all threads; less sensitive to other processes than wall time) as well
as wall time, median of ``--calls`` calls after a compiling one. The update's parameters and optimiser
state are donated and each call is fed the previous call's result (as a training loop would), so the
process holds the train state once plus one stage's temporaries: it fits where ``throughput.py``'s phase
timing (non-donated outputs: a second copy of parameters and Adam state) does not. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import common
import jax
from jax.sharding import PartitionSpec as P

from klrl.step.train import make_train
from klrl.tasks.text import value_models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="smollm2", choices=common.WORKLOADS)
    ap.add_argument("--remat", default=None, choices=("none", "block", "dots", "full"))
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args(argv)
    cfg, task = common.build_workload(args.workload)
    cfg = cfg.replace(model={"remat": args.remat}) if args.remat else cfg
    train = make_train(cfg, task, **value_models(cfg, task))
    state, env, ph = train.init(cfg.train.seed), task.env, train.phases

    def compiled(f, n, donate=()):
        sm = jax.shard_map(f, mesh=train.mesh, in_specs=(P(),) * n, out_specs=P(), check_vma=False)
        return jax.jit(sm, donate_argnums=donate)

    out: dict = {"workload": args.workload, "cpu_s": {}, "wall_s": {}, "first_call_s": {}}

    def timed(name, f, *a, chain=None):
        t0 = time.perf_counter()
        res = jax.block_until_ready(f(*a))
        out["first_call_s"][name] = time.perf_counter() - t0
        cpu, wall = [], []
        for _ in range(max(args.calls, 1)):
            a = chain(res, a) if chain else a
            t0, c0 = time.perf_counter(), time.process_time()
            res = jax.block_until_ready(f(*a))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out["cpu_s"][name], out["wall_s"][name] = statistics.median(cpu), statistics.median(wall)
        common.log(f"{name}: cpu {out['cpu_s'][name]:.2f} s, wall {out['wall_s'][name]:.2f} s")
        return res

    ro = timed("rollout", compiled(ph.rollout, 2), state, env)
    sc = timed("scoring", compiled(ph.score, 3), state, env, ro)
    ad = timed("advantages", compiled(ph.advantages, 3), state, ro, sc)
    update = compiled(lambda p, o, s, b: ph.update(s._replace(params=p, opt_state=o), b), 4, donate=(0, 1))
    rest, p, o = state._replace(params=None, opt_state=None), state.params, state.opt_state
    del state
    timed("update", update, p, o, rest, ad.batch, chain=lambda res, a: (res[0], res[1], *a[2:]))
    out.update(
        cpu_sum_s=sum(out["cpu_s"].values()), peak_rss_mb=common.peak_rss_mb(),
        load_avg_1m=os.getloadavg()[0], model_remat=cfg.model.remat, cpu=common.cpu_model(),
        logits_path="chunked" if train.context.chunked else "full",
    )  # fmt: skip
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
