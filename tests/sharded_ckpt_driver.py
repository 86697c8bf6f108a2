"""Run by tests/io/test_checkpoint_sharded.py in a subprocess with 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): ``python sharded_ckpt_driver.py CASE DIR``.

A train-state-like pytree (a tiny Llama's parameters and the optax Adam state after one update),
sharded by the Llama family's partition rules over a ``(sweep, data, fsdp, tensor)`` mesh, saved
from one mesh and restored onto others. Prints one JSON line with what the test checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from klrl.io import checkpoint as ckpt
from klrl.models.base import spec_for
from klrl.models.llama import Llama, LlamaConfig

AXES = ("sweep", "data", "fsdp", "tensor")
CFG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
)  # fmt: skip


def mesh(shape: tuple[int, ...]) -> Mesh:
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), AXES)


def host_state() -> dict:
    """Parameters and Adam state after one step on a made-up loss (nonzero moments), as host arrays,
    plus a bf16 copy and an integer counter (other dtypes)."""

    @jax.jit
    def build():
        params = Llama(CFG).init(jax.random.key(0))
        opt = optax.adam(1e-2)
        grads = jax.tree.map(
            lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape), params
        )
        upd, opt_state = opt.update(grads, opt.init(params), params)
        params = optax.apply_updates(params, upd)
        ref = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        return {"params": params, "opt_state": opt_state, "ref": ref, "iteration": jnp.int32(7)}

    return jax.tree.map(np.asarray, build())


def shardings(state: dict, m: Mesh):
    """The family's rules on every tree of parameters in the state (params, Adam's mu and nu, ref)."""
    specs = spec_for(Llama(CFG).partition_rules(), state)
    return jax.tree.map(lambda s: NamedSharding(m, s), specs, is_leaf=lambda s: isinstance(s, P))


def place(state: dict, m: Mesh) -> dict:
    return jax.device_put(state, shardings(state, m))


def same_bytes(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def save(d: Path, state, step: int = 1) -> None:
    mgr = ckpt.manager(d, async_save=True)
    ckpt.save(
        mgr, step, state, {"config": {}, "version": ckpt.version(), "iteration": step, "metrics_lines": 0}
    )
    for x in jax.tree.leaves(state):  # the next step donates the buffers: the save must not need them
        x.delete()
    ckpt.finish(mgr)


def restore(d: Path, abstract, shard):
    mgr = ckpt.manager(d, read_only=True)
    try:
        return ckpt.restore(mgr, abstract, shardings=shard)
    finally:
        mgr.close()


def program(ref: dict, m: Mesh, iterations: int):
    """A loop Program over the sharded state: Adam on a made-up loss of the parameters, a global-view
    jit with the state's shardings in and out (donated), its state restored onto ``m``."""
    from klrl.config import RunConfig
    from klrl.loop.driver import Program

    cfg = RunConfig().replace(train={"iterations": iterations, "checkpoint_every": 2, "quiet": True})
    sh = shardings(ref, m)
    opt = optax.adam(1e-2)

    def step(state, env):
        def loss_fn(p):
            return sum(jnp.mean(jnp.tanh(x) ** 2) for x in jax.tree.leaves(p))

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        upd, opt_state = opt.update(grads, state["opt_state"], state["params"])
        new = {**state, "params": optax.apply_updates(state["params"], upd), "opt_state": opt_state,
               "iteration": state["iteration"] + 1}  # fmt: skip
        return new, {"loss": loss, "reward/task": -loss}

    jitted = jax.jit(step, in_shardings=(sh, None), out_shardings=(sh, None), donate_argnums=0)
    place = lambda s: jax.device_put(s, sh)  # noqa: E731
    return cfg, Program(configs=[cfg], stacked=False, init=lambda: place(ref), step=jitted, place=place,
                        env=None, shardings=sh)  # fmt: skip


def loop_resume(ref: dict, d: Path) -> dict:
    """The loop on 8 devices: 4 iterations straight, and 2 + a resume to 4 on the same mesh (bit for
    bit) and on 4 devices (the state restored onto the new mesh; close within fp32 rounding)."""
    from klrl.io.resume import prepare
    from klrl.loop.driver import drive

    eight, four = mesh((1, 2, 2, 2)), mesh((1, 1, 4, 1))
    full, _ = drive(program(ref, eight, 4)[1], out_dir=d / "full")
    for name in ("same", "other"):
        drive(program(ref, eight, 2)[1], out_dir=d / name)
    cfg, prog = program(ref, eight, 4)
    same, _ = drive(prog, resume=prepare(cfg, d / "same"))
    cfg, prog = program(ref, four, 4)
    other, _ = drive(prog, resume=prepare(cfg, d / "other"))
    rows = lambda n: (d / n / "metrics.jsonl").read_bytes()  # noqa: E731
    loss = lambda r: np.asarray(r[0].metrics["loss"])  # noqa: E731
    emb = other[0].state["params"]["params"]["embed_tokens"]["embedding"]
    return {
        "same_rows": rows("same") == rows("full"),
        "same_state": same_bytes(full[0].state, same[0].state),
        "other_rows": int(rows("other").count(b"\n")),
        "other_close": bool(np.allclose(loss(other), loss(full), rtol=1e-5, atol=0)),
        "other_state_close": all(
            np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-7)
            for a, b in zip(jax.tree.leaves(full[0].state), jax.tree.leaves(other[0].state), strict=True)
        ),
        "other_devices": len(emb.sharding.device_set),
    }


def main(case: str, d: Path) -> dict:
    ref = host_state()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ref)
    src = mesh((1, 2, 2, 2))
    if case == "all":  # saved from 8 devices, then every check on the saved checkpoint
        state = place(ref, src)
        emb = state["params"]["params"]["embed_tokens"]["embedding"]
        save(d, state)
        out = {"devices": len(jax.devices()), "embed_shard": list(emb.sharding.shard_shape(emb.shape))}
        return {"save": out, "restore": main("restore", d), "wrong_shape": main("wrong_shape", d),
                "paths": main("paths", d), "loop": loop_resume(ref, d / "loop")}  # fmt: skip
    if case == "restore":
        out = {}
        for name, shape in {"same": (1, 2, 2, 2), "four": (1, 1, 4, 1), "one": (1, 1, 1, 1)}.items():
            m = mesh(shape)
            want = shardings(ref, m)
            got, meta = restore(d, abstract, want)
            specs_ok = all(
                isinstance(g, jax.Array) and g.sharding == w
                for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            )
            emb = got["params"]["params"]["embed_tokens"]["embedding"]
            shards = sorted({tuple(s.data.shape) for s in emb.addressable_shards})
            out[name] = {"equal": same_bytes(got, ref), "shardings": specs_ok, "embed_shards": shards,
                         "n_devices": len(emb.sharding.device_set)}  # fmt: skip
        # a ShapeDtypeStruct target that carries its sharding, and a host (NumPy) restore
        four = mesh((1, 1, 4, 1))
        tgt = ckpt.target(abstract, shardings(ref, four))
        got, _ = restore(d, tgt, None)
        out["struct_target"] = same_bytes(got, ref) and all(
            g.sharding == t.sharding for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(tgt), strict=True)
        )
        got, _ = restore(d, abstract, None)
        out["host"] = same_bytes(got, ref) and all(isinstance(g, np.ndarray) for g in jax.tree.leaves(got))
        return out
    if case == "paths":  # the device path (sharded, one all-reduce) and the host path agree, any mesh
        from klrl.io import digest

        host = digest.digests(ref)
        digest.HOST_MAX_BYTES = -1  # every jax.Array on its devices
        out = {}
        for name, shape in {"eight": (1, 2, 2, 2), "four": (1, 1, 4, 1), "one": (1, 1, 1, 1)}.items():
            out[name] = digest.digests(place(ref, mesh(shape))) == host
        return out
    if case == "damaged":
        # checkpoint 2: the state with one element of one shard changed (device 5's block of the
        # embedding), under checkpoint 1's meta record: data that parses but is not what was saved
        bad = jax.tree.map(np.copy, ref)
        bad["params"]["params"]["embed_tokens"]["embedding"][40, 20] += 1.0
        save(d, place(bad, src), step=2)
        (d / "checkpoints/2/meta/metadata").write_bytes((d / "checkpoints/1/meta/metadata").read_bytes())
        mgr = ckpt.manager(d, read_only=True)
        try:
            ckpt.restore(mgr, abstract, 2, shardings=shardings(ref, mesh((1, 1, 4, 1))))
        except ckpt.CheckpointError as e:
            return {"error": str(e)}
        finally:
            mgr.close()
        return {"error": None}
    if case == "wrong_shape":
        bad = {**abstract, "iteration": jax.ShapeDtypeStruct((2,), np.int32)}
        try:
            restore(d, bad, None)
        except ckpt.CheckpointError as e:
            return {"error": str(e)}
        return {"error": None}
    raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))), flush=True)
