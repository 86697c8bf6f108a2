"""LoRA against full fine-tuning on SmolLM2-135M: time per iteration, compile time, memory, FLOPs.

    python benchmarks/lora.py [--workload smollm2|tiny] [--iterations 3] [--warmup 1] [--full-sweep]
                              [--remat none|block|full]

Configurations, each measured in its own subprocess (so that the peak RSS, ``ru_maxrss``, is that
configuration's alone); the parent prints one JSON line per configuration, then one summary line:

* ``<w>-full``: the ``smollm2`` workload of ``throughput.py`` (``common.smollm2_workload``: 16 prompts x
  (32 + 32) tokens, 1 epoch x 2 minibatches, full fine-tuning, ``model.value_model=separate``);
* ``<w>-lora``: the same work with ``lora.rank=8``, ``lora.alpha=16`` (every linear layer of the blocks)
  and ``model.value_model=lora`` (the critic: its own rank-8 adapters on the same frozen base + a head);
* ``<w>-lora-sweep4``: 4 members of ``<w>-lora`` differing in ``kl.beta`` (0.01, 0.03, 0.1, 0.3), one
  compiled program (``klrl.loop.build.make_program(..., stacked=True)``); its time is the whole sweep's;
* ``<w>-full-sweep4`` (``--full-sweep`` only; ~18 GB on SmolLM2): 4 members of ``<w>-full``.

``--workload tiny`` runs the same code on ``tests/data/tiny_gguf/tiny.gguf`` (4 prompts x (8 + 8)).
Per configuration: ``iteration_s_median`` (>= 3 timed iterations after the compile and ``--warmup``
untimed ones), ``compile_s`` (AOT ``.lower().compile()``), ``peak_rss_mb`` and the RSS by stage,
``trained_params``, ``state_bytes`` (params + optimiser state), ``base_bytes`` (``ref_params``: the frozen
reference / LoRA base), and FLOPs three ways (see ``flops_note``). Progress goes to stderr; the last line
of stdout is one JSON object (the summary, with the ratios against the aims of issue 31).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import jax  # noqa: E402

from klrl.loop.hostmem import release_freed_memory  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny_gguf", "tiny.gguf")
BETAS = (0.01, 0.03, 0.1, 0.3)
LORA = {"rank": 8, "alpha": 16.0}
AIMS = {
    "lora_s_over_full_s": 0.75,
    "lora_peak_rss_gb": 2.5,
    "sweep4_peak_rss_gb": 3.5,
    "sweep4_s_over_lora_s": 3.0,
}
FLOPS_NOTE = (
    "xla_flops: compiled.cost_analysis()['flops'] (XLA counts each while-loop body once: the layer scan, "
    "decode steps and minibatches are not multiplied by their trip counts, so it is a lower bound, not "
    "comparable across programs with different loops); full_model_matmul_flops: common.iteration_flops of "
    "the full fine-tuning config for the same work (x members); lora_matmul_flops: the same with the "
    "update's backward at 1 forward instead of 2 (no weight gradients of the base) plus the adapters' "
    "matmuls (2 r (in + out) per token and adapted layer, x3 in the update)"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rss_mb() -> float:
    """Current resident set size (``/proc/self/statm``), MiB; 0 where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def tree_size(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def tree_bytes(tree: Any) -> int:
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def configs(workload: str, full_sweep: bool) -> list[str]:
    names = [f"{workload}-full", f"{workload}-lora", f"{workload}-lora-sweep4"]
    return names + ([f"{workload}-full-sweep4"] if full_sweep else [])


def base_workload(workload: str, remat: str | None):
    """``(cfg, task)``: the ``smollm2`` workload, or the same code on the tiny GGUF."""
    if workload == "tiny":
        cfg, task = common.smollm2_workload(batch=4, prompt_len=8, response_len=8, path=TINY, vocab=256)
    else:
        cfg, task = common.smollm2_workload("float32")
    return (cfg.replace(model={"remat": remat}) if remat else cfg), task


def lora_config(cfg: Any) -> Any:
    return cfg.replace(lora=LORA, model={"value_model": "lora"})


# ---- FLOPs ---------------------------------------------------------------------------------------


def adapter_flops_per_token(task: Any, rank: int) -> int:
    """Forward matmul FLOPs of the rank-``rank`` adapters on every linear layer of a Llama-family block
    (q, k, v, o, gate, up, down), per token: ``sum 2 r (in + out)`` over layers."""
    c = task.policy.config
    d, hd, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size
    pairs = [(d, hd), (d, kv), (d, kv), (hd, d), (d, inter), (d, inter), (inter, d)]
    return c.num_hidden_layers * sum(2 * rank * (i + o) for i, o in pairs)


def flop_counts(full_cfg: Any, task: Any, lora: bool, members: int, shared_reward: bool) -> dict[str, int]:
    """The matmul counts of one iteration (x ``members``): the full model's (``common.iteration_flops``
    of the full fine-tuning config) and, for LoRA, the same work with a backward of 1 forward (the
    gradient of the activations, not of the base's weights) plus the adapters (policy and critic)."""
    parts = common.iteration_flops(full_cfg, task, reward_model=False if shared_reward else None)
    out = {"full_model_matmul_flops": members * parts["total"]}
    if lora:
        b, s = full_cfg.train.batch_size, task.prompt_len + full_cfg.sampling.response_len
        fwd = parts["reference"] + parts["value"]  # one forward of policy and critic over the batch
        ad = adapter_flops_per_token(task, LORA["rank"])
        r_tokens = b * task.prompt_len + b * (full_cfg.sampling.response_len - 1)  # rollout's fed tokens
        adapters = ad * (r_tokens + b * s + 3 * full_cfg.ppo.epochs * 2 * b * s)  # rollout, critic, update
        lora_total = parts["total"] - full_cfg.ppo.epochs * fwd + adapters
        out["lora_matmul_flops"] = members * lora_total
    return out


def xla_flops(compiled: Any) -> float | None:
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 (a backend without cost analysis)
        return None
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    return float(ca["flops"]) if ca and "flops" in ca else None


# ---- one configuration (in its own process) ------------------------------------------------------


def build(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The configuration's ``init``, ``step``, ``env`` and the numbers known before compiling."""
    from klrl.loop.build import make_program
    from klrl.step.train import make_train
    from klrl.tasks.text import value_models

    t0 = time.perf_counter()
    cfg, task = base_workload(args.workload, args.remat)
    full_cfg, lora = cfg, "-lora" in name
    cfg = lora_config(cfg) if lora else cfg
    load_s = time.perf_counter() - t0
    sweep = name.endswith("-sweep4")
    train = make_train(cfg, task, **value_models(cfg, task))  # (the sweep's own is built by make_program)
    shared = bool(getattr(train.context, "reward_on_reference", False))
    if sweep:
        members = [cfg.replace(kl={"beta": b}, train={"quiet": True}) for b in BETAS]
        train = None
        prog, _ = make_program(members, task, stacked=True, write=False)
        init, step, env = prog.init, prog.step, prog.env
    else:
        init, step, env = (lambda: train.init(cfg.train.seed)), train.step, train.context.task.env
    n = len(BETAS) if sweep else 1
    return {
        "init": init, "step": step, "env": env, "cfg": cfg, "task": task, "members": n, "load_s": load_s,
        "train": train,
        "flops": flop_counts(full_cfg, task, lora, n, shared), "reward_on_reference": shared,
    }  # fmt: skip


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, init, AOT compile, ``--warmup`` + ``--iterations`` steps; RSS after each stage."""
    stages: dict[str, dict[str, float]] = {}

    def stage(s: str) -> None:
        stages[s] = {"rss_mb": round(rss_mb(), 1), "peak_rss_mb": round(common.peak_rss_mb(), 1)}
        log(f"[{name}] {s}: rss {stages[s]['rss_mb']:.0f} MiB, peak {stages[s]['peak_rss_mb']:.0f} MiB")

    stage("start")
    b = build(name, args)
    stage("built")
    state = jax.block_until_ready(b["init"]())
    stage("init")
    t0 = time.perf_counter()
    lowered = b["step"].lower(state, b["env"])
    lower_s = time.perf_counter() - t0
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    log(f"[{name}] compiled in {compile_s:.1f} s (lowering {lower_s:.1f} s)")
    ma = compiled.memory_analysis()
    stage("compiled")
    release_freed_memory()  # the compiler's freed heap, as the run loop does (klrl.loop.hostmem)
    stage("trimmed")
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, b["env"]))
    first_call_s = time.perf_counter() - t0
    stage("first_call")
    for _ in range(max(args.warmup - 1, 0)):
        state, metrics = jax.block_until_ready(compiled(state, b["env"]))
    times, cpu = [], []
    load0 = os.getloadavg()[0]
    for i in range(max(args.iterations, 1)):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = jax.block_until_ready(compiled(state, b["env"]))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        log(f"[{name}] iteration {i}: {times[-1]:.2f} s, cpu {cpu[-1]:.2f} s, rss {rss_mb():.0f} MiB")
    stage("iterations")
    skipped = float(jax.numpy.sum(metrics["guard/skipped"]))
    extra = {"load_avg_1m": [load0, os.getloadavg()[0]], "guard_skipped_last": skipped}
    if args.phases and b["train"] is not None:  # after the loop's peak (the phases are programs of their own)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        extra["phases"] = phase_cpu(name, b["train"], state, b["env"], args.phases)  # (donates state)
        stage("phases")
        state = shapes
    return report(name, args, b, state, compiled, ma, stages, times, cpu, {
        "compile_s": compile_s, "lower_s": lower_s, "first_call_s": first_call_s, **extra,
    })  # fmt: skip


def phase_cpu(name: str, train: Any, state: Any, env: Any, calls: int) -> dict[str, Any]:
    """Median process CPU seconds (``cpu_s``) over ``calls`` calls after a first one, and the compiled
    temporaries (``temp_mb``), of each of the step's phases (``Train.phases``, each compiled on its own, as
    ``benchmarks/phase_cpu.py`` does: the update's parameters and optimiser state donated and chained)."""
    from jax.sharding import PartitionSpec as P

    ph = train.phases

    def compiled(f, n, donate=()):
        sm = jax.shard_map(f, mesh=train.mesh, in_specs=(P(),) * n, out_specs=P(), check_vma=False)
        return jax.jit(sm, donate_argnums=donate)

    out: dict[str, dict[str, float]] = {"cpu_s": {}, "temp_mb": {}}

    def timed(phase, f, *a, chain=None):
        f = f.lower(*a).compile()
        ma = f.memory_analysis()
        out["temp_mb"][phase] = ma.temp_size_in_bytes / 2**20 if ma is not None else None
        res = jax.block_until_ready(f(*a))
        cpu = []
        for _ in range(max(calls, 1)):
            a = chain(res, a) if chain else a
            c0 = time.process_time()
            res = jax.block_until_ready(f(*a))
            cpu.append(time.process_time() - c0)
        out["cpu_s"][phase] = statistics.median(cpu)
        log(f"[{name}] phase {phase}: cpu {out['cpu_s'][phase]:.2f} s, temp {out['temp_mb'][phase]} MiB")
        return res

    ro = timed("rollout", compiled(ph.rollout, 2), state, env)
    sc = timed("scoring", compiled(ph.score, 3), state, env, ro)
    ad = timed("advantages", compiled(ph.advantages, 3), state, ro, sc)
    update = compiled(lambda p, o, s, b: ph.update(s._replace(params=p, opt_state=o), b), 4, donate=(0, 1))
    rest, p, o = state._replace(params=None, opt_state=None), state.params, state.opt_state
    timed("update", update, p, o, rest, ad.batch, chain=lambda res, a: (res[0], res[1], *a[2:]))
    return out


def report(name, args, b, state, compiled, ma, stages, times, cpu, extra) -> dict[str, Any]:
    """The configuration's JSON line."""
    cfg, task = b["cfg"], b["task"]
    params, opt = tree_bytes(state.params), tree_bytes(state.opt_state)
    peak = stages["iterations"]["peak_rss_mb"]  # (not the phases')
    it_s = statistics.median(times)
    flops = {**b["flops"], "xla_flops": xla_flops(compiled)}
    return {
        "config": name,
        "workload": args.workload,
        "members": b["members"],
        "lora_rank": cfg.lora.rank,
        "value_model": cfg.model.value_model,
        "model_remat": cfg.model.remat,
        "iterations_timed": len(times),
        "iteration_s_median": it_s,
        "iteration_s_all": times,
        "iteration_cpu_s_median": statistics.median(cpu),
        **extra,
        "task_load_s": b["load_s"],
        "peak_rss_mb": peak,
        "peak_rss_gb": peak * 2**20 / 1e9,
        "rss_by_stage_mb": stages,
        "compiled_mb": {
            k: getattr(ma, f"{k}_size_in_bytes") / 2**20 for k in ("argument", "output", "alias", "temp")
        }
        if ma is not None
        else None,
        "trained_params": tree_size(state.params),
        "params_bytes": params,
        "opt_state_bytes": opt,
        "state_bytes": params + opt,
        "base_bytes": tree_bytes(state.ref_params),
        "env_bytes": tree_bytes(b["env"]),
        **flops,
        "matmul_flops_per_s": (flops.get("lora_matmul_flops") or flops["full_model_matmul_flops"]) / it_s,
        "flops_note": FLOPS_NOTE,
        "reward_on_reference": b["reward_on_reference"],
        "batch": cfg.train.batch_size,
        "prompt_len": task.prompt_len,
        "response_len": cfg.sampling.response_len,
        "cpu": common.cpu_model(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
    }


# ---- the parent: one subprocess per configuration, then the ratios ---------------------------------


def run_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--workload", args.workload,
           "--iterations", str(args.iterations), "--warmup", str(args.warmup)]  # fmt: skip
    if args.remat:
        cmd += ["--remat", args.remat]
    if args.phases:
        cmd += ["--phases", str(args.phases)]
    log(f"=== {name}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # stderr: progress, passed on
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"config": name, "error": f"exit status {proc.returncode}"}
    return json.loads(lines[-1])


def summary(rows: dict[str, dict[str, Any]], workload: str) -> dict[str, Any]:
    """The issue's ratios against their aims (None where a configuration failed)."""
    full, lora = rows.get(f"{workload}-full", {}), rows.get(f"{workload}-lora", {})
    sweep = rows.get(f"{workload}-lora-sweep4", {})

    def ratio(a: dict, b: dict, key: str = "iteration_s_median") -> float | None:
        return a[key] / b[key] if key in a and key in b else None

    got = {
        "lora_s_over_full_s": ratio(lora, full),
        "lora_peak_rss_gb": lora.get("peak_rss_gb"),
        "sweep4_peak_rss_gb": sweep.get("peak_rss_gb"),
        "sweep4_s_over_lora_s": ratio(sweep, lora),
    }
    out: dict[str, Any] = {"benchmark": "lora", "workload": workload, "configs": list(rows)}
    for k, v in got.items():
        out[k] = v
        out[f"{k}_aim"] = AIMS[k]
        out[f"{k}_met"] = None if v is None else v <= AIMS[k]
    # process CPU seconds per iteration: less sensitive than wall time to other processes on the machine
    cpu = "iteration_cpu_s_median"
    out["lora_cpu_over_full_cpu"] = ratio(lora, full, cpu)
    out["sweep4_cpu_over_lora_cpu"] = ratio(sweep, lora, cpu)
    out["full_peak_rss_gb"] = full.get("peak_rss_gb")
    out["full_sweep4_peak_rss_gb"] = rows.get(f"{workload}-full-sweep4", {}).get("peak_rss_gb")
    out["seconds"] = {k: r.get("iteration_s_median") for k, r in rows.items()}
    out["errors"] = {k: r["error"] for k, r in rows.items() if "error" in r}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations after compiling (>= 1)")
    ap.add_argument(
        "--remat", default=None, choices=("none", "block", "dots", "full"), help="set model.remat"
    )
    ap.add_argument("--full-sweep", action="store_true", help="also a 4-member full fine-tuning sweep")
    ap.add_argument("--phases", type=int, default=0, help="also N calls of each phase (CPU s; not sweeps)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one configuration, this process
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args)), flush=True)
        return 0
    rows = {}
    for name in configs(args.workload, args.full_sweep):
        rows[name] = run_child(name, args)
        print(json.dumps(rows[name]), flush=True)
    out = summary(rows, args.workload)
    print(json.dumps(out), flush=True)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
