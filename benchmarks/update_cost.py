"""Where the PPO update's time goes, against the scoring's rate and the matmul rate, in one
interleaved run (issue 38, item 7).

    python benchmarks/update_cost.py [--workload smollm2] [--remat block,dots,none,full] [--rounds N]

One process builds the workload once, runs one rollout, scoring and advantage stage for its batch,
then compiles, for every ``--remat`` mode, the update phase (``Train.phases.update``: epochs x
minibatches, as the step runs it; ``update`` with fresh outputs, ``update_donated`` with the
parameters and Adam state donated, as the step donates them) and its two halves on their own: the
gradient of one minibatch (``jax.grad`` of ``Train.loss``, policy and value model) and one optimiser
step (clip, Adam, the update applied; the gradient a constant; ``opt_step`` fresh outputs,
``opt_step_donated`` donated); and once the scoring phase, one forward of the policy over one
minibatch, the reference's forward over the batch and the 1024 x 1024 fp32 matmul. It then times
them round-robin, ``--rounds`` rounds (one call of each per round, medians reported), so that the
ratios are read within one run on a machine whose speed drifts.

FLOPs: XLA's own count (``compiled.cost_analysis()['flops']``: every dot's ``2 m n k`` plus the
elementwise operations, as compiled, i.e. with the rematerialisation's recomputation) and the
benchmarks' matmul count (``common.iteration_flops``: 3 forwards for forward + backward, no
recomputation). The floor of a part is its XLA dot FLOPs over the matmul rate measured in the same run.

Progress goes to stderr; the result is one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common
import jax
import jax.numpy as jnp

from klrl.models.base import forward
from klrl.step.context import coefs


def executed_flops(cfg, task, mode: str) -> dict[str, float]:
    """Matmul FLOPs as this workload executes them (by hand; ``cost_analysis`` counts a scanned
    layer once): trunks over all ``B (P + R)`` positions, the (chunked) LM head over the ``B R``
    response positions only; the update = epochs x (forward + backward = 3 forwards of policy and
    value trunk and head) + the head's forward again (its chunks are checkpointed) + the recomputation
    of ``mode``: ``block`` the attention's two batched dots, ``dots``/``none`` nothing, ``full`` both
    trunks' forward."""
    c, v = task.policy.config, task.policy.vocab_size
    b, p, r = cfg.train.batch_size, task.prompt_len, cfg.sampling.response_len
    s = p + r
    trunk = common.llama_matmul_flops(c, v, b * s, s, lm_head=False)
    head = 2 * c.hidden_size * v * b * r
    attn = c.num_hidden_layers * 2 * 2 * c.num_attention_heads * c.head_dim * s * b * s
    recompute = {"block": 2 * attn, "dots": 0, "none": 0, "full": 2 * trunk}[mode]
    update = cfg.ppo.epochs * (3 * (2 * trunk + head) + head + recompute)
    return {"update": float(update), "scoring": float(2 * trunk + head), "trunk_forward": float(trunk),
            "head_forward": float(head)}  # fmt: skip


def profile_ops(compiled, args: tuple, where: str) -> dict:
    """One traced call of ``compiled`` (``jax.profiler.trace`` into ``where``, a Perfetto trace);
    the XLA ops' time grouped by (matmul or not, forward or backward, the module the HLO's
    ``op_name`` names: ``gate_proj``, ``jit(silu)``...), in seconds, largest first."""
    import collections
    import glob
    import gzip
    import re
    import shutil

    meta = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r'\s*%?([\w.\-]+) = .*?op_name="([^"]*)"', line)
        if m:
            meta[m.group(1)] = m.group(2)
    shutil.rmtree(where, ignore_errors=True)
    with jax.profiler.trace(where, create_perfetto_trace=True):
        jax.block_until_ready(compiled(*args))
    events = json.load(gzip.open(glob.glob(f"{where}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    skip = ("ThunkExecutor", "$", "SlinkyThreadPool", "while", "call", "conditional")
    by_kind: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(skip):
            continue
        op = meta.get(name, "")
        kind = "matmul" if name.startswith(("ynn_fusion", "dot")) else "other"
        phase = "backward" if "transpose(jvp" in op else ("forward" if "jvp(" in op else "outside")
        part = op.split("layers/", 1)[1].split("/")[0] if "layers/" in op else op.split("/")[-1][:40]
        by_kind[f"{kind}/{phase}"] += e["dur"] / 1e6
        by_op[f"{kind}/{phase}/{part}"] += e["dur"] / 1e6
    return {
        "op_s_total": sum(by_kind.values()),
        "by_kind_s": dict(by_kind.most_common()),
        "by_op_s": {k: v for k, v in by_op.most_common(25)},
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="smollm2", choices=(*common.WORKLOADS, "smollm2-smoke"))
    ap.add_argument("--remat", default="block,dots,none", help="comma-separated model.remat modes")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    ap.add_argument(
        "--parts",
        default="update,update_donated,grad,opt,score,fwd",
        help="what to time besides the matmul (update_donated: params and Adam state donated, "
        "as the step runs the update; opt: the optimiser step, plain and donated)",
    )
    ap.add_argument("--profile", default="", help="trace one call of this part (e.g. 'grad_mb[block]')")
    return ap.parse_args(argv)


def workload(name: str) -> tuple:
    """``(cfg, task)`` of ``name`` (``smollm2-smoke``: the same code path on the tests' tiny GGUF)."""
    if name != "smollm2-smoke":
        return common.build_workload(name)
    from gpu import TINY_GGUF

    from klrl.models.pretrained import from_pretrained

    vocab = from_pretrained(TINY_GGUF, tokenizer=False)[0].vocab_size
    return common.smollm2_workload(path=str(TINY_GGUF), vocab=vocab, batch=8, prompt_len=8, response_len=8)


class Parts:
    """The compiled parts (``name -> (compiled, args)``), their compile-time facts (``info``) and, for a
    donated part, how its output becomes the next call's arguments (``feeds``)."""

    def __init__(self):
        self.fns: dict[str, tuple] = {}
        self.feeds: dict[str, object] = {}
        self.info: dict[str, dict] = {}

    def add(self, name, jitted, *a, feed=None):
        t0 = time.perf_counter()
        c = jitted.lower(*a).compile()
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        mem = c.memory_analysis()
        self.fns[name] = (c, a)
        if feed is not None:
            self.feeds[name] = feed
        self.info[name] = {
            "compile_s": time.perf_counter() - t0,
            "xla_flops": float(ca.get("flops", 0.0)),
            "xla_bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "temp_gib": mem.temp_size_in_bytes / 2**30 if mem is not None else None,
        }
        common.log(f"compiled {name}: {self.info[name]}")

    def time(self, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Wall and CPU seconds of each part, round-robin, after a warm-up round."""
        times: dict[str, list[float]] = {k: [] for k in self.fns}
        cpu: dict[str, list[float]] = {k: [] for k in self.fns}
        for r in range(rounds + 1):  # round 0: a warm-up call of each
            for name, (c, a_) in self.fns.items():
                t0, c0 = time.perf_counter(), time.process_time()
                out_ = jax.block_until_ready(c(*a_))
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if name in self.feeds:
                    self.fns[name] = (c, self.feeds[name](a_, out_))
                del out_
                if r:
                    times[name].append(dt)
                    cpu[name].append(dc)
            common.log(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items() if v))
        return times, cpu


def add_shared(parts: Parts, which: set[str], ph: dict, ctx, state, env, ro, mb) -> None:
    """The 1024 x 1024 matmul, the scoring phase and one policy forward over a minibatch."""
    n = 1024
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    b = jax.random.normal(kb, (n, n), jnp.float32)
    parts.add("matmul", jax.jit(jnp.dot), a, b)
    parts.info["matmul"]["xla_flops"] = 2.0 * n**3
    if "score" in which:
        parts.add("scoring", ph["scoring"], state, env, ro)
    if "fwd" in which:

        def policy_fwd(p, t, m):
            return forward(ctx.models.policy, p, t, m, logits=False).hidden

        parts.add("policy_fwd_mb", jax.jit(policy_fwd), state.params["policy"], mb.tokens, mb.key_mask)


def add_update(parts: Parts, which: set[str], mode: str, tr, state, batch) -> None:
    """The update phase of ``mode`` with fresh outputs and donated."""
    if "update" in which:
        parts.add(f"update[{mode}]", common.build_phases(tr)["update"], state, batch)
    if "update_donated" in which:  # as the step runs it: parameters and Adam state donated
        from jax.sharding import PartitionSpec

        def upd(params, opt_state, rest, batch_, _ph=tr.phases):
            return _ph.update(rest._replace(params=params, opt_state=opt_state), batch_)

        spec = (PartitionSpec(),) * 4
        sm = jax.shard_map(upd, mesh=tr.mesh, in_specs=spec, out_specs=PartitionSpec(), check_vma=False)
        rest = state._replace(params=None, opt_state=None)
        own = jax.tree.map(jnp.copy, (state.params, state.opt_state))
        parts.add(f"update_donated[{mode}]", jax.jit(sm, donate_argnums=(0, 1)), *own, rest, batch,
                  feed=lambda a_, out: (out[0], out[1], *a_[2:]))  # fmt: skip


def add_halves(
    parts: Parts, which: set[str], mode: str, c, state, mb, n_tok, n_seq, beta_l, opt: bool
) -> None:
    """One minibatch's gradient of ``mode`` and (``opt``) one optimiser step, fresh and donated."""
    if "grad" in which:
        from klrl.step.update import ppo_loss

        def loss(params, mb_, n_tok_, n_seq_, beta_, ref, _c=c):
            return ppo_loss(_c, params, mb_, n_tok_, n_seq_, beta_, ref_params=ref)

        g = jax.jit(jax.grad(loss, has_aux=True))
        parts.add(f"grad_mb[{mode}]", g, state.params, mb, n_tok, n_seq, beta_l, state.ref_params)
    if "opt" in which and opt:
        import optax

        def opt_step(params, grads, opt_state, _c=c):
            updates, new_o = _c.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_o, optax.tree.norm(grads)

        grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), state.params)
        parts.add("opt_step", jax.jit(opt_step), state.params, grads, state.opt_state)
        # donated, as inside the update (the step donates its state): no fresh output buffers
        own = jax.tree.map(jnp.copy, (state.params, state.opt_state))
        parts.add("opt_step_donated", jax.jit(opt_step, donate_argnums=(0, 2)), own[0], grads, own[1],
                  feed=lambda a_, out: (out[0], a_[1], out[1]))  # fmt: skip


def rows(parts: Parts, times: dict, cpu: dict, cfg0, task, modes: list[str], ctx) -> tuple[dict, float]:
    """Each part's row (medians, FLOPs counted and executed, rates, floors) and the matmul rate."""
    fns, info = parts.fns, parts.info
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = info["matmul"]["xla_flops"] / med["matmul"]
    fl = common.iteration_flops(cfg0, task, reward_model=False if ctx.reward_on_reference else None)
    counted = {
        "update": fl["update"],
        "scoring": fl["reference"] + fl["value"],
        "matmul": info["matmul"]["xla_flops"],
    }
    n_mb = cfg0.ppo.epochs * cfg0.ppo.minibatches
    counted.update({f"grad_mb[{m}]": fl["update"] / n_mb for m in modes})
    counted.update({f"update[{m}]": fl["update"] for m in modes})
    counted.update({f"update_donated[{m}]": fl["update"] for m in modes})
    for m in modes:
        ex = executed_flops(cfg0, task, m)
        executed = {"scoring": ex["scoring"], f"update[{m}]": ex["update"],
                    f"update_donated[{m}]": ex["update"], f"grad_mb[{m}]": ex["update"] / n_mb}  # fmt: skip
        for k, f in executed.items():
            if k in fns:
                info[k]["executed_flops"] = f
    out = {}
    for k in fns:
        row = {"s_median": med[k], "s_all": times[k], "cpu_s_median": statistics.median(cpu[k]), **info[k]}
        if info[k]["xla_flops"]:
            row["xla_gflop_per_s"] = info[k]["xla_flops"] / med[k] / 1e9
        if k in counted:
            row["counted_flops"] = counted[k]
            row["counted_gflop_per_s"] = counted[k] / med[k] / 1e9
            row["floor_s_counted"] = counted[k] / rate
        if "executed_flops" in info[k]:
            row["executed_gflop_per_s"] = info[k]["executed_flops"] / med[k] / 1e9
            row["floor_s_executed"] = info[k]["executed_flops"] / rate
            row["of_floor"] = row["floor_s_executed"] / med[k]
        out[k] = row
    return out, rate


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    modes, which = args.remat.split(","), set(args.parts.split(","))
    cfg0, task = workload(args.workload)
    from klrl.step.train import make_train
    from klrl.tasks.text import value_models

    trains = {}
    for mode in modes:
        cfg = cfg0.replace(model={"remat": mode})
        trains[mode] = make_train(cfg, task, **value_models(cfg, task))
    first = trains[modes[0]]
    state, env = first.init(cfg0.train.seed), task.env
    ph = common.build_phases(first)
    common.log("rollout, scoring, advantages")
    ro = jax.block_until_ready(ph["rollout"](state, env))
    sc = jax.block_until_ready(ph["scoring"](state, env, ro))
    batch = jax.block_until_ready(ph["advantages"](state, ro, sc)).batch
    ctx = first.context
    mb_rows = ctx.mb_glob
    mb = jax.tree.map(lambda x: x[:mb_rows], batch)
    n_tok, n_seq = jnp.maximum(jnp.sum(mb.mask), 1.0), jnp.float32(mb_rows)
    beta_l = coefs(ctx, state)[1]

    parts = Parts()
    add_shared(parts, which, ph, ctx, state, env, ro, mb)
    for mode, tr in trains.items():
        add_update(parts, which, mode, tr, state, batch)
        add_halves(parts, which, mode, tr.context, state, mb, n_tok, n_seq, beta_l, opt=mode == modes[0])
    times, cpu = parts.time(args.rounds)
    prof = None
    if args.profile:
        common.log(f"profiling {args.profile}")
        prof = {"part": args.profile, **profile_ops(*parts.fns[args.profile], "/tmp/klrl_update_cost_trace")}
    out, rate = rows(parts, times, cpu, cfg0, task, modes, ctx)
    result = {
        "benchmark": "update_cost",
        "workload": args.workload,
        "cpu": common.cpu_model(),
        "rounds": args.rounds,
        "matmul_gflop_per_s": rate / 1e9,
        "minibatches": cfg0.ppo.epochs * cfg0.ppo.minibatches,
        "minibatch_rows": mb_rows,
        "parts": out,
        "profile": prof,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
