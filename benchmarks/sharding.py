"""Per-device memory and step time of the sharded train step over (data, fsdp, tensor) meshes.

    python benchmarks/sharding.py            # SmolLM2 workload on 8 fake CPU devices + 1B/8B compiled
    python benchmarks/sharding.py --quick    # a tiny random Llama instead of SmolLM2, 1B only

Runs on 8 forced host (CPU) devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set
here unless already given). Progress goes to stderr; one JSON object on the last line of stdout:

* ``workload``: for each mesh ``(data, fsdp, tensor)`` of ``--meshes`` (default (1,1,1), (8,1,1),
  (2,4,1), (2,2,2), (1,8,1)), the per-device bytes of the train state's parameters, optimiser state
  and reference (the arrays' addressable shards, :func:`klrl.parallel.sharded_bytes`), the
  compiled step's ``memory_analysis()`` (arguments, outputs, temporaries: per device) and the
  median step time. On fake CPU devices all 8 "devices" share the host's cores: the step time is
  only indicative (it shows the collectives' and partitioning's overhead, not a speed-up).
* ``large``: Llama-3.2-1B and (without ``--quick``) Llama-3.1-8B shapes, compiled from
  ``jax.ShapeDtypeStruct`` inputs carrying the state's shardings (nothing allocated), the same bytes
  from ``memory_analysis()``, next to ``benchmarks/scaling_model.py``'s ``memory_per_device``
  (params + optimiser + fp32 reference, the terms this state holds: the value is a head on the
  policy trunk and the reward is the task's).
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
    ma = compiled.memory_analysis()
    return {
        "arguments": int(ma.argument_size_in_bytes),
        "outputs": int(ma.output_size_in_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
        "aliased": int(ma.alias_size_in_bytes),
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


def measure_mesh(cfg, task, models, sizes, iterations: int) -> dict:
    from klrl.parallel import make_mesh, sharded_bytes
    from klrl.train import make_train

    d, f, t = sizes
    mesh = make_mesh(d, devices=jax.devices()[: d * f * t], fsdp=f, tensor=t)
    train = make_train(cfg.replace(train={"devices": d}), task, mesh, **models)
    state = train.init(cfg.train.seed)
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
    times = []
    for i in range(iterations + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, task.env)
        jax.block_until_ready(metrics)
        if i:  # the first call is a warm-up
            times.append(time.perf_counter() - t0)
    row["step_s"] = statistics.median(times) if times else None
    row["loss"] = float(metrics["loss/total"])
    log(f"  mesh {sizes}: {json.dumps(row)}")
    return row


def large(name: str, task, cfg, meshes) -> list[dict]:
    """The step of a Llama-shaped policy of ``scaling_model.SHAPES[name]`` compiled from abstract
    inputs with the state's shardings: nothing is allocated."""
    import scaling_model as sm

    from klrl.models.llama import Llama, LlamaConfig
    from klrl.parallel import make_mesh, sharded_bytes
    from klrl.train import make_train
    from klrl.train_parts import initial_state

    s = sm.SHAPES[name]
    c = LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.d_ff, num_hidden_layers=s.n_layers,
        num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads, head_dim=s.head_dim,
        max_position_embeddings=4096, tie_word_embeddings=s.tied,
    )  # fmt: skip
    policy = Llama(c)
    abstract_params = jax.eval_shape(policy.init, jax.random.PRNGKey(0))
    cfg = cfg.replace(model={"value_model": "head"})
    rows = []
    for sizes in meshes:
        d, f, t = sizes
        mesh = make_mesh(d, devices=jax.devices()[: d * f * t], fsdp=f, tensor=t)
        train = make_train(
            cfg.replace(train={"devices": d}), task, mesh, policy=policy, policy_params=abstract_params
        )
        ctx = train.context
        shapes = jax.eval_shape(
            lambda p: initial_state(dataclasses.replace(ctx, policy_params=p), 0), abstract_params
        )
        state = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, train.state_shardings
        )
        t0 = time.perf_counter()
        compiled = train.step.lower(state, task.env).compile()
        model = sm.memory_per_device(s, sizes, workload=sm.Workload(frozen_bytes=4))
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
    args = ap.parse_args(argv)
    meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes] if args.meshes else list(MESHES)
    log(f"{jax.device_count()} devices ({jax.devices()[0].platform})")
    cfg, task, models = quick_workload() if args.quick else smollm2_workload()
    result = {"devices": jax.device_count(), "platform": jax.devices()[0].platform, "quick": args.quick}
    log("workload: " + ("tiny Llama" if args.quick else "SmolLM2-135M"))
    result["workload"] = [measure_mesh(cfg, task, models, m, args.iterations) for m in meshes]
    names = args.large if args.large is not None else (["1B"] if args.quick else ["1B", "8B"])
    big_meshes = [(8, 1, 1), (2, 2, 2), (1, 8, 1)] if args.quick else meshes
    result["large"] = {n: large(n, task, cfg, big_meshes) for n in names}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
