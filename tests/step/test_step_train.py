"""Tests of the compiled PPO-KL iteration: beta control inside the jitted step, the non-finite
guard, a short run that learns, and 1-device vs 4-device parity (in a subprocess)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import klrl
from klrl.algo import control
from klrl.config import ControllerConfig, RunConfig
from klrl.step.train import make_train
from klrl.tasks.base import JaxReward

HORIZON = 100.0  # proportional: beta *= 1 +- 0.2 * 16 / 100 per iteration once the error is clipped


def _perturbed(tree, scale: float, seed: int):
    """``tree`` plus Gaussian noise (NumPy, so every process gets the same numbers)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(np.float32), tree)


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


class Bench:
    """One compiled step shared by the controller and guard tests.

    The task's reward is ``positive fraction + env['reward_bias']``: with a bias of 0 it is the
    task reward, with NaN every reward is NaN, and both use the same compiled step. The reference
    is perturbed away from the initial policy so the KL is clearly positive from iteration 0.
    """

    def __init__(self, cfg: RunConfig, task) -> None:
        base = task.reward_fn
        params = {**task.reward.params, "reward_bias": jnp.zeros((), jnp.float32)}
        reward = JaxReward(lambda env, ro: base(env, ro) + env["reward_bias"], params)
        self.task = dataclasses.replace(task, reward=reward)
        self.cfg = cfg
        self.train = make_train(cfg, self.task)
        self.replicated = NamedSharding(self.train.mesh, P())

    def env(self, bias: float):
        return {**self.task.env, "reward_bias": jnp.asarray(bias, jnp.float32)}

    def state(self, ctrl_cfg: ControllerConfig, beta: float = 0.05):
        s = self.train.init(0)
        ref = _perturbed(_host(s.ref_params), 0.05, seed=1)
        s = s._replace(ref_params=ref, ctrl=control.from_config(ctrl_cfg).init(beta))
        return jax.device_put(s, self.replicated)  # same placement as the step's output: no recompile


@pytest.fixture(scope="module")
def bench(tiny_cfg, tiny_task) -> Bench:
    cfg = tiny_cfg.replace(ctrl={"estimator": "full", "horizon": HORIZON})
    return Bench(cfg, tiny_task)


def _prop(target: float) -> ControllerConfig:
    return ControllerConfig(kind="proportional", target=target, horizon=HORIZON, clip=0.2)


@pytest.mark.parametrize(
    "name,ctrl_cfg,factor",
    [
        ("kl_above_target", _prop(1e-3), 1.0 + 0.2 * 16 / HORIZON),
        ("kl_below_target", _prop(1e6), 1.0 - 0.2 * 16 / HORIZON),
        ("fixed", ControllerConfig(kind="fixed", target=1e-3), 1.0),
    ],
)
def test_beta_moves_inside_the_jitted_step(bench: Bench, name, ctrl_cfg, factor) -> None:
    state = bench.state(ctrl_cfg, beta=0.05)
    env = bench.env(0.0)
    expected = np.float32(0.05)
    betas = [float(state.ctrl.beta)]
    for _ in range(3):
        beta_used = float(state.ctrl.beta)  # the beta this iteration shapes its rewards with
        state, m = bench.train.step(state, env)
        beta = float(state.ctrl.beta)
        kl = float(m["ctrl/kl_observed_seq_sum"])
        # the penalty's size, and the global per-token k1 = (sum of per-sequence sums) / (sum of lengths)
        np.testing.assert_allclose(m["kl/beta_x_k1_seq_sum"], beta_used * m["kl/k1_seq_sum"], rtol=1e-5)
        per_token = m["kl/k1_seq_sum"] / m["response/length"]
        np.testing.assert_allclose(m["kl/k1_token_mean"], per_token, rtol=1e-4)
        assert "ctrl/target" not in m  # a fixed-kind program logs no target
        assert m["guard/skipped"] == 0
        assert np.isfinite(kl) and kl > 0  # exact KL to a perturbed reference
        if name == "kl_above_target":
            assert kl > 1.2 * ctrl_cfg.target  # relative error clipped at +0.2
        if name == "kl_below_target":
            assert kl < 0.8 * ctrl_cfg.target
        expected = np.float32(expected * np.float32(factor))
        np.testing.assert_allclose(beta, expected, rtol=1e-6)
        assert float(m["ctrl/beta"]) == beta  # the metric reports the updated coefficient
        betas.append(beta)
    diffs = np.diff(betas)
    if name == "kl_above_target":
        assert np.all(diffs > 0), betas
    elif name == "kl_below_target":
        assert np.all(diffs < 0), betas
    else:
        assert np.all(diffs == 0), betas
    assert int(state.iteration) == 3 and int(state.ctrl.steps) == 3
    # one compiled step serves every controller kind (the kind is state, not code) and is not
    # recompiled for the state the step itself returns
    assert bench.train.step._cache_size() == 1  # (fails, rather than passes silently, if jax renames it)


def test_nonfinite_reward_skips_the_update(bench: Bench) -> None:
    state = bench.state(_prop(1e-3), beta=0.05)
    state, m = bench.train.step(state, bench.env(0.0))  # a normal iteration first: Adam state is non-trivial
    assert m["guard/skipped"] == 0
    before = _host(state)
    state, m = bench.train.step(state, bench.env(float("nan")))
    assert float(m["guard/skipped"]) == 1.0
    assert float(m["guard/consecutive_skips"]) == 1.0
    assert np.isnan(float(m["reward/task"]))
    after = _host(state)
    # parameters, optimiser state, reference and controller (beta) are exactly unchanged
    for part in ("params", "opt_state", "ref_params", "ctrl", "other_coef", "rng"):
        jax.tree.map(np.testing.assert_array_equal, getattr(after, part), getattr(before, part))
    assert int(after.iteration) == int(before.iteration) + 1
    assert int(after.skipped) == 1
    # the count of consecutive skips grows, and a finite iteration resets it and updates again
    state, m = bench.train.step(state, bench.env(float("nan")))
    assert float(m["guard/consecutive_skips"]) == 2.0 and int(state.skipped) == 2
    state, m = bench.train.step(state, bench.env(0.0))
    assert float(m["guard/skipped"]) == 0.0 and int(state.skipped) == 0
    new = _host(state)
    assert not np.array_equal(
        new.params["policy"]["wte"]["embedding"], before.params["policy"]["wte"]["embedding"]
    )
    assert float(new.ctrl.beta) > float(before.ctrl.beta)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(new.params))


def test_short_run_improves_task_reward(tiny_cfg, tiny_task) -> None:
    cfg = tiny_cfg.replace(optim={"lr": 1e-3}, train={"iterations": 30}, kl={"beta": 0.01})
    result = klrl.run(cfg, task=tiny_task, write=False)
    r = result.metrics["reward/task"]
    assert r.shape == (30,) and np.all(np.isfinite(r))
    first, last = float(np.mean(r[:5])), float(np.mean(r[-5:]))
    assert last > first + 0.1, (first, last, r)
    assert np.all(result.metrics["guard/skipped"] == 0)
    assert int(result.state.iteration) == 30
    s = result.summary()
    assert s["reward/task"]["end"] > s["reward/task"]["start"]


# ---- 1 vs 4 devices ---------------------------------------------------------------------------

PARITY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from klrl.config import RunConfig
    from klrl.tasks.wordclass import make_task
    from klrl.step.train import make_train

    cfg_path, out_path = sys.argv[1], sys.argv[2]
    assert jax.device_count() == 4, jax.devices()
    cfg = RunConfig.from_dict(json.load(open(cfg_path)))
    task = make_task(cfg)  # the reference comes from the session's cache: no pretraining here
    rng = np.random.default_rng(1)
    ref = jax.tree.map(lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(np.float32),
                       task.ref_params)
    out = {}
    for n in (4, 1):
        c = cfg.replace(train={"devices": n})
        tr = make_train(c, task)
        assert tr.mesh.shape["data"] == n
        s = tr.init(c.train.seed)
        s = jax.device_put(s._replace(ref_params=ref), NamedSharding(tr.mesh, P()))
        for i in range(3):
            s, m = tr.step(s, task.env)
            out[f"{n}/beta/{i}"] = np.asarray(s.ctrl.beta)
            for k, v in m.items():
                out[f"{n}/metric/{i}/{k}"] = np.asarray(v)
        for path, leaf in jax.tree_util.tree_leaves_with_path(s.params):
            out[f"{n}/param/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    np.savez(out_path, **out)
    """
)


@pytest.fixture(scope="module", autouse=True)
def parity_run(request, tmp_path_factory):
    """Start the 4-device subprocess at the top of the module so it overlaps the other tests."""
    if not any(item.name == "test_one_vs_four_devices" for item in request.session.items):
        yield None  # parity test deselected: start nothing
        return
    tiny_cfg = request.getfixturevalue("tiny_cfg")
    request.getfixturevalue("tiny_task")  # the reference is pretrained and cached before the subprocess
    d = tmp_path_factory.mktemp("parity")
    # dual ascent on the exact KL: beta follows the observed KL continuously, so it checks the KL too
    cfg = tiny_cfg.replace(
        ctrl={"kind": "dual", "lr": 1.0, "target": 0.5, "estimator": "full"}, kl={"beta": 0.1}
    )
    (d / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    (d / "parity.py").write_text(PARITY_SCRIPT)
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, str(d / "parity.py"), str(d / "cfg.json"), str(d / "out.npz")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    handle = {"proc": proc, "out": d / "out.npz"}
    yield handle
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_one_vs_four_devices(parity_run) -> None:
    proc = parity_run["proc"]
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    out = dict(np.load(parity_run["out"]))
    betas = {n: np.array([out[f"{n}/beta/{i}"] for i in range(3)]) for n in (4, 1)}
    assert np.all(np.abs(np.diff(np.concatenate([[0.1], betas[1]]))) > 1e-3), betas  # beta really moves
    np.testing.assert_allclose(betas[4], betas[1], rtol=1e-4, err_msg="beta trajectory")
    params = sorted(k.split("/", 2)[2] for k in out if k.startswith("1/param/"))
    assert params
    for k in params:
        a, b = out[f"4/param/{k}"], out[f"1/param/{k}"]
        scale = max(float(np.max(np.abs(b))), 1e-3)
        err = float(np.max(np.abs(a - b)))
        assert err <= 1e-4 * scale, f"{k}: max |diff| {err:.3g} vs max |param| {scale:.3g}"
    metrics = sorted({k.split("/", 3)[3] for k in out if k.startswith("1/metric/")})
    for i in range(3):
        for k in metrics:
            a, b = float(out[f"4/metric/{i}/{k}"]), float(out[f"1/metric/{i}/{k}"])
            assert abs(a - b) <= 1e-4 * max(abs(b), 1.0), f"iteration {i} {k}: 4 devices {a} vs 1 device {b}"


def test_phases_compose_to_the_step(bench: Bench) -> None:
    """``Train.phases``, each compiled on its own by the benchmark's ``build_phases`` (what
    ``benchmarks/`` times) and chained by hand, give the step's parameters, optimiser state and
    beta: the phases are the step's code."""
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        import common
    finally:
        sys.path.remove(bench_dir)

    train = bench.train
    ph = common.build_phases(train)
    state = bench.state(_prop(1e-3), beta=0.05)
    env = bench.env(0.0)
    ro = ph["rollout"](state, env)
    sc = ph["scoring"](state, env, ro)
    ad = ph["advantages"](state, ro, sc)
    params, opt_state, stats = ph["update"](state, ad.batch)
    ctrl, kl_seen = ph["controller"](state, ad.kl_ctrl, ro.mask)
    want = _host((params, opt_state, ctrl.beta))
    new, m = train.step(state, env)
    got = _host((new.params, new.opt_state, new.ctrl.beta))
    # separately compiled programs fuse differently: equal up to float rounding
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    assert float(m["loss/total"]) == pytest.approx(float(stats["loss/total"]), rel=1e-4, abs=1e-6)
    assert float(m[f"ctrl/kl_observed_{bench.cfg.ctrl.unit}"]) == pytest.approx(float(kl_seen), rel=1e-5)
    assert float(new.ctrl.beta) != 0.05  # the controller really moved beta: the comparison says something


def test_ctrl_target_is_nan_for_fixed_members(bench: Bench) -> None:
    """A program that logs ``ctrl/target`` (a sweep with an adaptive member) logs NaN for a fixed one."""
    train = make_train(bench.cfg, bench.task, log_target=True)
    for ctrl_cfg, want in ((_prop(2.5), 2.5), (ControllerConfig(kind="fixed", target=2.5), None)):
        s = train.init(0)
        s = jax.device_put(s._replace(ctrl=control.from_config(ctrl_cfg).init(0.05)), bench.replicated)
        _, m = train.step(s, bench.env(0.0))
        got = float(m["ctrl/target"])
        assert np.isnan(got) if want is None else got == want, (ctrl_cfg.kind, got)


def test_update_stops_at_the_first_nonfinite_minibatch(tiny_cfg, tiny_task) -> None:
    """The in-place guard of the update phase against a Python loop: with a NaN advantage in one
    row, the minibatch updates before the one holding that row are applied (Adam by hand through
    optax, rows as ``ppo.shuffle=global`` documents them), none from it on; an all-NaN batch or
    ``go=False`` leaves the parameters and Adam state bit for bit as they were."""
    import optax

    from klrl.step.train import Batch

    cfg = tiny_cfg.replace(ppo={"epochs": 2, "minibatches": 2})
    tr = make_train(cfg, tiny_task)
    ctx, state = tr.context, tr.init(3)
    rng = np.random.default_rng(0)
    b, p, r = ctx.b_glob, ctx.p_len, ctx.r_len
    f = lambda: rng.standard_normal((b, r)).astype(np.float32)  # noqa: E731
    tokens = rng.integers(0, 147, (b, p + r)).astype(np.int32)
    batch = Batch(
        tokens=tokens, key_mask=np.ones((b, p + r), np.float32), response=tokens[:, p:],
        mask=np.ones((b, r), np.float32), logp=-np.abs(f()), ref_logp=-np.abs(f()), adv=f(), ret=f(),
        value=f(), ref_logits=None,
    )  # fmt: skip
    update = jax.jit(
        jax.shard_map(
            tr.phases.update, mesh=tr.mesh, in_specs=(P(), P("data"), P()), out_specs=P(),
            axis_names={"data"}, check_vma=False,
        )
    )  # fmt: skip
    # which minibatch (in order over epochs) first holds row `bad`: ppo.shuffle=global's rows
    k_perm = jax.random.split(jax.random.fold_in(state.rng, state.iteration), 3)[2]
    order = [np.asarray(jax.random.permutation(k, b)).reshape(2, -1) for k in jax.random.split(k_perm, 2)]
    rows = [mb for epoch in order for mb in epoch]
    grad = jax.jit(jax.grad(tr.loss, has_aux=True))
    beta_l = state.other_coef if ctx.drives_reward else state.ctrl.beta
    for bad in range(b):
        first = next(j for j, mb in enumerate(rows) if bad in mb)
        if first > 0:
            break
    adv = batch.adv.copy()
    adv[bad, 0] = np.nan
    params, opt_state, stats = update(state, batch._replace(adv=adv), jnp.array(True))
    assert float(stats["guard/minibatches_applied"]) == first / 4
    want, opt = state.params, state.opt_state
    for mb in rows[:first]:
        idx = np.sort(mb)
        x = jax.tree.map(lambda a, i=idx: a[i], batch)
        g, _ = grad(want, x, jnp.float32(float(x.mask.sum())), jnp.float32(len(mb)), beta_l)
        upd, opt = ctx.optimizer.update(g, opt, want)
        want = optax.apply_updates(want, upd)
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=2e-5, atol=1e-6), params, want)
    # nothing applied: bit for bit
    for go, adv_all in ((True, np.full_like(adv, np.nan)), (False, batch.adv)):
        params, opt_state, stats = update(state, batch._replace(adv=adv_all), jnp.array(go))
        assert float(stats["guard/minibatches_applied"]) == 0.0
        jax.tree.map(np.testing.assert_array_equal, (params, opt_state), (state.params, state.opt_state))


# ---- the reference in bfloat16 (model.ref_dtype) ------------------------------------------------

REF_BF16_TOL = 2e-2  # measured: max |bf16 - fp32| / max(|fp32|, 1) over the metrics below was 4.3e-3


def test_bf16_reference_halves_its_bytes_and_stays_close(tiny_cfg, tiny_task) -> None:
    """``model.ref_dtype=bfloat16``: every reference leaf is bf16 (half the bytes of the fp32
    run's, read from the arrays), three iterations stay finite and close to the fp32 run, and the
    refresh (``kl.ref_update_every=2``, ``ref_mix=1``) stores the policy rounded to bf16."""
    cfg = tiny_cfg.replace(kl={"ref_update_every": 2, "ref_mix": 1.0})
    runs = {}
    for dt in ("float32", "bfloat16"):
        tr = make_train(cfg.replace(model={"ref_dtype": dt}), tiny_task)
        s, ms = tr.init(0), []
        for _ in range(3):
            s, m = tr.step(s, tiny_task.env)
            ms.append(_host(m))
            if int(s.iteration) == 2:  # refreshed in the step just done: ref = that step's policy
                refreshed = _host((s.ref_params, s.params["policy"]))
        runs[dt] = (s, ms, refreshed)
    s32, m32, _ = runs["float32"]
    s16, m16, (ref, pol) = runs["bfloat16"]
    leaves16, leaves32 = jax.tree.leaves(s16.ref_params), jax.tree.leaves(s32.ref_params)
    assert {x.dtype for x in leaves16} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in leaves32} == {jnp.dtype(jnp.float32)}
    shard_bytes = lambda xs: sum(sh.data.nbytes for x in xs for sh in x.addressable_shards)
    assert 2 * shard_bytes(leaves16) == shard_bytes(leaves32) > 0
    assert jax.tree.leaves(s16.params)[0].dtype == jnp.float32  # the policy's master copy stays fp32
    for path, r in jax.tree_util.tree_leaves_with_path(ref):
        p = np.asarray(_at(pol, path))
        np.testing.assert_array_equal(r, p.astype(jnp.bfloat16), err_msg=jax.tree_util.keystr(path))
    worst = 0.0
    for i in range(3):
        for k, b in m32[i].items():
            a = m16[i][k]
            assert np.all(np.isfinite(a)) == np.all(np.isfinite(b)), (i, k)
            if np.all(np.isfinite(b)):
                err = float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1.0)
                worst = max(worst, err)
                assert err <= REF_BF16_TOL, f"iteration {i} {k}: bf16 reference {a} vs fp32 {b}"
    print(f"bf16 reference: worst relative metric difference {worst:.3g}")


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_frozen_reference_is_one_copy_the_step_passes_through(tiny_cfg, tiny_task) -> None:
    """A frozen reference (``kl.ref_update_every`` 0) is the task's loaded arrays: ``init`` does not
    copy them, the step neither donates nor returns them (the next state holds the same arrays, the
    donated policy's are gone), ``place`` (a restored state) adopts them when equal, and the compiled
    program outputs the reference's bytes less; a refreshed reference is a copy, donated and renewed
    by each step."""
    leaves = jax.tree.leaves
    env = tiny_task.env

    def ptrs(tree) -> list[int]:
        return [x.unsafe_buffer_pointer() for x in leaves(tree)]

    frozen = make_train(tiny_cfg, tiny_task)
    s = frozen.init(0)
    loaded = jax.tree.map(jnp.asarray, tiny_task.policy_params)
    assert ptrs(s.ref_params) == ptrs(loaded)
    ref_bytes = sum(x.nbytes for x in leaves(s.ref_params))
    out_frozen = frozen.step.lower(s, env).compile().memory_analysis().output_size_in_bytes
    old_policy = s.params["policy"]
    new, _ = frozen.step(s, env)
    assert all(a is b for a, b in zip(leaves(new.ref_params), leaves(s.ref_params), strict=True))
    assert not any(x.is_deleted() for x in leaves(s.ref_params))
    assert all(x.is_deleted() for x in leaves(old_policy))  # the rest of the state is donated
    again, _ = frozen.step(new, env)  # the returned state steps again (same placement, no recompile)
    assert ptrs(again.ref_params) == ptrs(loaded)
    # a state restored from host values (resume, rollback) adopts the loaded arrays when equal
    host = _host(again)
    assert ptrs(frozen.place(host).ref_params) == ptrs(loaded)
    other = frozen.place(host._replace(ref_params=_perturbed(host.ref_params, 0.01, seed=2)))
    assert set(ptrs(other.ref_params)).isdisjoint(ptrs(loaded))
    frozen.step(other, env)  # and steps (the same program)

    refreshed = make_train(tiny_cfg.replace(kl={"ref_update_every": 1, "ref_mix": 0.5}), tiny_task)
    r = refreshed.init(0)
    assert set(ptrs(r.ref_params)).isdisjoint(ptrs(loaded))
    out_refreshed = refreshed.step.lower(r, env).compile().memory_analysis().output_size_in_bytes
    assert ref_bytes <= out_refreshed - out_frozen <= ref_bytes + 1024  # (and the output tuple's pointers)
    r_new, _ = refreshed.step(r, env)
    assert all(x.is_deleted() for x in leaves(r.ref_params))
    pairs = zip(leaves(r_new.ref_params), leaves(loaded), strict=True)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs) > 0  # mixed towards the updated policy


# ---- gradient accumulation (ppo.grad_accum) and the critic's learning rate (optim.critic_lr) ----------


def _update_fn(tr):
    return jax.jit(
        jax.shard_map(
            tr.phases.update, mesh=tr.mesh, in_specs=(P(), P("data"), P()), out_specs=P(),
            axis_names={"data"}, check_vma=False,
        )
    )  # fmt: skip


def _ragged_batch(ctx, seed: int = 0):
    """A batch whose responses have very different lengths (1..R tokens, some none): micro-batches of
    one minibatch hold different token counts, so a mean of their token means is not the minibatch's."""
    from klrl.step.train import Batch

    rng = np.random.default_rng(seed)
    b, p, r = ctx.b_glob, ctx.p_len, ctx.r_len
    f = lambda: rng.standard_normal((b, r)).astype(np.float32)  # noqa: E731
    tokens = rng.integers(0, 147, (b, p + r)).astype(np.int32)
    lengths = rng.choice([0, 1, 1, 2, r, r], size=b)
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.float32)
    return Batch(
        tokens=tokens, key_mask=np.ones((b, p + r), np.float32), response=tokens[:, p:], mask=mask,
        logp=-np.abs(f()), ref_logp=-np.abs(f()), adv=f(), ret=f(), value=f(), ref_logits=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "upd",
    [
        {},  # value head on the policy trunk, token-mean KL in the loss, global shuffle
        {"model": {"value_model": "separate"}, "ppo": {"shuffle": "shard"}, "kl": {"loss_agg": "seq_mean"}},
        {"model": {"logits": "chunked", "logits_chunk": 3}},  # logit terms from hidden states (chunked)
    ],
    ids=["head_token_mean", "separate_seq_mean_shard", "chunked"],
)
def test_grad_accum_is_the_update_of_one_large_minibatch(tiny_cfg, tiny_task, upd) -> None:
    """``ppo.grad_accum = 4``: each minibatch of 8 rows in 4 micro-batches of 2 whose gradients are
    summed into one optimiser update gives the parameters, Adam state and statistics of the whole
    minibatch at once (float tolerance), on a ragged mask: each micro-batch's tokens weigh as in the
    whole minibatch's token mean."""
    base = tiny_cfg.replace(
        ppo={"epochs": 2, "minibatches": 2, "vf_coef": 0.5, **upd.get("ppo", {})},
        kl={"placement": "loss", "loss_coef": 0.3, "loss_estimator": "k3", **upd.get("kl", {})},
        model=upd.get("model", {}),
    )
    one = make_train(base, tiny_task)
    ctx, state = one.context, one.init(3)
    assert ctx.chunked == (base.model.logits == "chunked")
    batch = _ragged_batch(ctx)
    lengths = batch.mask.sum(-1)
    assert len(set(lengths.tolist())) >= 3 and lengths.min() == 0  # ragged, some empty
    want = _update_fn(one)(state, batch, jnp.array(True))
    accum = make_train(base.replace(ppo={"grad_accum": 4}), tiny_task)
    got = _update_fn(accum)(state, batch, jnp.array(True))
    assert float(got[2]["guard/minibatches_applied"]) == 1.0
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6), got[:2], want[:2])
    assert got[2].keys() == want[2].keys()
    for k in want[2]:
        np.testing.assert_allclose(got[2][k], want[2][k], rtol=1e-5, atol=1e-6, err_msg=k)
    pairs = zip(jax.tree.leaves(want[0]), jax.tree.leaves(state.params), strict=True)
    moved = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    assert moved > 1e-4  # the update did something: the comparison says something


def test_grad_accum_must_divide_the_minibatch_and_each_devices_share(tiny_cfg, tiny_task) -> None:
    from klrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^ppo.grad_accum: must divide the minibatch.*\(8 % 3 != 0\)"):
        tiny_cfg.replace(ppo={"minibatches": 2, "grad_accum": 3})
    with pytest.raises(ConfigError, match=r"^ppo.grad_accum: must be >= 1"):
        tiny_cfg.replace(ppo={"grad_accum": 0})
    # 4 data devices: each holds 2 rows of a minibatch of 8, which 4 micro-batches cannot split
    four = SimpleNamespace(shape={"data": 4, "fsdp": 1, "tensor": 1})
    with pytest.raises(ConfigError, match=r"^ppo.grad_accum: must divide each device's share.*; 2 % 4 != 0"):
        make_train(tiny_cfg.replace(ppo={"minibatches": 2, "grad_accum": 4}), tiny_task, mesh=four)


@pytest.mark.parametrize("separate", [False, True], ids=["head", "separate"])
def test_critic_lr_moves_only_the_critic_by_its_own_step(tiny_cfg, tiny_task, separate) -> None:
    """One optimiser step (1 epoch x 1 minibatch) of the update phase with ``optim.critic_lr = 10 lr``:
    the policy (the shared trunk included) moves bit for bit as with the default, the critic (the head
    on the trunk, or the whole separate value model) 10 times as far (Adam's first step: the same
    direction, scaled by the learning rate); ``critic_lr = lr`` is the default bit for bit over 4
    steps (2 epochs x 2 minibatches)."""
    from klrl.step.optim import is_critic

    model = {"value_model": "separate"} if separate else {}
    base = tiny_cfg.replace(
        ppo={"epochs": 1, "minibatches": 1, "vf_coef": 0.5}, optim={"lr": 1e-3}, model=model
    )
    default = make_train(base, tiny_task)
    state = default.init(3)
    batch = _ragged_batch(default.context, seed=1)
    want = _update_fn(default)(state, batch, jnp.array(True))[0]
    own = make_train(base.replace(optim={"critic_lr": 1e-2}), tiny_task)
    state_own = own.init(3)  # the same parameters; the optimiser state holds the critic's learning rate
    jax.tree.map(np.testing.assert_array_equal, state_own.params, state.params)
    got = _update_fn(own)(state_own, batch, jnp.array(True))[0]
    n_critic = 0
    for (path, g), w, s in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                               jax.tree.leaves(state.params), strict=True):  # fmt: skip
        g, w, s = np.asarray(g), np.asarray(w), np.asarray(s)
        if is_critic(path):
            n_critic += 1
            np.testing.assert_allclose(g - s, 10 * (w - s), rtol=1e-3, atol=1e-7)
            assert np.abs(w - s).max() > 1e-5
        else:
            np.testing.assert_array_equal(g, w)
    critic = state.params["value"] if separate else state.params["policy"]["v_head"]
    assert n_critic == len(jax.tree.leaves(critic)) >= 2  # (the head's kernel and bias at least)
    if separate:  # (the optimiser alone: tests/step/test_optim.py)
        return
    # critic_lr = lr: the default, bit for bit, over several steps
    four = base.replace(ppo={"epochs": 2, "minibatches": 2})
    want = _update_fn(make_train(four, tiny_task))(state, batch, jnp.array(True))
    same = make_train(four.replace(optim={"critic_lr": 1e-3}), tiny_task)
    got = _update_fn(same)(same.init(3), batch, jnp.array(True))
    jax.tree.map(np.testing.assert_array_equal, got[0], want[0])
    assert float(got[2]["guard/minibatches_applied"]) == 1.0


def test_remat_auto_picks_the_least_recomputation_that_fits_the_budget(tiny_cfg, tiny_task):
    """``model.remat=auto``: a budget above every mode's compiled step gives ``none``; one between the
    ``full`` and ``none`` steps' sizes gives a mode whose step fits it, and none needs less recomputation
    than one that does not fit; a budget below all gives ``full``."""
    from klrl.step.train import AUTO_ORDER, make_train, step_bytes

    cfg = tiny_cfg.replace(model={"remat": "none"})
    need = {m: step_bytes(make_train(cfg.replace(model={"remat": m}), tiny_task)) for m in AUTO_ORDER}
    assert need["full"] < need["none"]

    def picked(gb: float) -> str:
        auto = cfg.replace(model={"remat": "auto", "memory_gb": gb})
        return make_train(auto, tiny_task).context.cfg.model.remat

    assert picked(2 * need["none"] / 1e9) == "none"
    assert picked(need["full"] / 2e9) == "full"
    mid = (need["full"] + need["none"]) / 2
    got = picked(mid / 1e9)
    assert need[got] <= mid or got == "full"
    assert all(need[m] > mid for m in AUTO_ORDER[: AUTO_ORDER.index(got)])
