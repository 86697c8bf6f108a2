"""Per-device memory and step time of the sharded train step over (data, fsdp, tensor) meshes.

    python benchmarks/sharding.py            # SmolLM2 workload on 8 fake CPU devices + 1B/8B compiled
    python benchmarks/sharding.py --quick    # a tiny random Llama instead of SmolLM2, 1B only

Runs on 8 forced host (CPU) devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set
here unless already given). Progress goes to stderr; one JSON object on the last line of stdout:

* ``workload``: for each mesh ``(data, fsdp, tensor)`` of ``--meshes`` (default (1,1,1), (8,1,1),
  (2,4,1), (2,2,2), (1,8,1)), the per-device bytes of the train state's parameters, optimiser state
  and reference (the arrays' addressable shards, :func:`klrl.step.parallel.sharded_bytes`), the
  compiled step's ``memory_analysis()`` (arguments, outputs, temporaries: per device), its
  ``cost_analysis()`` FLOPs per device and the median step time (wall and process CPU). On fake
  CPU devices all 8 "devices" share the host's cores: the step time is only indicative (it shows
  the collectives' and partitioning's overhead, not a speed-up).
* ``large``: Llama-3.2-1B and (without ``--quick``) Llama-3.1-8B shapes, compiled from
  ``jax.ShapeDtypeStruct`` inputs carrying the state's shardings (nothing allocated), the same bytes
  from ``memory_analysis()``, next to ``benchmarks/scaling_model.py``'s ``memory_per_device``
  (params + optimiser + reference in ``--ref-dtype``, the terms this state holds: the value is a
  head on the policy trunk and the reward is the task's).

The SmolLM2 rows compile first from abstract inputs and run steps only where the estimated host
memory (``devices x (arguments + temporaries)``: fake devices share the host's RAM) fits in
``--max-host-gb`` (default ``MemAvailable - 10 GB``); a row that did not run says why
(``why_not_run``) and keeps its bytes.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

MESHES = ((1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 8, 1))
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memory(compiled) -> dict[str, int]:
    """Per-device bytes of ``memory_analysis()`` and the FLOPs of ``cost_analysis()`` (per device:
    what falls when the rows are split over ``data`` x ``fsdp``)."""
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "arguments": int(ma.argument_size_in_bytes),
        "outputs": int(ma.output_size_in_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
        "aliased": int(ma.alias_size_in_bytes),
        "flops_per_device": float(cost.get("flops", float("nan"))),
    }


def quick_workload():
    """The tiny wordclass config of the tests with a random tiny Llama policy (batch 16)."""
    from klrl.config import RunConfig
    from klrl.models.llama import Llama, LlamaConfig
    from klrl.tasks.wordclass import make_task

    cfg = RunConfig().replace(
        model={"n_layers": 1, "d_model": 32, "n_heads": 2},
        task={"name": "wordclass", "pretrain_steps": 20, "pretrain_batch": 16, "pretrain_len": 16,
              "prompt_len": 6, "prompt_pool": 64},
        sampling={"response_len": 8},
        train={"batch_size": 16, "iterations": 3, "quiet": True},
        ppo={"minibatches": 2, "epochs": 1},
    )  # fmt: skip
    task = make_task(cfg)
    llama = Llama(LlamaConfig(**TINY_LLAMA))
    return cfg, task, {"policy": llama, "policy_params": llama.init(jax.random.PRNGKey(0))}


def smollm2_workload():
    import common

    from klrl.tasks.text import value_models

    cfg, task = common.smollm2_workload("float32")
    return cfg, task, value_models(cfg, task)


def abstract_state(train):
    """The train state's ``jax.ShapeDtypeStruct`` leaves carrying its shardings: nothing allocated."""
    from klrl.step.context import initial_state

    ctx = train.context
    shapes = jax.eval_shape(
        lambda p, v: initial_state(dataclasses.replace(ctx, policy_params=p, value_params=v), 0),
        ctx.policy_params, ctx.value_params,
    )  # fmt: skip
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, train.state_shardings
    )


def host_gb() -> float:
    """``MemAvailable`` of /proc/meminfo in GB (fake CPU devices all live in the host's memory)."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def measure_mesh(cfg, task, models, sizes, iterations: int, max_host_gb: float) -> dict:
    """Compile the step from abstract inputs (nothing allocated), read the per-device bytes, then run
    ``iterations`` timed steps only if the 8 fake devices' memory fits: the estimate is
    ``devices x (arguments + temporaries)`` of ``memory_analysis()`` (the outputs alias the donated
    state), compared with ``max_host_gb``."""
    from klrl.step.parallel import make_mesh, sharded_bytes
    from klrl.step.train import make_train

    d, f, t = sizes
    mesh = make_mesh(d, devices=jax.devices()[: d * f * t], fsdp=f, tensor=t)
    train = make_train(cfg.replace(train={"devices": d}), task, mesh, **models)
    state = abstract_state(train)
    row = {
        "mesh": list(sizes),
        "params": sharded_bytes(state.params),
        "optimizer": sharded_bytes(state.opt_state),
        "reference": sharded_bytes(state.ref_params),
    }
    t0 = time.perf_counter()
    compiled = train.step.lower(state, task.env).compile()
    row["compile_s"] = time.perf_counter() - t0
    row.update(memory(compiled))
    row["host_bytes_estimate"] = d * f * t * (row["arguments"] + row["temporaries"])
    row["ran"] = iterations > 0 and row["host_bytes_estimate"] <= max_host_gb * 1e9
    row["step_s"] = row["step_cpu_s"] = row["loss"] = None
    if not row["ran"]:
        est = row["host_bytes_estimate"] / 1e9
        row["why_not_run"] = (
            "--iterations 0" if iterations <= 0 else
            f"estimated {est:.1f} GB of host memory > --max-host-gb {max_host_gb:.1f}"
        )  # fmt: skip
        log(f"  mesh {sizes}: {json.dumps(row)}")
        return row
    state = train.init(cfg.train.seed)
    times, cpu = [], []
    for i in range(iterations + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, task.env)
        jax.block_until_ready(metrics)
        if i:  # the first call is a warm-up
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    row["step_s"], row["step_cpu_s"] = statistics.median(times), statistics.median(cpu)
    row["loss"] = float(metrics["loss/total"])
    del state, metrics
    log(f"  mesh {sizes}: {json.dumps(row)}")
    return row


def large(name: str, task, cfg, meshes) -> list[dict]:
    """The step of a Llama-shaped policy of ``scaling_model.SHAPES[name]`` compiled from abstract
    inputs with the state's shardings: nothing is allocated."""
    import scaling_model as sm

    from klrl.models.llama import Llama, LlamaConfig
    from klrl.step.parallel import make_mesh, sharded_bytes
    from klrl.step.train import make_train

    s = sm.SHAPES[name]
    c = LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.d_ff, num_hidden_layers=s.n_layers,
        num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads, head_dim=s.head_dim,
        max_position_embeddings=4096, tie_word_embeddings=s.tied,
    )  # fmt: skip
    policy = Llama(c)
    abstract_params = jax.eval_shape(policy.init, jax.random.PRNGKey(0))
    cfg = cfg.replace(model={"value_model": "head"})
    frozen = 2 if cfg.model.ref_dtype == "bfloat16" else 4
    rows = []
    for sizes in meshes:
        d, f, t = sizes
        mesh = make_mesh(d, devices=jax.devices()[: d * f * t], fsdp=f, tensor=t)
        train = make_train(
            cfg.replace(train={"devices": d}), task, mesh, policy=policy, policy_params=abstract_params
        )
        state = abstract_state(train)
        t0 = time.perf_counter()
        compiled = train.step.lower(state, task.env).compile()
        model = sm.memory_per_device(s, sizes, workload=sm.Workload(frozen_bytes=frozen))
        row = {
            "mesh": list(sizes),
            "params": sharded_bytes(state.params),
            "optimizer": sharded_bytes(state.opt_state),
            "reference": sharded_bytes(state.ref_params),
            **memory(compiled),
            "compile_s": time.perf_counter() - t0,
            "model_params_optimizer_reference": model["params"] + model["optimizer"] + model["reference"],
        }
        row["state_vs_model"] = (row["params"] + row["optimizer"] + row["reference"]) / row[
            "model_params_optimizer_reference"
        ]
        log(f"  {name} mesh {sizes}: {json.dumps(row)}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random Llama instead of SmolLM2; 1B only")
    ap.add_argument("--iterations", type=int, default=2, help="timed steps per mesh (median)")
    ap.add_argument("--meshes", nargs="*", default=None, help="data,fsdp,tensor sizes (default: the five)")
    ap.add_argument("--large", nargs="*", default=None, help="Llama shapes to compile abstractly (1B 8B)")
    ap.add_argument(
        "--max-host-gb", type=float, default=None,
        help="run a mesh's steps only if its estimated host memory fits (default: MemAvailable - 10 GB)",
    )  # fmt: skip
    ap.add_argument("--ref-dtype", default="float32", choices=("float32", "bfloat16"), help="model.ref_dtype")
    args = ap.parse_args(argv)
    meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes] if args.meshes else list(MESHES)
    log(f"{jax.device_count()} devices ({jax.devices()[0].platform})")
    max_host_gb = host_gb() - 10.0 if args.max_host_gb is None else args.max_host_gb
    cfg, task, models = quick_workload() if args.quick else smollm2_workload()
    cfg = cfg.replace(model={"ref_dtype": args.ref_dtype})
    result = {
        "devices": jax.device_count(), "platform": jax.devices()[0].platform, "quick": args.quick,
        "ref_dtype": args.ref_dtype, "max_host_gb": max_host_gb,
        "workload_shape": {
            "batch": cfg.train.batch_size, "prompt_len": task.prompt_len,
            "response_len": cfg.sampling.response_len, "minibatches": cfg.ppo.minibatches,
            "epochs": cfg.ppo.epochs, "value_model": cfg.model.value_model,
        },
    }  # fmt: skip
    log("workload: " + ("tiny Llama" if args.quick else "SmolLM2-135M"))
    result["workload"] = [measure_mesh(cfg, task, models, m, args.iterations, max_host_gb) for m in meshes]
    names = args.large if args.large is not None else (["1B"] if args.quick else ["1B", "8B"])
    big_meshes = [(8, 1, 1), (2, 2, 2), (1, 8, 1)] if args.quick else meshes
    result["large"] = {n: large(n, task, cfg, big_meshes) for n in names}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
