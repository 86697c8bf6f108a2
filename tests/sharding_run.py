"""Driver of tests/step/test_parallel.py (run in a subprocess with forced host devices).

``python tests/sharding_run.py CFG_JSON OUT_NPZ JOBS [N_PROC PROC_ID PORT]``: for each job
``family:data,fsdp,tensor`` (``gpt`` is the task's klrl GPT, ``llama`` a tiny random Llama)
3 iterations of the tiny wordclass config, dumping per iteration beta and every metric, the final
parameters and optimiser state, and the per-device bytes of parameters and optimiser state.
"""

from __future__ import annotations

import json
import sys

import numpy as np

TINY_LLAMA = dict(
    vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
)  # fmt: skip


def main(cfg_path: str, out_path: str, jobs: str, n_proc: int = 1, proc_id: int = 0, port: int = 0) -> None:
    import klrl.distributed as D

    if n_proc > 1:
        D.initialize(f"localhost:{port}", n_proc, proc_id)
    import jax

    if n_proc > 1:  # the session's cached reference, read to host memory (tests/host_cache.py)
        import host_cache

        host_cache.install()

    from klrl.config import RunConfig
    from klrl.models.llama import Llama, LlamaConfig
    from klrl.step.parallel import make_mesh, sharded_bytes
    from klrl.step.train import make_train
    from klrl.tasks.wordclass import make_task

    cfg = RunConfig.from_dict(json.load(open(cfg_path)))
    task = make_task(cfg)
    out = {}
    for job in jobs.split(";"):
        if job == "sweep":
            out.update(sweep_check(cfg, task))
            continue
        if job.startswith("update:"):
            out.update(update_check(cfg.replace(ppo={"shuffle": job.split(":")[1]}), task, job))
            continue
        family, sizes = job.split(":")
        d, f, t = (int(s) for s in sizes.split(","))
        mesh = make_mesh(d, devices=jax.devices()[: d * f * t], fsdp=f, tensor=t)
        models, run_cfg = {}, cfg
        if family == "lora":  # the tiny Llama with rank-4 adapters and a LoRA critic on its frozen base
            run_cfg = cfg.replace(lora={"rank": 4}, model={"value_model": "lora"})
        if family in ("llama", "lora"):
            llama = Llama(LlamaConfig(**TINY_LLAMA))
            models = {"policy": llama, "policy_params": llama.init(jax.random.PRNGKey(7))}
        tr = make_train(run_cfg.replace(train={"devices": d}), task, mesh, **models)
        env = D.replicate(task.env, mesh)
        s = tr.init(cfg.train.seed)
        out[f"{job}/bytes/params"] = sharded_bytes(s.params)
        out[f"{job}/bytes/opt_state"] = sharded_bytes(s.opt_state)
        out[f"{job}/bytes/ref_params"] = sharded_bytes(s.ref_params)
        step = tr.step.lower(s, env).compile()
        cost = step.cost_analysis()
        out[f"{job}/flops_per_device"] = float((cost[0] if isinstance(cost, list) else cost)["flops"])
        for i in range(3):
            s, m = step(s, env)
            m = D.to_host(m)
            out[f"{job}/beta/{i}"] = D.to_host(s.ctrl.beta)
            for k, v in m.items():
                out[f"{job}/metric/{i}/{k}"] = v
        for name, tree in (("param", s.params), ("opt", s.opt_state)):
            for path, leaf in jax.tree_util.tree_leaves_with_path(D.to_host(tree)):
                out[f"{job}/{name}/{jax.tree_util.keystr(path)}"] = leaf
        biggest = max(jax.tree.leaves(s.params["policy"]), key=lambda x: x.size)
        out[f"{job}/spec/biggest"] = str(biggest.sharding.spec)
    if proc_id == 0:
        np.savez(out_path, **out)


def sweep_check(cfg, task) -> dict:
    """A sweep of 2 seeds on 2 sweep groups x (data 1, fsdp 2, tensor 2): each member sharded over
    its group; member 0 is the run of ``gpt:1,1,1``."""
    import jax

    from klrl.api import sweep
    from klrl.config.sweep import grid
    from klrl.loop.build import make_program

    base = cfg.replace(train={"devices": 0, "mesh": "1,2,2"})
    members = grid(base, {"train.seed": [cfg.train.seed, cfg.train.seed + 1]})
    runs = sweep(members, task=task, write=False, sweep_devices=2)
    out = {}
    for i in range(3):
        for k, v in runs[0].metrics.items():
            out[f"sweep/metric/{i}/{k}"] = np.asarray(v[i])
    prog, _ = make_program(members, task, stacked=True, write=False, sweep_devices=2)
    state = prog.init()
    kernel = state.params["policy"]["h0"]["qkv"]["kernel"]
    mesh = kernel.sharding.mesh
    out["sweep/mesh"] = str(dict(mesh.shape))
    out["sweep/spec"] = str(kernel.sharding.spec)
    out["sweep/shard_shape"] = np.asarray(kernel.addressable_shards[0].data.shape)
    out["sweep/shape"] = np.asarray(kernel.shape)
    del jax
    return out


def update_check(cfg, task, job: str) -> dict:
    """The update phase on 2 data devices against a Python loop over epochs, minibatches and
    devices (rows as the docs of ``ppo.shuffle`` say, per-device gradients averaged by hand)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from klrl.step.parallel import make_mesh
    from klrl.step.train import Batch, make_train

    n_dev = 2
    mesh = make_mesh(n_dev, devices=jax.devices()[:n_dev])
    cfg = cfg.replace(train={"devices": n_dev})
    tr = make_train(cfg, task, mesh)
    ctx = tr.context
    state = tr.init(3)
    rng = np.random.default_rng(0)
    b, p, r = ctx.b_glob, ctx.p_len, ctx.r_len
    mask = (rng.random((b, r)) < 0.8).astype(np.float32)
    f = lambda: rng.standard_normal((b, r)).astype(np.float32)  # noqa: E731
    tokens = rng.integers(0, 147, (b, p + r)).astype(np.int32)
    batch = Batch(
        tokens=tokens, key_mask=np.ones((b, p + r), np.float32), response=tokens[:, p:], mask=mask,
        logp=-np.abs(f()), ref_logp=-np.abs(f()), adv=f(), ret=f(), value=f(), ref_logits=None,
    )  # fmt: skip
    update = jax.jit(
        jax.shard_map(
            tr.phases.update, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"},
            check_vma=False,
        )
    )  # fmt: skip
    params, _, stats = update(state, batch)

    # the reference: a Python loop
    k_perm = jax.random.split(jax.random.fold_in(state.rng, state.iteration), 3)[2]
    n_mb, mb, b_loc = cfg.ppo.minibatches, ctx.mb_glob, b // n_dev
    m = mb // n_dev
    grad = jax.jit(jax.grad(tr.loss, has_aux=True))
    ref_params, opt = state.params, state.opt_state
    beta_l = state.other_coef if ctx.drives_reward else state.ctrl.beta
    losses = []
    for k in jax.random.split(k_perm, cfg.ppo.epochs):
        if cfg.ppo.shuffle == "global":
            perm = np.asarray(jax.random.permutation(k, b))
            rows = [[perm[j * mb + d * m : j * mb + (d + 1) * m] for d in range(n_dev)] for j in range(n_mb)]
        else:
            own = [np.asarray(jax.random.permutation(jax.random.fold_in(k, d), b_loc)) for d in range(n_dev)]
            rows = [[d * b_loc + own[d][j * m : (j + 1) * m] for d in range(n_dev)] for j in range(n_mb)]
        for j in range(n_mb):
            mbs = [jax.tree.map(lambda x, i=i: x[i], batch) for i in rows[j]]
            n_tok = max(sum(float(x.mask.sum()) for x in mbs) / n_dev, 1.0)
            outs = [grad(ref_params, x, jnp.float32(n_tok), jnp.float32(m), beta_l) for x in mbs]
            g = jax.tree.map(lambda *xs: sum(xs) / n_dev, *[o[0] for o in outs])
            losses.append(sum(float(o[1]["loss/total"]) for o in outs) / n_dev)
            upd, opt = ctx.optimizer.update(g, opt, ref_params)
            ref_params = optax.apply_updates(ref_params, upd)
    out = {f"{job}/loss": np.float32(stats["loss/total"]), f"{job}/ref_loss": np.float32(np.mean(losses))}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        out[f"{job}/param/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(ref_params):
        out[f"{job}/ref_param/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:7]))
