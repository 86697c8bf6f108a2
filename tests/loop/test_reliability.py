"""Guards (issue 6): the non-finite stop, the quality rollback and configuration checking.

* The rollback decision is a pure function over a metric trace and the checkpoint steps:
  tested on examples and, with hypothesis, for its defining properties.
* Injected NaN rewards: each update is skipped (parameters unchanged, ``guard/skipped``
  counts it); K in a row stop the run with a one-line message (exit status 1 from the CLI)
  and the last good state checkpointed.
* A real run whose metric crosses the threshold rolls back to the right checkpoint (the
  re-run iteration samples exactly what the original did) with beta doubled.
* Random invalid configurations are rejected with exit status 2 and one line naming the
  field, before anything is built; random valid small ones build and run an iteration.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klrl.loop.reliability import decide_rollback, first_crossing, is_bad, is_good, skip_stop

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "run.py"

from conftest import base_config, cli_args, lines, run_main, xla_flags  # noqa: E402  (jax_cache: a conftest fixture)

# ---- the rollback decision, pure ---------------------------------------------------------------


def test_rollback_beta_compounds_over_repeated_rollbacks():
    from klrl.loop.reliability import rollback_beta

    beta = 0.05  # a fixed controller: the checkpoint and the failing state hold the same beta
    for k in range(1, 4):  # rolled back to the same checkpoint (beta 0.05) three times
        beta = rollback_beta(0.05, beta, 2.0)
        assert beta == pytest.approx(0.05 * 2**k)
    # an adaptive controller that lowered beta before the crossing: the restored one is larger
    assert rollback_beta(0.2, 0.03, 2.0) == pytest.approx(0.4)


def test_decide_rollback_examples():
    trace = [10.0, 10.5, 10.2, 10.8, 11.5, 12.0]  # threshold 1.1: 11.5 (iteration 4) is the first past 11
    assert first_crossing(trace, 1.1) == 4
    d = decide_rollback(trace, [2, 4, 6], 1.1)
    assert (d.crossing, d.step, d.value) == (4, 2, 11.5)
    assert d.ratio == pytest.approx(1.15)
    assert decide_rollback(trace, [1, 2, 3, 4, 5], 1.1).step == 3  # newest good step <= crossing
    assert decide_rollback(trace, [5, 6], 1.1).step == 0  # none before the crossing: the initial state
    assert decide_rollback(trace, [], 1.1).step == 0
    assert decide_rollback(trace[:4], [2], 1.1) is None  # not crossed yet
    assert decide_rollback(trace, [2], 1.3) is None
    # a checkpoint whose own metric is bad is skipped (after a resume with a lower threshold)
    assert decide_rollback([10.0, 12.0, 10.0, 12.0], [1, 2, 3], 1.1).step == 0
    # threshold < 1: falling below is bad (e.g. a reward)
    assert decide_rollback([1.0, 0.95, 0.7, 0.6], [1, 2], 0.8) == decide_rollback(
        [1.0, 0.95, 0.7, 0.6], [1, 2], 0.8
    )
    assert decide_rollback([1.0, 0.95, 0.7, 0.6], [1, 2], 0.8).step == 1
    # an explicit base (the iteration-0 value when the trace was cut back to 0 by a rollback)
    assert decide_rollback([11.5], [], 1.1, base=10.0).crossing == 0


def test_nonfinite_and_invalid_base():
    assert not is_bad(math.nan, 10.0, 1.1) and not is_good(math.nan, 10.0, 1.1)
    assert not is_bad(math.inf, 10.0, 1.1)
    for base in (0.0, -1.0, math.nan, math.inf):
        assert not is_bad(100.0, base, 1.1)  # no meaningful ratio: the check is off
    assert decide_rollback([0.0, 5.0, 9.0], [1], 1.1) is None
    assert decide_rollback([10.0, math.nan, 12.0], [1], 1.1).step == 0  # NaN is not "good"


def test_skip_stop():
    assert not skip_stop(4, 5) and skip_stop(5, 5) and skip_stop(6, 5)
    assert not skip_stop(10**6, 0)  # 0 = never stop


traces = st.lists(st.floats(0.1, 100.0, allow_nan=False), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    trace=traces,
    steps=st.sets(st.integers(1, 45), max_size=12),
    threshold=st.one_of(st.floats(1.01, 3.0), st.floats(0.2, 0.99)),
)
def test_decide_rollback_properties(trace, steps, threshold):
    d = decide_rollback(trace, sorted(steps), threshold)
    base = trace[0]
    bad = [is_bad(v, base, threshold) for v in trace]
    if not any(bad):
        assert d is None
        return
    t = bad.index(True)
    assert d.crossing == t and d.value == trace[t]
    # the target is a checkpoint (or 0) at or before the crossing whose metric is good...
    assert d.step == 0 or (d.step in steps and d.step <= t and is_good(trace[d.step], base, threshold))
    # ...and the newest such one
    newer = [s for s in steps if d.step < s <= t and is_good(trace[s], base, threshold)]
    assert not newer
    # everything before the crossing was fine, so every checkpoint before it qualifies
    before = [s for s in steps if s < t]
    assert d.step == max(before, default=0)


# ---- check_resumable, pure ----------------------------------------------------------------------


def test_check_resumable_rules():
    from klrl.config import ConfigError, RunConfig
    from klrl.io.resume import RESUME_MUTABLE, check_resumable, config_diff

    a = RunConfig()
    knobs = {"iterations": 500, "quiet": True, "log_every": 7, "out_dir": "x", "name": "y",
             "checkpoint_every": 3, "keep_checkpoints": 9, "max_consecutive_skips": 0,
             "rollback_metric": "eval/oracle_ppl_floored", "rollback_threshold": 1.3, "rollback_factor": 4.0,
             "max_rollbacks": 1}  # fmt: skip
    b = a.replace(train=knobs)
    assert set(config_diff(a, b)) == {f"train.{k}" for k in knobs} <= RESUME_MUTABLE
    check_resumable(a, b)  # all allowed
    check_resumable(a.to_dict(), b)
    tracked = a.replace(log={"wandb": True, "wandb_mode": "offline", "wandb_project": "p"})
    check_resumable(a, tracked)  # the trackers may change
    check_resumable({k: v for k, v in a.to_dict().items() if k != "log"}, tracked)  # a run from before log.*
    for change, field in [
        ({"model": {"d_model": 128}}, "model.d_model"),
        ({"train": {"batch_size": 32}}, "train.batch_size"),
        ({"train": {"seed": 1}}, "train.seed"),
        ({"train": {"devices": 1}}, "train.devices"),
        ({"kl": {"estimator": "k3"}}, "kl.estimator"),
        ({"sampling": {"response_len": 8}}, "sampling.response_len"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            check_resumable(a, a.replace(**change))
    lin = a.replace(optim={"schedule": "linear"})
    check_resumable(lin, lin.replace(train={"quiet": True}))
    with pytest.raises(ConfigError, match=r"train\.iterations: cannot change on resume with optim\.schedule"):
        check_resumable(lin, lin.replace(train={"iterations": 200}))


# ---- configuration: invalid rejected (exit 2, one line, nothing built), valid ones run ----------

# field -> strategy of values that break its rule (as command-line strings)
INVALID = {
    "train.iterations": st.integers(-5, 0).map(str),
    "train.batch_size": st.integers(-3, 0).map(str),
    "train.checkpoint_every": st.integers(-9, -1).map(str),
    "train.keep_checkpoints": st.integers(-3, 0).map(str),
    "train.max_consecutive_skips": st.integers(-9, -1).map(str),
    "train.rollback_threshold": st.sampled_from(["0", "-1.5", "1", "1.0", "nan", "inf"]),
    "train.rollback_factor": st.one_of(st.floats(-2, 1).map(repr), st.sampled_from(["nan", "inf"])),
    "train.max_rollbacks": st.integers(-9, -1).map(str),
    "kl.beta": st.floats(-10, -1e-6).map(repr),
    "ctrl.target": st.floats(-5, 0).map(repr),
    "sampling.response_len": st.integers(-4, 0).map(str),
    "optim.lr": st.sampled_from(["0", "-0.1", "nan", "inf"]),
    "ppo.clip": st.floats(-1, 0).map(repr),
    "model.n_heads": st.sampled_from(["3", "5", "7"]),  # must divide model.d_model (64)
    "ppo.minibatches": st.sampled_from(["3", "5", "7"]),  # must divide train.batch_size (64)
    "kl.estimator": st.sampled_from(["k4", "KL", ""]),
    "ctrl.kind": st.sampled_from(["pid", "adaptive"]),
    "train.log_every": st.sampled_from(["abc", "1.5", "0"]),
    "sampling.use_eos": st.sampled_from(["maybe", "2"]),
}
VALID_EXTRA = st.lists(
    st.sampled_from(
        [("kl.beta", "0.2"), ("train.iterations", "7"), ("ctrl.kind", "pi"), ("train.rollback_metric", "x"),
         ("train.checkpoint_every", "0"), ("ppo.epochs", "2"), ("sampling.temperature", "0.7")]
    ),
    max_size=3,
    unique_by=lambda x: x[0],
)  # fmt: skip


@st.composite
def invalid_args(draw):
    field = draw(st.sampled_from(sorted(INVALID)))
    value = draw(INVALID[field])
    extra = [x for x in draw(VALID_EXTRA) if x[0] != field]
    args = [a for kv in extra for a in (f"--{kv[0]}", kv[1])]
    return field, [*args, f"--{field}", value]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=invalid_args())
def test_invalid_configs_rejected_in_process(case, capsys):
    from klrl.cli.args import build_parser, config_from_args

    field, argv = case
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        config_from_args(build_parser().parse_args(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0], (argv, err)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=invalid_args())
def test_invalid_configs_rejected_by_the_cli(case, tmp_path_factory):
    field, argv = case
    out = tmp_path_factory.mktemp("invalid")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1")  # any compilation would be logged
    p = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--train.out_dir", str(out / "runs")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0], err  # nothing compiled
    assert not (out / "runs").exists()


@st.composite
def valid_configs(draw):
    adv = draw(st.sampled_from(["gae", "grpo", "rloo"]))
    group = 2 if adv != "gae" else draw(st.sampled_from([1, 2]))
    batch = draw(st.sampled_from([4, 8]))
    placement = draw(st.sampled_from(["reward", "sequence", "loss", "reward+loss"]))
    in_loss, in_reward = placement in ("loss", "reward+loss"), placement != "loss"  # no field without effect
    return {
        "kl": {
            "estimator": draw(st.sampled_from(["k1", "k2", "k3", "abs", "full"])) if in_reward else "k1",
            "placement": placement,
            "beta": draw(st.floats(0.0, 0.5)) if in_reward else 0.05,
            "loss_coef": draw(st.sampled_from([0.0, 0.1])) if in_loss else 0.0,
        },
        "ctrl": {"kind": draw(st.sampled_from(["fixed", "proportional", "band", "pi", "dual"]))},
        "ppo": {"advantage": adv, "group_size": group, "minibatches": draw(st.sampled_from([1, 2])),
                "epochs": 1},
        "sampling": {"response_len": draw(st.integers(2, 6)), "top_k": draw(st.sampled_from([0, 5])),
                     "temperature": draw(st.sampled_from([0.7, 1.0]))},
        "model": {"value_model": draw(st.sampled_from(["head", "separate"]))},
        "train": {"batch_size": batch, "iterations": 1, "seed": draw(st.integers(0, 2**31 - 1))},
    }  # fmt: skip


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=valid_configs())
def test_valid_small_configs_run_one_iteration(changes, tiny_task, cache_dir, jax_cache):
    import klrl

    cfg = base_config(cache_dir).replace(**changes)
    result = klrl.run(cfg, task=tiny_task, write=False)
    assert result.info["iteration"] == 1 and int(result.state.iteration) == 1
    assert all(len(v) == 1 for v in result.metrics.values())
    assert np.isfinite(result.metrics["reward/task"][0])


# ---- the non-finite guard in the loop -----------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_nan_rewards_skip_and_stop(k, tiny_task, cache_dir, jax_cache, tmp_path):
    import klrl
    from klrl.io import checkpoint as ckpt
    from klrl.loop.reliability import RunStopped
    from klrl.step.train import make_train
    from klrl.tasks.base import JaxReward

    def nan_reward(env, ro):
        return jnp.full(ro.response.shape[:1], jnp.nan, jnp.float32)

    task = dataclasses.replace(tiny_task, reward=JaxReward(nan_reward, tiny_task.reward.params))
    # an adaptive controller far from its target: each rejected update would have moved beta
    cfg = base_config(cache_dir, iterations=20, max_consecutive_skips=k, checkpoint_every=0).replace(
        ctrl={"kind": "proportional", "target": 1e-4, "horizon": 10.0}
    )
    with pytest.raises(RunStopped) as e:
        klrl.run(cfg, task=task, run_dir=tmp_path / "r")
    msg = str(e.value)
    # the loop sees iteration i's metrics while i + 1 already runs; the step after the K-th skip is a
    # no-op, so the run stops after exactly K skips
    rows = [json.loads(x) for x in lines(tmp_path / "r" / "metrics.jsonl")]
    n = len(rows)
    assert n == k
    assert "\n" not in msg and f"{n} consecutive iterations skipped by the non-finite guard" in msg
    assert [r["guard/skipped"] for r in rows] == [1.0] * n
    assert [r["guard/consecutive_skips"] for r in rows] == [float(j + 1) for j in range(n)]
    assert rows[0]["reward/task"] == "nan"
    # a skipped row logs the beta the state keeps, not the rejected update's
    assert [r["ctrl/beta"] for r in rows] == [pytest.approx(cfg.kl.beta, rel=1e-7)] * n
    # the last good state is checkpointed: the parameters (and optimiser state) never moved
    mgr = ckpt.manager(tmp_path / "r", read_only=True)
    initial = make_train(cfg, task).init(cfg.train.seed)
    frozen_out = initial._replace(ref_params=None)  # a frozen reference is not checkpointed
    state, meta = ckpt.restore(mgr, jax.eval_shape(lambda: frozen_out))
    mgr.close()
    assert meta["iteration"] == n and meta["metrics_lines"] == n
    assert int(state.iteration) == n and int(state.skipped) == n
    assert float(state.ctrl.beta) == float(initial.ctrl.beta)
    moved = jax.tree.leaves((state.params, state.opt_state))
    for a, b in zip(moved, jax.tree.leaves((initial.params, initial.opt_state)), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert e.value.result is not None and e.value.result.info["checkpoint"] == n


def test_guard_stop_is_exit_status_1_from_the_cli(tiny_task, cache_dir, jax_cache, tmp_path, capsys):
    # a learning rate past float32's range turns every update into inf/NaN: each one is skipped
    cfg = base_config(cache_dir, iterations=20, max_consecutive_skips=2, checkpoint_every=0)
    argv = [*cli_args(cfg), "--optim.lr", "1e39", "--train.out_dir", str(tmp_path), "--train.name", "r"]
    status, err = run_main(argv, capsys)
    assert status == 1
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "consecutive iterations skipped" in errors[0], err
    assert "Traceback" not in err
    assert "NaN or Inf" not in err  # issue 12: no tensorboardX warning per non-finite scalar
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] in (["2"], ["3"])


# ---- the quality rollback in a real run -----------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tiny_task, cache_dir, jax_cache, tmp_path_factory):
    """A run without rollback: its metric trace and metrics lines are the reference."""
    import klrl

    cfg = base_config(cache_dir, iterations=14, keep_checkpoints=20, samples_every=1, samples_n=2)
    cfg = cfg.replace(optim={"lr": 3e-3})
    d = tmp_path_factory.mktemp("plain") / "run"
    result = klrl.run(cfg, task=tiny_task, run_dir=d)
    return cfg, result, lines(d / "metrics.jsonl"), lines(d / "samples.jsonl")


@pytest.mark.parametrize("every", [2, 0])  # 0: no checkpoint before the crossing -> the initial state
def test_rollback_restores_the_right_checkpoint_and_doubles_beta(every, plain_run, tiny_task, tmp_path):
    import klrl
    from klrl.loop.reliability import RunStopped

    metric = "reward/task"
    cfg, plain, plain_lines, plain_samples = plain_run
    cfg = cfg.replace(train={"checkpoint_every": every})
    trace, n = list(plain.metrics[metric]), cfg.train.iterations
    # a threshold whose first crossing is a new running maximum at t >= 3
    t = next(i for i in range(3, n) if trace[i] > max(trace[:i]) and max(trace[:i]) >= trace[0])
    threshold = (max(trace[:t]) + trace[t]) / 2 / trace[0]
    assert threshold > 1 and first_crossing(trace, threshold) == t
    expected = decide_rollback(trace[: t + 1], list(range(every, t + 1, every)) if every else [], threshold)
    assert (expected.step > 0) == (every > 0)

    knobs = {"rollback_metric": metric, "rollback_threshold": threshold, "max_rollbacks": 1}
    rb = cfg.replace(train={**knobs, "iterations": t + 2})
    d = tmp_path / "rollback"
    try:
        result = klrl.run(rb, task=tiny_task, run_dir=d)
        state = result.state
    except RunStopped as e:  # crossed again after the one rollback allowed: also fine
        assert "after 1 rollbacks" in str(e)
        state = e.result.state
    events = [json.loads(x) for x in lines(d / "events.jsonl")]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks and rollbacks[0]["iteration"] == t
    s = expected.step
    target = "the initial state" if s == 0 else f"checkpoint {s}"
    assert f"restored {target}" in rollbacks[0]["message"] and "beta 0.05 -> 0.1" in rollbacks[0]["message"]

    now = lines(d / "metrics.jsonl")
    rows = [json.loads(x) for x in now]
    assert now[:s] == plain_lines[:s]  # history up to the restored state is untouched
    # iteration s ran again from the restored state: the same samples (same reward), twice the beta
    assert rows[s]["iteration"] == s and rows[s][metric] == trace[s]
    assert rows[s]["ctrl/beta"] == pytest.approx(2 * cfg.kl.beta)
    assert float(state.ctrl.beta) == np.float32(2 * np.float32(cfg.kl.beta))
    # the abandoned iterations are kept, in order, in metrics.rolled_back.jsonl
    dropped = lines(d / "metrics.rolled_back.jsonl")
    assert dropped[: t + 1 - s] == plain_lines[s : t + 1]
    # samples.jsonl is cut back the same way: no row of an undone iteration stays in it (each iteration
    # once, in order, samples_n rows); the undone rows are kept, in order, in samples.rolled_back.jsonl
    n_s = cfg.train.samples_n
    got = lines(d / "samples.jsonl")
    its = [json.loads(x)["iteration"] for x in got]
    assert its == [i for i in range(len(rows)) for _ in range(n_s)]
    assert got[: s * n_s] == plain_samples[: s * n_s]
    undone = lines(d / "samples.rolled_back.jsonl")
    assert undone[: (t + 1 - s) * n_s] == plain_samples[s * n_s : (t + 1) * n_s]


def test_unknown_rollback_metric_is_a_config_error(tiny_task, cache_dir, jax_cache, tmp_path):
    import klrl
    from klrl.config import ConfigError

    cfg = base_config(cache_dir, rollback_metric="eval/nonexistent", out_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match=r"train\.rollback_metric: 'eval/nonexistent' is not a metric"):
        klrl.run(cfg, task=tiny_task)
    assert not (tmp_path / "runs").exists()


def test_two_guards_in_a_real_run_the_note_names_the_one_that_fired(plain_run, tiny_task, tmp_path):
    """``train.rollback_guards`` alone (issue 47): a guard on reward/task that crosses at the iteration
    the single-metric test above picks and one on policy/entropy that does not; the rollback is the one
    the single metric decides, and its note names the reward guard, its value, reference and ratio."""
    import klrl
    from klrl.loop.reliability import RunStopped

    metric = "reward/task"
    cfg, plain, _, _ = plain_run
    trace, n = [float(x) for x in plain.metrics[metric]], cfg.train.iterations
    t = next(i for i in range(3, n) if trace[i] > max(trace[:i]) and max(trace[:i]) >= trace[0])
    threshold = (max(trace[:t]) + trace[t]) / 2 / trace[0]
    expected = decide_rollback(trace[: t + 1], list(range(2, t + 1, 2)), threshold)
    guard = f"{metric}>{threshold!r}"
    rb = cfg.replace(train={"rollback_guards": f"{guard}, policy/entropy<0.001", "max_rollbacks": 1,
                            "iterations": t + 2, "checkpoint_every": 2})  # fmt: skip
    d = tmp_path / "guards"
    try:
        klrl.run(rb, task=tiny_task, run_dir=d)
    except RunStopped as e:  # crossed again after the one rollback allowed: also fine
        assert f"past guard {guard} (train.rollback_guards), after 1 rollbacks" in str(e)
    events = [json.loads(x) for x in lines(d / "events.jsonl")]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["iteration"] == t
    target = "the initial state" if expected.step == 0 else f"checkpoint {expected.step}"
    assert rollbacks[0]["message"] == (
        f"rollback 1/1: {metric} = {trace[t]:.4g} at iteration {t} is {trace[t] / trace[0]:.3f}x its start "
        f"{trace[0]:.4g} (guard {guard}); restored {target}, beta 0.05 -> 0.1"
    )


def test_unknown_guard_metric_is_a_config_error(tiny_task, cache_dir, jax_cache, tmp_path):
    import klrl
    from klrl.config import ConfigError

    guards = "reward/task>1.5,text/distinct_2<0.7"  # the first is this run's, the second is the text task's
    cfg = base_config(cache_dir, rollback_guards=guards, out_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match=r"^train\.rollback_guards: 'text/distinct_2' is not a metric"):
        klrl.run(cfg, task=tiny_task)
    assert not (tmp_path / "runs").exists()


# ---- issue 12: signals at any moment, a second Ctrl-C, one writer, a full disk -----------------------

DRIVER = ROOT / "tests" / "phase_driver.py"


def _env(jax_cache, **extra):
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()  # the session's code generation, no forced devices
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(jax_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1", **extra)  # fmt: skip
    return env


def _start(args, jax_cache, phase=None, pause=0.0, slow_exit=0.0):
    """experiments/run.py (through the phase driver when ``phase``); waits until ``phase`` is reached."""
    cmd = [sys.executable, str(DRIVER), phase, *args] if phase else [sys.executable, str(SCRIPT), *args]
    env = _env(jax_cache, KLRL_PHASE_PAUSE=str(pause), KLRL_SLOW_EXIT=str(slow_exit))
    p = subprocess.Popen(cmd, cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    if phase:
        line = p.stderr.readline()
        if b"PHASE-REACHED" not in line:
            p.kill()
            raise AssertionError(line + p.communicate()[1])
    return p


def _latest(d):
    from klrl.io import checkpoint as ckpt

    mgr = ckpt.manager(d, read_only=True)
    try:
        return ckpt.latest_step(mgr)
    finally:
        mgr.close()


def _assert_resumes(cfg, task, d):
    """``d`` resumes (in this process) to 2 iterations past its checkpoint, rows contiguous from 0."""
    import klrl

    n = _latest(d) + 2
    r = klrl.run(cfg.replace(train={"iterations": n}), task=task, resume=d)
    assert r.info["iteration"] == n
    assert [json.loads(x)["iteration"] for x in lines(d / "metrics.jsonl")] == list(range(n))


# before the run directory exists (task build), once it exists (state init), the first step's compile,
# between iterations, while a checkpoint is written in the background
PHASES = ["build", "init", "compile", "iterations", "checkpoint"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_sigterm_at_any_moment_leaves_a_resumable_directory(phase, tiny_task, cache_dir, jax_cache, tmp_path):
    cfg = base_config(cache_dir, iterations=1000, checkpoint_every=1, keep_checkpoints=2)
    args = [*cli_args(cfg), "--train.out_dir", str(tmp_path), "--train.name", "r"]
    p = _start(args, jax_cache, phase, pause=0.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-3000:]
    assert b"Traceback" not in err and b"stopped by SIGTERM" in out, (out, err)
    _assert_resumes(cfg, tiny_task, tmp_path / "r")


@pytest.mark.slow
def test_kill9_during_the_first_compile_resumes_from_iteration_0(tiny_task, cache_dir, jax_cache, tmp_path):
    cfg = base_config(cache_dir, iterations=1000, checkpoint_every=1, keep_checkpoints=2)
    args = [*cli_args(cfg), "--train.out_dir", str(tmp_path), "--train.name", "r"]
    p = _start(args, jax_cache, "compile", pause=0.5)
    p.kill()
    p.communicate()
    d = tmp_path / "r"
    assert not (d / "checkpoints").exists() or not any((d / "checkpoints").iterdir())
    assert not lines(d / "metrics.jsonl")  # nothing done: nothing to lose, so it resumes from 0
    _resume_from_0(cfg, tiny_task, d)


def _resume_from_0(cfg, task, d):
    import klrl

    r = klrl.run(cfg.replace(train={"iterations": 2}), task=task, resume=d)
    assert r.info["start_iteration"] == 0 and r.info["iteration"] == 2
    assert [json.loads(x)["iteration"] for x in lines(d / "metrics.jsonl")] == [0, 1]
    assert json.loads(lines(d / "events.jsonl")[-1])["message"].startswith("resumed from checkpoint 0")


def test_directory_with_only_its_config_resumes_from_iteration_0(tiny_task, cache_dir, jax_cache, tmp_path):
    """What a kill between creating the directory and opening metrics.jsonl leaves; with metrics lines
    but no committed checkpoint it resumes from iteration 0 as well, the rows recomputed (issue 41)."""
    from klrl.io.resume import prepare

    cfg = base_config(cache_dir, iterations=1000, checkpoint_every=1)
    d = tmp_path / "r"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    plan = prepare(cfg, d)
    assert plan.fresh and plan.step == 0 and not (d / "metrics.jsonl").exists()  # prepare changes nothing
    (d / "metrics.jsonl").write_text('{"iteration": 0}\n')
    plan = prepare(cfg, d)
    assert plan.fresh and plan.step == 0 and len(lines(d / "metrics.jsonl")) == 1  # (nothing changed yet)
    _resume_from_0(cfg, tiny_task, d)


@pytest.mark.slow
def test_second_sigint_exits_at_once(tiny_task, cache_dir, jax_cache, tmp_path):
    """The first SIGINT lets the run finish its iteration and checkpoint; the way out is held 3 s here
    (JAX/orbax teardown took 2.4 s in the issue); a second SIGINT 0.3 s later ends it at once, 130."""
    cfg = base_config(cache_dir, iterations=1000, checkpoint_every=1, keep_checkpoints=2)
    args = [*cli_args(cfg), "--train.out_dir", str(tmp_path), "--train.name", "r"]
    p = _start(args, jax_cache, "iterations", slow_exit=3.0)
    p.send_signal(signal.SIGINT)
    deadline = time.time() + 60  # under load the first checkpoint can take longer than the 0.3 s below
    while _latest(tmp_path / "r") is None and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(0.3)
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    took = time.time() - t0
    err = err.decode()
    assert p.returncode == 130, err
    assert "SIGINT again: exiting now" in err and "Traceback" not in err and "Exception ignored" not in err
    assert took < 1.5, took  # about 0.1 s unloaded
    _assert_resumes(cfg, tiny_task, tmp_path / "r")


@pytest.mark.slow
def test_second_writer_is_refused_and_the_first_goes_on(cache_dir, jax_cache, tmp_path):
    cfg = base_config(cache_dir, iterations=1000, checkpoint_every=1, keep_checkpoints=2)
    d = tmp_path / "r"
    first = _start([*cli_args(cfg), "--train.out_dir", str(tmp_path), "--train.name", "r"], jax_cache,
                   "iterations")  # fmt: skip
    try:
        second = subprocess.run([sys.executable, str(SCRIPT), "--resume", str(d)], cwd=ROOT,
                                env=_env(jax_cache), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert second.returncode == 2, second.stderr
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and "in use by pid" in err[0] and f"pid {first.pid} " in err[0], err
        assert first.poll() is None  # the writer was not disturbed
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()[-3000:]
    rows = [json.loads(x)["iteration"] for x in lines(d / "metrics.jsonl")]
    assert rows == list(range(len(rows))) and _latest(d) == len(rows)  # one writer's lines, in order
    assert not (d / ".klrl.lock").exists()  # released on the way out


def test_lock_is_held_by_a_run_and_a_sweep(tiny_task, cache_dir, jax_cache, tmp_path, monkeypatch):
    import klrl
    from klrl.api import sweep
    from klrl.io import logging as io_logging
    from klrl.io.lock import RunDirLocked, run_lock

    cfg = base_config(cache_dir, iterations=1)
    (tmp_path / "busy").mkdir()
    with run_lock(tmp_path / "busy"):
        with pytest.raises(RunDirLocked):
            klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "busy")
        with pytest.raises(RunDirLocked):
            sweep([cfg, cfg.replace(kl={"beta": 0.2})], task=tiny_task, out_dir=tmp_path / "busy")
        assert [p.name for p in (tmp_path / "busy").iterdir()] == [".klrl.lock"]  # nothing written
    seen = []
    write = io_logging.MetricsWriter.write

    def write_(self, iteration, metrics):  # the lock file exists while the run writes
        seen.append((self.run_dir / ".klrl.lock").exists())
        write(self, iteration, metrics)

    monkeypatch.setattr(io_logging.MetricsWriter, "write", write_)
    klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "r")
    assert seen == [True] and not (tmp_path / "r" / ".klrl.lock").exists()


def test_guard_turns_any_full_disk_into_one_line(tmp_path):
    from klrl.io.checkpoint import DiskFull
    from klrl.loop.reliability import RunGuard

    for item in ("state", "meta"):  # a finished save (klrl.io.checkpoint.is_finished)
        (tmp_path / "checkpoints" / "4" / item).mkdir(parents=True)
    (tmp_path / "checkpoints" / "4" / "commit_success.txt").write_text("ok")
    (tmp_path / "checkpoints" / "5").mkdir()  # no finished save: not the last complete checkpoint
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir()
    tensorstore = ValueError("RESOURCE_EXHAUSTED: Failed to write 198611 bytes to file 15: No space left on "
                             "device [os_error_code='28']")  # fmt: skip
    for exc in (OSError(28, "No space left on device"), tensorstore, RuntimeError("wrapped")):
        if isinstance(exc, RuntimeError):
            exc.__cause__ = OSError(28, "No space left on device")
        with pytest.raises(DiskFull) as e, RunGuard(signals=False) as guard:
            guard.hold(tmp_path)
            raise exc
        msg = str(e.value)
        assert "\n" not in msg and str(tmp_path) in msg and "disk full" in msg
        assert "last complete checkpoint, 4, is intact" in msg and "--resume" in msg
        assert not (tmp_path / ".klrl.lock").exists()
    with pytest.raises(KeyError), RunGuard(signals=False):  # anything else passes through unchanged
        raise KeyError("x")


def test_disk_full_in_a_run_keeps_the_last_checkpoint(tiny_task, cache_dir, jax_cache, tmp_path, monkeypatch):
    """Simulated (in this process): metrics.jsonl's write at iteration 3 fails with ENOSPC."""
    import errno

    import klrl
    from klrl.io import logging as io_logging
    from klrl.io.checkpoint import DiskFull

    write = io_logging.MetricsWriter.write

    def full(self, iteration, metrics):
        if iteration == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, iteration, metrics)

    monkeypatch.setattr(io_logging.MetricsWriter, "write", full)
    cfg = base_config(cache_dir, iterations=6, checkpoint_every=1, keep_checkpoints=2)
    with pytest.raises(DiskFull, match="disk full") as e:
        klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "r")
    assert f"checkpoint, {_latest(tmp_path / 'r')}, is intact" in str(e.value)
    monkeypatch.setattr(io_logging.MetricsWriter, "write", write)
    _assert_resumes(cfg, tiny_task, tmp_path / "r")


class _FullOs:
    """The ``os`` module as one klrl module sees it, whose functions ``names`` fail from their ``after``-th
    call on as on a full disk: ``OSError(ENOSPC)`` naming no file (as ``write`` and ``fsync`` do)."""

    def __init__(self, names, after=1):
        self.names, self.after, self.calls = set(names), after, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.names:
            return real

        def full(*a, **k):
            self.calls += 1
            if self.calls >= self.after:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*a, **k)

        return full


# where a new run writes first, failing as on a disk full from the start: (module, its os functions that
# fail, from which call, the file the line must name; None: the directory alone, the error names no file)
FIRST_WRITES = {
    "lock": ("klrl.io.lock", {"write"}, 1, ".klrl.lock"),
    "task_json": ("klrl.io.resume", {"fsync"}, 1, "task.json"),
    "config_json": ("klrl.io.resume", {"fsync"}, 2, "config.json"),
    "metrics": ("klrl.io.logging", None, 0, None),
    "checkpoint": ("klrl.io.checkpoint", None, 0, None),
}


@pytest.mark.parametrize("where", sorted(FIRST_WRITES))
def test_disk_full_from_the_start_names_the_directory_and_the_file(where, cache_dir, jax_cache, tmp_path,
                                                                   monkeypatch, capsys):  # fmt: skip
    """Through the command line: exit 2, one line naming the run directory (and the file when the
    error does); the lock file is not left behind."""
    import importlib

    from klrl.io import checkpoint as ckpt
    from klrl.io import logging as io_logging

    module, names, after, file = FIRST_WRITES[where]
    if names:
        monkeypatch.setattr(importlib.import_module(module), "os", _FullOs(names, after))
    elif where == "metrics":  # the first row
        monkeypatch.setattr(io_logging.MetricsWriter, "write", lambda *a: _raise(OSError(errno.ENOSPC, "x")))
    else:  # the first checkpoint, as tensorstore reports it
        msg = "RESOURCE_EXHAUSTED: Failed to write 1 bytes: No space left on device [os_error_code='28']"
        monkeypatch.setattr(ckpt, "save", lambda *a: _raise(ValueError(msg)))
    cfg = base_config(cache_dir, iterations=2, checkpoint_every=1)
    status, err = run_main([*cli_args(cfg), "--train.out_dir", str(tmp_path), "--train.name", "r"], capsys)
    out = err.strip().splitlines()
    assert status == 2 and len(out) == 1, err
    assert "disk full" in out[0] and f"{tmp_path / 'r'}:" in out[0], out[0]
    assert "no checkpoint was completed" in out[0], out[0]
    if file:
        assert f"writing {tmp_path / 'r' / file}" in out[0], out[0]
    assert not (tmp_path / "r" / ".klrl.lock").exists()
    if where in ("lock", "task_json", "config_json"):  # the directory's files were never written
        assert not (tmp_path / "r").exists()  # no empty run directory left behind (issue 52)


def _raise(e):
    raise e


def _fill(d: Path) -> None:
    """Fill the file system of ``d`` to the last byte."""
    fd = os.open(d / "fill", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_real_disk_full_from_the_start_is_one_line_naming_the_directory(small_disk, cache_dir, jax_cache):
    cfg = base_config(cache_dir, iterations=2, checkpoint_every=1)
    _fill(small_disk)
    args = [*cli_args(cfg), "--train.out_dir", str(small_disk / "sub"), "--train.name", "r"]
    p = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(jax_cache),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    # refused before anything is built or created (issue 52: the write check's probe sees the full disk)
    assert "No space left on device" in err[0] and str(small_disk / "sub") in err[0], err[0]
    assert sorted(p.name for p in small_disk.iterdir()) == ["fill"]  # no empty run directory


@pytest.fixture
def small_disk(tmp_path):
    """A 900 KiB tmpfs (root and a sandbox that allows mounts), else the test is skipped."""
    d = tmp_path / "disk"
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(d)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.slow
def test_real_full_disk_is_one_line_and_resumable_elsewhere(small_disk, tiny_task, cache_dir, jax_cache,
                                                            tmp_path):  # fmt: skip
    import shutil

    cfg = base_config(cache_dir, iterations=50, checkpoint_every=1, keep_checkpoints=2)
    args = [*cli_args(cfg), "--train.out_dir", str(small_disk), "--train.name", "r"]
    p = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(jax_cache),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(err) == 1 and "disk full" in err[0] and str(small_disk / "r") in err[0], p.stderr[-3000:]
    moved = shutil.copytree(small_disk / "r", tmp_path / "moved")
    _assert_resumes(cfg, tiny_task, moved)


def test_stop_signals_reentrant_and_restored():
    from klrl.loop.reliability import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    s = StopSignals(log=lambda m: None)
    with s:
        installed = signal.getsignal(signal.SIGTERM)
        assert installed != before
        with s:  # the loop re-enters the guard's instance: nothing changes, nothing is lost
            assert signal.getsignal(signal.SIGTERM) == installed
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGTERM) == installed and s.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_run_written_before_a_field_existed_resumes():
    """A ``config.json`` written before ``ppo.grad_accum``, ``optim.critic_lr`` and the new ``diag``
    fields (or a whole section) existed resumed as "differ from the run's config": a missing field is
    its default (the behaviour the run had). ``diag.*`` may change (read after training only); the
    maths may not, old file or new."""
    from klrl.config import ConfigError, RunConfig
    from klrl.io.resume import check_resumable

    cfg = RunConfig()
    old = cfg.to_dict()
    del old["ppo"]["grad_accum"], old["optim"]["critic_lr"], old["diag"]["settle"]
    del old["reward"]
    check_resumable(old, cfg)
    check_resumable(cfg, cfg.replace(diag={"window": 40, "persist": 3}))
    with pytest.raises(ConfigError, match=r"^ppo\.grad_accum: differ"):
        check_resumable(old, cfg.replace(ppo={"grad_accum": 2}))
    with pytest.raises(ConfigError, match=r"^optim\.critic_lr: differ"):
        check_resumable(old, cfg.replace(optim={"critic_lr": 1e-4}))
