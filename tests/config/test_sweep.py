"""Sweeps: a 4-member sweep in one compiled program is, member by member, the 4 runs made one by one.

Tolerances. Parameters, per leaf: ``max|a - b| <= 1e-5 * max|b| + 1e-6``; the floor is a
thousandth of one Adam step at the largest learning rate here (1e-3): Adam turns float noise in
small gradients into parameter noise of that order for small-magnitude leaves (a LayerNorm bias of
scale 0.04 moved by 4e-7 between the 2 x 2 mesh and one device), while a wrong batch split or
average moves parameters by whole steps. One slice is left out of that
comparison: the attention *key* bias, whose gradient is exactly zero (softmax is invariant to
adding ``q . b_k`` to every score of a query), so Adam moves it only by float noise, which differs
with the reduction order (vmapped vs plain matmuls); it is checked to stay within 1e-5 of the
reference instead. Metrics: ``|a - b| <= 1e-5 * |b| + 1e-5``: the absolute floor is for metrics
near zero (KL at iteration 0 is ~1e-7, loss terms ~1e-4) whose float noise is ~1e-7 absolute.
beta: relative 1e-5 with a 1e-7 floor (dual ascent adds ``lr * KL``: the KL's absolute noise).

Compiled programs: the in-process sweep (1 device); one subprocess runs the 4 members with
``klrl.run`` (one compile, then XLA's persistent cache for the 3 identical programs); another,
with 4 forced host devices, runs the sweep on a 2 x 2 (sweep x data) mesh. Both subprocesses start
at the top of the module and overlap the in-process sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import xla_flags

from klrl.analysis.results import member_names
from klrl.config import ConfigError, RunConfig
from klrl.config.sweep import check_members, check_overrides, grid, parse_axis, unread

RTOL = 1e-5
ATOL_METRIC = 1e-5
ATOL_BETA = 1e-7
KEY_BIAS_DRIFT = 1e-5
ATOL_PARAM = 1e-6
ITERATIONS = 3
TIMEOUT = 420  # seconds, per subprocess; generous for a loaded 2-core machine


def members_of(base: RunConfig) -> list[RunConfig]:
    """Four members: different beta, controller kind, seed; one with its own learning rate."""
    return [
        base.replace(kl={"beta": 0.05}, ctrl={"kind": "proportional", "target": 0.5, "horizon": 100.0},
                     train={"seed": 0}),
        base.replace(kl={"beta": 0.1}, ctrl={"kind": "pi", "target": 0.5, "kp": 0.5}, train={"seed": 1}),
        base.replace(kl={"beta": 0.2}, ctrl={"kind": "band", "target": 0.5}, train={"seed": 2},
                     optim={"lr": 1e-3}),
        base.replace(kl={"beta": 0.1}, ctrl={"kind": "dual", "target": 0.01, "lr": 0.1}, train={"seed": 3}),
    ]  # fmt: skip


# ---- subprocesses ------------------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from klrl.config import RunConfig

    mode, cfg_path, out_path, cache = sys.argv[1:5]
    members = [RunConfig.from_dict(d) for d in json.load(open(cfg_path))]
    from klrl.tasks.wordclass import make_task
    task = make_task(members[0])  # the reference comes from the session's cache: no pretraining here

    out = {}
    def dump(j, metrics, state):
        for k, v in metrics.items():
            out[f"{j}/metric/{k}"] = np.asarray(v)
        out[f"{j}/beta"] = np.asarray(state.ctrl.beta)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
            out[f"{j}/param/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)

    if mode == "runs":  # the members one by one, as a user runs them
        # the 4 programs are identical (beta, controller, seed and lr live in the state):
        # compile once, then hit XLA's persistent cache
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        import klrl
        for j, m in enumerate(members):
            r = klrl.run(m, task=task, write=False)
            dump(j, r.metrics, r.state)
    else:  # one sweep on a 2 x 2 (sweep x data) mesh
        assert jax.device_count() == 4, jax.devices()
        from klrl.api import sweep
        rs = sweep([m.replace(train={"devices": 2}) for m in members], task=task, write=False,
                   sweep_devices=2)
        for j, r in enumerate(rs):
            dump(j, r.metrics, r.state)
    np.savez(out_path, **out)
    """
)


def _start(tmp, mode: str, members: list[RunConfig], n_devices: int) -> dict:
    (tmp / "members.json").write_text(json.dumps([m.to_dict() for m in members]))
    (tmp / "script.py").write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(n_devices if n_devices > 1 else None)
    args = [mode, str(tmp / "members.json"), str(tmp / "out.npz"), str(tmp / "xla-cache")]
    proc = subprocess.Popen(
        [sys.executable, str(tmp / "script.py"), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return {"proc": proc, "out": tmp / "out.npz"}


def _collect(handle: dict) -> dict[str, np.ndarray]:
    proc = handle["proc"]
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"subprocess did not finish in {TIMEOUT} s")
    assert proc.returncode == 0, stderr[-3000:]
    return dict(np.load(handle["out"]))


@pytest.fixture(scope="module")
def members(tiny_cfg) -> list[RunConfig]:
    return members_of(tiny_cfg.replace(train={"iterations": ITERATIONS}))


@pytest.fixture(scope="module")
def subprocs(members, tiny_task, tmp_path_factory):
    """Both subprocesses, started together (after the session's task is cached); killed at teardown."""
    handles = {
        "runs": _start(tmp_path_factory.mktemp("sweep-runs"), "runs", members, 1),
        "mesh": _start(tmp_path_factory.mktemp("sweep-mesh"), "mesh", members, 4),
    }
    try:
        yield handles
    finally:
        for h in handles.values():
            if h["proc"].poll() is None:
                h["proc"].kill()
                h["proc"].communicate()


@pytest.fixture(scope="module")
def swept(members, tiny_task, subprocs, tmp_path_factory):
    """The in-process sweep on one device, written to disk: ``(results, root)``."""
    from klrl.api import sweep

    root = tmp_path_factory.mktemp("sweep-out") / "sweep"
    return sweep(members, task=tiny_task, out_dir=root, write=True), root


def _as_dump(results) -> dict[str, np.ndarray]:
    import jax

    out = {}
    for j, r in enumerate(results):
        for k, v in r.metrics.items():
            out[f"{j}/metric/{k}"] = v
        out[f"{j}/beta"] = np.asarray(r.state.ctrl.beta)
        for path, leaf in jax.tree_util.tree_leaves_with_path(r.state.params):
            out[f"{j}/param/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


def _key_bias(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a fused qkv bias ``[3 * d]`` (q, k, v blocks) into (key bias, query and value biases)."""
    q, k, v = np.split(x, 3)
    return k, np.concatenate([q, v])


def compare(got: dict, want: dict, n: int, ref_params: dict, what: str) -> dict[str, float]:
    """Assert ``got`` matches ``want`` member by member; returns the worst relative errors seen."""
    worst = {
        "param_rel": 0.0,
        "metric_rel": 0.0,
        "metric_abs_near_0": 0.0,
        "beta_rel": 0.0,
        "key_bias_drift": 0.0,
    }
    got = dict(got)
    for j in range(n):
        pre = f"{j}/"
        tgt = f"{pre}metric/ctrl/target"
        if tgt in got and tgt not in want:  # a fixed member of a mixed sweep logs NaN, its single run nothing
            assert np.all(np.isnan(got.pop(tgt))), f"{what}: member {j} ctrl/target"
        keys = sorted(k for k in want if k.startswith(pre))
        assert keys and keys == sorted(k for k in got if k.startswith(pre)), f"{what}: member {j} keys"
        b_got, b_want = got[f"{pre}beta"], want[f"{pre}beta"]
        np.testing.assert_allclose(
            b_got, b_want, rtol=RTOL, atol=ATOL_BETA, err_msg=f"{what}: member {j} beta"
        )
        traj_g, traj_w = got[f"{pre}metric/ctrl/beta"], want[f"{pre}metric/ctrl/beta"]
        np.testing.assert_allclose(traj_g, traj_w, rtol=RTOL, atol=ATOL_BETA, err_msg=f"{what}: beta {j}")
        worst["beta_rel"] = max(worst["beta_rel"], float(np.max(np.abs(traj_g - traj_w) / np.abs(traj_w))))
        for k in keys:
            a, b = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
            if "/metric/" in k:
                assert a.shape == b.shape == (ITERATIONS,), k
                err = np.abs(a - b)
                ok = err <= RTOL * np.abs(b) + ATOL_METRIC
                assert np.all(ok), f"{what}: {k}: {a} vs {b}"
                big = np.abs(b) >= 1e-2  # relative error where it means something, absolute near 0
                if np.any(big):
                    worst["metric_rel"] = max(worst["metric_rel"], float(np.max(err[big] / np.abs(b[big]))))
                if np.any(~big):
                    worst["metric_abs_near_0"] = max(worst["metric_abs_near_0"], float(np.max(err[~big])))
            elif "/param/" in k:
                name = k.split("/param/", 1)[1]
                if "qkv" in name and "bias" in name:
                    (ka, a), (kb, b) = _key_bias(a), _key_bias(b)
                    k_ref = _key_bias(np.asarray(ref_params[name], np.float64))[0]
                    drift = float(max(np.max(np.abs(ka - k_ref)), np.max(np.abs(kb - k_ref))))
                    assert drift <= KEY_BIAS_DRIFT, f"{what}: {k}: key bias moved by {drift:.3g}"
                    worst["key_bias_drift"] = max(worst["key_bias_drift"], drift)
                scale = float(np.max(np.abs(b)))
                err = float(np.max(np.abs(a - b)))
                assert err <= RTOL * scale + ATOL_PARAM, (
                    f"{what}: {k}: max|diff| {err:.3g} vs max|param| {scale:.3g}"
                )
                worst["param_rel"] = max(worst["param_rel"], err / scale)
    return worst


def _reference_params(task) -> dict[str, np.ndarray]:
    """The pretrained reference under the policy's key paths (what every member starts from)."""
    import jax

    return {
        f"['policy']{jax.tree_util.keystr(p)}": np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(task.ref_params)
    }


# ---- the tests -----------------------------------------------------------------------------------


def test_sweep_matches_separate_runs(swept, subprocs, members, tiny_task) -> None:
    results, _ = swept
    got = _as_dump(results)
    want = _collect(subprocs["runs"])
    for j in range(len(members)):  # every controller really moves beta (so the trajectories say something)
        traj = want[f"{j}/metric/ctrl/beta"]
        assert np.all(np.abs(np.diff(np.concatenate([[members[j].kl.beta], traj]))) > 1e-4), (j, traj)
    worst = compare(got, want, len(members), _reference_params(tiny_task), "sweep vs klrl.run")
    print(f"sweep vs separate klrl.run: worst relative errors {worst}")


def test_mesh_2x2_matches_unsharded_sweep(swept, subprocs, members, tiny_task) -> None:
    results, _ = swept
    got = _collect(subprocs["mesh"])
    worst = compare(
        got, _as_dump(results), len(members), _reference_params(tiny_task), "2x2 mesh vs 1 device"
    )
    print(f"2 x 2 mesh vs 1 device: worst relative errors {worst}")


def test_written_member_directories(swept, members) -> None:
    results, root = swept
    index = json.loads((root / "sweep.json").read_text())
    assert index["members"] == member_names(members) and set(index["axes"]) >= {"kl.beta", "train.seed"}
    assert index["axes"]["kl.beta"] == [0.05, 0.1, 0.2]
    for j, (m, r) in enumerate(zip(members, results, strict=True)):
        d = root / index["members"][j]
        assert r.dir == d
        assert RunConfig.from_dict(json.loads((d / "config.json").read_text())) == m
        lines = (d / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == ITERATIONS
        rows = [json.loads(line) for line in lines]
        assert [row["iteration"] for row in rows] == list(range(ITERATIONS))
        np.testing.assert_allclose([row["ctrl/beta"] for row in rows], r.metrics["ctrl/beta"], rtol=1e-6)
        assert (d / "summary.json").exists()


def test_non_sweepable_field_is_a_config_error(members, tiny_task) -> None:
    from klrl.api import sweep

    bad = [*members[:3], members[3].replace(sampling={"response_len": 4})]
    with pytest.raises(ConfigError, match=r"sampling\.response_len"):
        check_members(bad)
    with pytest.raises(ConfigError, match=r"sampling\.response_len"):  # before anything compiles
        sweep(bad, task=tiny_task, write=False)
    with pytest.raises(ConfigError, match=r"kl\.estimator"):
        check_members([members[0], members[1].replace(kl={"estimator": "k3"})])
    check_members(members)  # beta, controller kind and knobs, seed and lr may differ


def test_grid_is_the_cartesian_product() -> None:
    base = RunConfig()
    g = grid(base, {"kl.beta": [0.01, 0.1], "train.seed": [0, 1, 2]})
    assert len(g) == 6
    assert [(c.kl.beta, c.train.seed) for c in g] == [(b, s) for b in (0.01, 0.1) for s in (0, 1, 2)]
    assert all(c.model == base.model for c in g)
    assert grid(base, {}) == [base]
    with pytest.raises(ConfigError, match=r"kl\.beta"):
        grid(base, {"kl.beta": [0.1, -1.0]})  # every member is validated


def test_grid_refuses_members_that_are_the_same_run() -> None:
    """``--sweep train.name=a,b`` ran two identical members into ``a``; so would a value given twice or a
    controller knob the members' controller does not read: refused, naming the axis."""
    base = RunConfig()
    cases = [
        ({"train.name": ["a", "b"]}, r"^--sweep train\.name: per-run bookkeeping"),
        ({"kl.beta": [0.1, 0.1]}, r"^--sweep kl\.beta: value 0\.1 given twice"),
        ({"train.seed": [0, 1], "kl.beta": [1.0, 0.5, 1.0]}, r"^--sweep kl\.beta: value 1\.0 given twice"),
        ({"ctrl.kp": [0.1, 0.2]}, r"^--sweep ctrl\.kp: two members would be the same run \(ctrl\.kp=0\.1 and "
                                  r"0\.2\): their maths does not read ctrl\.kp with ctrl\.kind=fixed$"),
        ({"ctrl.kind": ["fixed", "proportional"], "ctrl.kp": [0.1, 0.2]}, r"^--sweep ctrl\.kp: two members"),
        ({"ctrl.warmup_beta": [0.1, 0.2]}, r"^--sweep ctrl\.warmup_beta: two members would be the same run"),
    ]  # fmt: skip
    for axes, want in cases:
        with pytest.raises(ConfigError, match=want):
            grid(base, axes)
    warm = base.replace(ctrl={"warmup_iters": 3})
    with pytest.raises(ConfigError, match=r"does not read kl\.beta with ctrl\.warmup_iters=3$"):
        grid(warm, {"kl.beta": [0.1, 1.0]})
    assert len(grid(warm, {"ctrl.warmup_beta": [0.1, 0.2]})) == 2
    assert len(grid(base.replace(ctrl={"kind": "pi"}), {"ctrl.kp": [0.1, 0.2]})) == 2
    with pytest.raises(
        ConfigError, match=r"does not read ctrl\.kp with ctrl\.kind=dual$"
    ):  # pi's do, dual's not
        grid(base, {"ctrl.kind": ["pi", "dual"], "ctrl.kp": [0.1, 0.2]})


def test_unread_fields_by_controller_kind() -> None:
    """Against the controllers themselves (klrl.algo.control): a knob is read by a kind iff changing it
    changes beta's trajectory over a few updates at KLs off the target; ``kl.beta`` and ``warmup_beta``
    alike with and without a warm-up."""
    from klrl.algo.control import from_config

    knobs = ("target", "horizon", "clip", "band", "factor", "kp", "ki", "integral_max", "step_clip", "lr")
    bigger = {"step_clip": 0.9, "integral_max": 0.5}  # (a clamp the 5 updates reach)

    def trajectory(cfg: RunConfig) -> list[float]:
        c = from_config(cfg.ctrl)
        s = c.init(cfg.kl.beta)
        out = []
        for kl in (30.0, 0.5, 12.0, 3.0, 40.0):
            s = c.update(s, kl, 64)
            out.append(float(s.beta))
        return out

    for kind in ("fixed", "proportional", "band", "pi", "dual"):
        for warm in (0, 2):
            cfg = RunConfig().replace(ctrl={"kind": kind, "warmup_iters": warm, "kp": 0.5, "ki": 0.2})
            ref = trajectory(cfg)
            moved = {
                f"ctrl.{k}"
                for k in knobs
                if trajectory(cfg.replace(ctrl={k: bigger.get(k, getattr(cfg.ctrl, k) * 1.7)})) != ref
            }
            if trajectory(cfg.replace(kl={"beta": 0.37})) != ref:
                moved.add("kl.beta")
            if trajectory(cfg.replace(ctrl={"warmup_beta": 0.37})) != ref:
                moved.add("ctrl.warmup_beta")  # fmt: skip
            candidates = {f"ctrl.{k}" for k in knobs} | {"kl.beta", "ctrl.warmup_beta"}
            assert unread(cfg) == (candidates - moved) | {"train.name"}, (kind, warm)


def test_check_overrides_names_the_flag_the_members_would_ignore() -> None:
    base = RunConfig()
    study = [base.replace(kl={"beta": b}) for b in (0.01, 0.1, 1.0)]
    study.append(
        base.replace(kl={"beta": 0.1}, ctrl={"kind": "proportional", "target": 3.0, "horizon": 1000.0})
    )
    check_overrides(["train.seed", "ctrl.clip", "ctrl.beta_max"], base, study, "the study")  # all read
    cases = [
        (["kl.beta"], r"^kl\.beta: set per member by the study \(0\.01, 0\.1, 1\), so the value given would "
                      r"be ignored; choose the values with --sweep kl\.beta=v1,v2$"),
        (["ctrl.kind"], r"^ctrl\.kind: set per member by the study \(fixed, proportional\)"),
        (["ctrl.horizon"], r"^ctrl\.horizon: set per member by the study \(10000, 1000\)"),
        (["train.seed", "ctrl.kp"], r"^ctrl\.kp: read by no member of the study \(ctrl\.kind fixed, "
                                    r"proportional, ctrl\.warmup_iters 0\), so the value given would be "
                                    r"ignored$"),
    ]  # fmt: skip
    for given, want in cases:
        with pytest.raises(ConfigError, match=want):
            check_overrides(given, base, study, "the study")
    with pytest.raises(ConfigError, match=r"^the study: members 0 and 1 would be the same run: their maths "
                       r"does not read kl\.beta \(ctrl\.kind fixed, ctrl\.warmup_iters 4\)$"):  # fmt: skip
        check_overrides([], base, [m.replace(ctrl={"warmup_iters": 4}) for m in study], "the study")
    swept = grid(base, {"kl.beta": [0.1, 1.0]})
    with pytest.raises(ConfigError, match=r"^kl\.beta: set per member by --sweep \(0\.1, 1\), so the value "
                       r"given would be ignored$"):  # fmt: skip
        check_overrides(["kl.beta"], base.replace(kl={"beta": 0.5}), swept, "--sweep")


def test_parse_axis() -> None:
    base = RunConfig()
    assert parse_axis("kl.beta=0.001,0.01,0.1,1.0", base) == ("kl.beta", [0.001, 0.01, 0.1, 1.0])
    name, seeds = parse_axis("train.seed=0,1", base)
    assert name == "train.seed" and seeds == [0, 1] and all(type(s) is int for s in seeds)
    assert parse_axis("ctrl.kind=pi,dual", base) == ("ctrl.kind", ["pi", "dual"])
    assert parse_axis("ctrl.warmup_beta=0.1,0.2", base) == ("ctrl.warmup_beta", [0.1, 0.2])
    for spec, match in [
        ("kl.beta", "expected"),
        ("beta=0.1", "unknown field"),
        ("kl.betta=0.1", "unknown field"),
        ("nosuch.beta=0.1", "unknown field"),
        ("train.seed=0,x", "train.seed"),
        (
            "sampling.use_eos=true,false",
            r"^--sweep sampling\.use_eos: cannot differ between sweep members \(it fixes",
        ),
        ("train.name=a,b", r"^--sweep train\.name: per-run bookkeeping, one value for the whole sweep"),
        ("train.out_dir=a,b", r"^--sweep train\.out_dir: per-run bookkeeping"),
        ("train.quiet=true,false", r"^--sweep train\.quiet: per-run bookkeeping"),
        ("diag.persist=1,2", r"^--sweep diag\.persist: per-run bookkeeping"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_axis(spec, base)


def test_a_sweep_over_the_loss_coefficient_is_one_program_whose_members_are_single_runs(tiny_cfg, tiny_task):
    """GRPO's KL in the loss (k3, ``kl.loss_coef`` in the state, the fixed controller driving it) at two
    coefficients in one compiled sweep: each member's metrics are those of ``klrl.run`` of it alone, and the
    two differ (the coefficient reaches the loss)."""
    from klrl.api import run, sweep

    base = tiny_cfg.replace(kl={"placement": "loss", "loss_estimator": "k3"}, ctrl={"drives": "loss"},
                            train={"iterations": 2})  # fmt: skip
    members = [base.replace(kl={"loss_coef": c}) for c in (0.04, 2.0)]
    got = list(sweep(members, task=tiny_task, write=False))
    for m, r in zip(members, got, strict=True):
        want = run(m, task=tiny_task, write=False)
        assert np.allclose(r.metrics["ctrl/loss_coef"], m.kl.loss_coef)
        for k in ("loss/policy", "kl/loss_term", "reward/task"):
            if k in want.metrics:
                np.testing.assert_allclose(r.metrics[k], want.metrics[k], rtol=1e-4, atol=1e-6, err_msg=k)
    a, b = (np.asarray(r.metrics["loss/policy"]) for r in got)
    assert not np.allclose(a, b)
