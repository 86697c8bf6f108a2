"""The one training loop (klrl/loop/driver.py) drives sweeps as it drives runs: checkpoints, SIGTERM,
resume bit for bit, the non-finite stop after exactly K skips."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import base_config, lines


def _members(cache_dir, **train):
    from klrl.config.sweep import grid

    cfg = base_config(cache_dir, iterations=6, checkpoint_every=4, **train)
    return grid(cfg, {"kl.beta": [0.01, 0.1]})


def _sigterm_after(monkeypatch, n_calls: int) -> None:
    """The sweep's step sends SIGTERM to this process on its ``n_calls``-th call."""
    import klrl.api as S

    real = S.make_program

    def patched(*a, **kw):
        prog, task = real(*a, **kw)
        step, calls = prog.step, [0]

        def counting(state, env):
            calls[0] += 1
            if calls[0] == n_calls:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(state, env)

        prog.step = counting
        return prog, task

    monkeypatch.setattr(S, "make_program", patched)


def test_sweep_sigterm_then_resume_is_bit_identical(tiny_task, cache_dir, jax_cache, tmp_path, monkeypatch):
    from klrl.analysis.results import load_sweep
    from klrl.api import sweep

    members = _members(cache_dir)
    full = sweep(members, task=tiny_task, out_dir=tmp_path / "full")
    with monkeypatch.context() as m:
        _sigterm_after(m, 3)
        cut = sweep(members, task=tiny_task, out_dir=tmp_path / "cut")
    assert cut[0].info["stopped"] == "SIGTERM" and cut[0].info["iteration"] == 3
    assert cut[0].info["checkpoint"] == 3  # checkpointed at the signal, not only every 4
    assert (tmp_path / "cut" / "checkpoints" / "3").is_dir()
    resumed = sweep(members, task=tiny_task, resume=tmp_path / "cut")
    assert resumed[0].info["start_iteration"] == 3 and resumed[0].info["iteration"] == 6
    for j, (a, b) in enumerate(zip(full, resumed, strict=True)):
        assert a.metrics.keys() == b.metrics.keys()
        for k in a.metrics:
            assert a.metrics[k].tobytes() == b.metrics[k].tobytes(), (j, k)
        d = a.dir.name  # named after the swept value (kl.beta=...)
        assert d == f"kl.beta={a.config.kl.beta}" and lines(tmp_path / "full" / d / "metrics.jsonl")
        assert lines(tmp_path / "full" / d / "metrics.jsonl") == lines(tmp_path / "cut" / d / "metrics.jsonl")
    assert [len(r.metrics["reward/task"]) for r in load_sweep(tmp_path / "cut")] == [6, 6]
    # the members differ (their beta), so the comparison above is not of one run with itself
    assert full[0].metrics["ctrl/beta"][0] != full[1].metrics["ctrl/beta"][0]


def test_sweep_resume_refuses_a_changed_member(tiny_task, cache_dir, jax_cache, tmp_path, monkeypatch):
    from klrl.api import sweep
    from klrl.config import ConfigError
    from klrl.io.checkpoint import CheckpointError

    members = _members(cache_dir)
    with monkeypatch.context() as m:
        _sigterm_after(m, 1)
        sweep(members, task=tiny_task, out_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match="kl.beta"):
        sweep([members[0], members[1].replace(kl={"beta": 0.5})], task=tiny_task, resume=tmp_path / "s")
    with pytest.raises(ConfigError, match="3 members given"):
        sweep([*members, members[0]], task=tiny_task, resume=tmp_path / "s")
    with pytest.raises(CheckpointError, match="no sweep.json"):
        sweep(members, task=tiny_task, resume=tmp_path / "s" / "kl.beta=0.01")


def test_sweep_nonfinite_member_stops_after_exactly_k(tiny_task, cache_dir, jax_cache, tmp_path):
    from klrl.api import sweep
    from klrl.loop.reliability import RunStopped
    from klrl.tasks.base import JaxReward

    def nan_reward(env, ro):
        return jnp.full(ro.response.shape[:1], jnp.nan, jnp.float32)

    task = dataclasses.replace(tiny_task, reward=JaxReward(nan_reward, tiny_task.reward.params))
    members = _members(cache_dir, max_consecutive_skips=2)
    with pytest.raises(RunStopped, match="2 consecutive iterations skipped") as e:
        sweep(members, task=task, out_dir=tmp_path / "s")
    for j in range(2):
        rows = [json.loads(x) for x in lines(e.value.result[j].dir / "metrics.jsonl")]
        assert len(rows) == 2
        assert [r["guard/consecutive_skips"] for r in rows] == [1.0, 2.0]
    assert len(e.value.result) == 2


def test_sweep_write_false_keeps_everything_in_memory(tiny_task, cache_dir, jax_cache, tmp_path):
    from klrl.api import sweep

    res = sweep(_members(cache_dir), task=tiny_task, write=False)
    assert [r.dir for r in res] == [None, None]
    assert all(
        len(r.metrics["reward/task"]) == 6 and np.isfinite(r.metrics["reward/task"]).all() for r in res
    )


# ---- sweeps you can compare: member names, sweep.json axes, HParams in the member's own run ---------


class _Inject(NamedTuple):
    hyperparams: dict


class _FakeState(NamedTuple):
    t: Any
    beta: Any
    seed: Any
    opt_state: tuple


def _fake_sweep(members, **kw):
    """A stacked Program whose step is known by hand: ``reward/gold = 10 beta + seed + t`` at
    iteration ``t`` (no model: the loop's bookkeeping only); its optimizer state holds the
    injected ``step_size = -optim.lr`` as optax does."""
    import jax

    from klrl.loop.driver import Program, drive

    def col(f):
        return jnp.asarray(np.array([f(m) for m in members], np.float32))

    def init():
        lr = _Inject({"step_size": -col(lambda m: m.optim.lr)})
        return _FakeState(
            jnp.zeros(len(members)), col(lambda m: m.kl.beta), col(lambda m: m.train.seed), (lr,)
        )

    @jax.jit
    def step(s, env):
        m = {"reward/gold": 10 * s.beta + s.seed + s.t, "ctrl/beta": s.beta, "eval/ref_ppl": 2.0 + 0 * s.t,
             "response/length": 4.0 + 0 * s.t}  # fmt: skip
        return s._replace(t=s.t + 1), m

    prog = Program(configs=members, stacked=True, init=init, step=step, place=lambda s: s, env=None)
    return drive(prog, **kw)


def test_2x2_sweep_in_tensorboards_hparams_dashboard(cache_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from klrl.analysis.results import load_sweep
    from klrl.config.sweep import grid

    base = base_config(cache_dir, iterations=6, checkpoint_every=0)
    members = grid(base, {"kl.beta": [0.1, 1.0], "train.seed": [1, 2]})
    results, err = _fake_sweep(members, out_dir=tmp_path / "s")
    assert err is None
    names = ["kl.beta=0.1,train.seed=1", "kl.beta=0.1,train.seed=2", "kl.beta=1.0,train.seed=1",
             "kl.beta=1.0,train.seed=2"]  # fmt: skip
    index = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert index == {"members": names, "axes": {"kl.beta": [0.1, 1.0], "train.seed": [1, 2]}}
    assert [r.dir.name for r in results] == names
    assert [r.config for r in load_sweep(tmp_path / "s")] == members
    for name, m in zip(names, members, strict=True):
        tb = tmp_path / "s" / name / "tb"
        assert not (tb / "hparams").exists()  # one run: the series and the HParams session together
        ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
        ea.Reload()
        content = ea.PluginTagToContent("hparams")
        start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
        hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}
        assert hp["kl/beta"] == pytest.approx(m.kl.beta) and hp["train/seed"] == m.train.seed
        exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
        tags = {i.name.tag for i in exp.metric_infos}
        assert {"final/reward/gold", "final/eval/ref_ppl", "final/ctrl/beta"} <= tags
        assert {"kl/beta", "train/seed"} <= {i.name for i in exp.hparam_infos}
        # the final value: the mean over the last diag.window (20 >= 6) iterations, 0..5 -> 2.5
        (final,) = ea.Scalars("final/reward/gold")
        want = 10 * np.float32(m.kl.beta) + m.train.seed + 2.5
        assert final.value == pytest.approx(want, rel=1e-6) and final.step == 5
        assert len(ea.Scalars("reward/gold")) == 6


def test_member_names_fall_back_to_member_xx(cache_dir):
    from klrl.analysis.results import member_names

    base = base_config(cache_dir)
    assert member_names([base, base]) == ["member-00", "member-01"]  # nothing differs
    only_name = [base.replace(train={"name": "a"}), base.replace(train={"name": "b"})]
    assert member_names(only_name) == ["member-00", "member-01"]
    odd = [
        base.replace(ctrl={"kind": "fixed", "target": 1.0}),
        base.replace(ctrl={"kind": "pi", "target": 0.5}),
    ]
    # each name from the fields its member reads (issue 48): a fixed-beta controller reads no target
    assert member_names(odd) == ["ctrl.kind=fixed", "ctrl.kind=pi,ctrl.target=0.5"]
    study = [base.replace(kl={"beta": b}) for b in (0.01, 0.1)]  # fixed beta: the default ctrl knobs
    study.append(
        base.replace(kl={"beta": 0.1}, ctrl={"kind": "proportional", "target": 3.0, "horizon": 50.0})
    )
    want = ["ctrl.kind=fixed,kl.beta=0.01", "ctrl.kind=fixed,kl.beta=0.1",
            "ctrl.horizon=50.0,ctrl.kind=proportional,ctrl.target=3.0,kl.beta=0.1"]  # fmt: skip
    assert member_names(study) == want  # (before: ctrl.horizon=...,ctrl.target=... in every name)
    assert member_names([base.replace(kl={"beta": 1e-3}), base])[0] == "kl.beta=0.001"
    # a value with characters unsafe in a path: replaced by "_"
    out = member_names([base.replace(train={"out_dir": "a/b c"}), base.replace(train={"out_dir": "x"})])
    assert out == ["train.out_dir=a_b_c", "train.out_dir=x"]


def test_host_side_metrics_lr_samples_throughput(cache_dir, tmp_path):
    base = base_config(cache_dir, iterations=6, checkpoint_every=0)
    members = [base.replace(optim={"lr": 1e-3}), base.replace(optim={"lr": 2e-3})]
    results, _ = _fake_sweep(members, out_dir=tmp_path / "s")
    batch = base.train.batch_size
    for m, r in zip(members, results, strict=True):
        np.testing.assert_allclose(r.metrics["optim/lr"], [m.optim.lr] * 6, rtol=1e-6)  # float32 in the state
        np.testing.assert_array_equal(r.metrics["train/samples"], batch * np.arange(1, 7))
        assert "train/iteration_s" not in r.metrics  # wall clock: not in the rows a resume reproduces
        timing = [json.loads(x) for x in (r.dir / "timing.jsonl").read_text().splitlines()]
        assert [t["iteration"] for t in timing] == [1, 2, 3, 4, 5]  # iteration 0 holds the compile
        for t in timing:
            assert t["train/iteration_s"] > 0
            assert t["perf/tokens_per_s"] == pytest.approx(4.0 * batch / t["train/iteration_s"])
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(str(r.dir / "tb"))
        ea.Reload()
        assert {"optim/lr", "train/samples", "train/iteration_s", "perf/tokens_per_s"} <= set(
            ea.Tags()["scalars"]
        )


def test_on_step_gets_each_recorded_row(cache_dir, tmp_path):
    import jax

    from klrl.loop.driver import Program, drive

    base = base_config(cache_dir, iterations=4, checkpoint_every=0)
    seen = []
    members = [base.replace(kl={"beta": 0.1}), base.replace(kl={"beta": 1.0})]
    results, _ = _fake_sweep(members, write=False, on_step=lambda i, m: seen.append((i, m)))
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    np.testing.assert_allclose(seen[2][1]["reward/gold"], [10 * 0.1 + 2, 10 * 1.0 + 2], rtol=1e-6)
    np.testing.assert_array_equal(seen[3][1]["train/samples"], [4 * base.train.batch_size] * 2)

    @jax.jit
    def step(t, env):  # a single run: metrics are plain floats
        return t + 1, {"reward/task": t * 0.5}

    one = []
    prog = Program(
        configs=[base], stacked=False, init=lambda: jnp.float32(0), step=step, place=lambda s: s, env=None
    )
    drive(prog, write=False, on_step=lambda i, m: one.append((i, m)))
    assert [(i, m["reward/task"]) for i, m in one] == [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.5)]
    assert isinstance(one[0][1]["reward/task"], float)


def test_metric_aliases_in_metrics_jsonl_and_tensorboard_only(cache_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from klrl.config import ConfigError

    base = base_config(cache_dir, iterations=3, checkpoint_every=0, metric_aliases="verl")
    members = [base.replace(kl={"beta": 0.1}), base.replace(kl={"beta": 1.0})]
    results, _ = _fake_sweep(members, out_dir=tmp_path / "s")
    for m, r in zip(members, results, strict=True):
        rows = [json.loads(x) for x in (r.dir / "metrics.jsonl").read_text().splitlines()]
        # verl's names (klrl/config/aliases.py): ctrl/beta -> actor/reward_kl_penalty_coeff,
        # response/length -> response_length/mean
        assert [row["actor/reward_kl_penalty_coeff"] for row in rows] == pytest.approx([m.kl.beta] * 3)
        assert [row["response_length/mean"] for row in rows] == [4.0] * 3
        assert "actor/reward_kl_penalty_coeff" not in r.metrics  # the rows in memory keep klrl's names
        ea = EventAccumulator(str(r.dir / "tb"))
        ea.Reload()
        assert "actor/reward_kl_penalty_coeff" in ea.Tags()["scalars"]
    from klrl.loop.metrics import alias_map, with_aliases

    # TRL's PPOTrainer names: kl/k1_seq_sum -> objective/kl; a name already a klrl metric is not overwritten
    got = with_aliases(
        {"kl/k1_seq_sum": 2.0, "policy/entropy_avg": 7.0, "policy/entropy": 1.0}, alias_map("trl")
    )
    want = {"kl/k1_seq_sum": 2.0, "objective/kl": 2.0, "policy/entropy": 1.0, "policy/entropy_avg": 7.0}
    assert got == want
    with pytest.raises(ConfigError, match="train.metric_aliases"):
        base.replace(train={"metric_aliases": "openrlhf"})


def _heldout_run(cfg, fail_at: int | None, **kw):
    """A single run whose state's history shows (``w <- w / 2 + t`` at update ``t``), with a held-out
    evaluation every iteration whose host reward fails when it evaluates the state after ``fail_at``
    updates (None: never)."""
    import jax

    from klrl.loop.driver import Program, drive
    from klrl.rewards.host import RewardFunctionError

    seen = []

    @jax.jit
    def step(s, env):
        t, w = s
        return (t + 1, w / 2 + t), {"reward/gold": w, "guard/skipped": 0.0 * w}

    def evaluate(s, env):
        seen.append(int(s[0]))
        return {"eval/w": s[1]}

    def check():
        if seen and seen[-1] == fail_at:
            raise RewardFunctionError(f"held-out reward failed at {fail_at}")

    prog = Program(configs=[cfg], stacked=False, init=lambda: (jnp.int32(0), jnp.float32(1.0)), step=step,
                   place=lambda s: s, env=None, evaluate=evaluate, heldout_check=check)  # fmt: skip
    return drive(prog, **kw)


def test_heldout_reward_failure_after_a_pending_row_saves_the_rows_state(cache_dir, tmp_path):
    """The held-out reward fails before step 5 (checkpoint_every=3): row 4, fetched one step late, is
    recorded first, so the checkpoint (5) is the state after exactly the 5 rows written, and a resume
    with the reward fixed continues bit for bit as a run that never failed."""
    from klrl.io.resume import prepare
    from klrl.rewards.host import RewardFunctionError

    cfg = base_config(cache_dir, iterations=8, checkpoint_every=3).replace(data={"eval_every": 1})
    with pytest.raises(RewardFunctionError, match="held-out evaluation.*last good state: checkpoint 5") as e:
        _heldout_run(cfg, 5, out_dir=tmp_path / "cut")
    assert e.value.result[0].info["checkpoint"] == 5 and e.value.result[0].info["iteration"] == 5
    rows = [json.loads(x) for x in lines(tmp_path / "cut" / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    plan = prepare(cfg, tmp_path / "cut")
    assert plan.step == 5 and plan.meta["metrics_lines"] == 5 and plan.meta["iteration"] == 5
    resumed, _ = _heldout_run(cfg, None, resume=plan)
    full, _ = _heldout_run(cfg, None, out_dir=tmp_path / "full")
    assert resumed[0].info["start_iteration"] == 5 and resumed[0].info["iteration"] == 8
    assert lines(tmp_path / "cut" / "metrics.jsonl") == lines(tmp_path / "full" / "metrics.jsonl")
    for k in ("reward/gold", "eval/w"):
        np.testing.assert_array_equal(resumed[0].metrics[k], full[0].metrics[k])


# ---- wall time: the finished iteration --------------------------------------------------------------


class _Late:
    """A value a device is still computing: ready at wall time ``at``; waiting for it
    (``block_until_ready``) or reading it (``__array__``) blocks until then."""

    def __init__(self, value: float, at: float) -> None:
        self.value, self.at = value, at

    def block_until_ready(self) -> _Late:
        import time

        time.sleep(max(0.0, self.at - time.time()))
        return self

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.block_until_ready().value, dtype)


def _timed_run(tmp_path, cache_dir, *, dispatch_returns: bool, seconds: float) -> tuple[list[float], float]:
    """A single run of 6 iterations (checkpoints every 2: rows fetched two at a time) whose step takes
    ``seconds``: returning at once with outputs ready ``seconds`` after the previous step's (an
    accelerator's asynchronous dispatch), or returning when it is done (the CPU with a host callback);
    its ``train/iteration_s`` and the wall time from the first step's end to the run's."""
    import time

    from klrl.loop.driver import Program, drive

    cfg = base_config(cache_dir, iterations=6, checkpoint_every=2)
    ends: list[float] = []

    def step(s, env):
        if dispatch_returns:
            ends.append(max(ends[-1] if ends else 0.0, time.time()) + seconds)
        else:
            time.sleep(seconds)
            ends.append(time.time())
        return {"t": s["t"] + 1}, {"response/length": _Late(4.0, ends[-1]), "x": _Late(1.0, ends[-1])}

    prog = Program(configs=[cfg], stacked=False, init=lambda: {"t": jnp.zeros((), jnp.int32)}, step=step,
                   place=lambda s: s, env=None)  # fmt: skip
    (r,), _ = drive(prog, out_dir=tmp_path / "r")
    done = time.time()
    timing = [json.loads(x) for x in (r.dir / "timing.jsonl").read_text().splitlines()]
    assert [t["iteration"] for t in timing] == [1, 2, 3, 4, 5]  # iteration 0 holds the compile
    for t in timing:
        assert t["perf/tokens_per_s"] == pytest.approx(4.0 * cfg.train.batch_size / t["train/iteration_s"])
    return [t["train/iteration_s"] for t in timing], done - ends[0]


@pytest.mark.parametrize("dispatch_returns", [False, True])
def test_iteration_s_is_the_finished_iterations_wall_time(cache_dir, tmp_path, dispatch_returns):
    # rows are recorded one step late, or two at once at a checkpoint: the time between recording two
    # rows is not an iteration's (it was ~0 s for the second row of a checkpoint's pair, and 0.02 s for
    # 30 s SmolLM2 iterations); the time from one step's outputs being ready to the next one's is
    seconds = 0.3
    its, wall = _timed_run(tmp_path, cache_dir, dispatch_returns=dispatch_returns, seconds=seconds)
    for s in its:
        assert seconds * 0.95 <= s < seconds + 0.25, its
    assert sum(its) == pytest.approx(wall, abs=0.3)  # the run's wall time after the first step, in all


def test_learning_rates_read_the_critics_own_from_the_state():
    import optax

    from klrl.config import RunConfig
    from klrl.loop.metrics import learning_rates, member_row
    from klrl.step.optim import make_optimizer

    params = {"policy": {"w": jnp.ones(3), "v_head": {"k": jnp.ones(2)}}, "value": None}

    class S(NamedTuple):
        opt_state: Any

    cfg = RunConfig().replace(optim={"lr": 1e-3})
    default = learning_rates(S(make_optimizer(cfg).init(params)), 1)
    assert default.keys() == {"optim/lr"} and default["optim/lr"][0] == pytest.approx(1e-3)
    own = learning_rates(S(make_optimizer(cfg.replace(optim={"critic_lr": 5e-5})).init(params)), 2)
    np.testing.assert_allclose(own["optim/lr"], [1e-3, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(own["optim/critic_lr"], [5e-5, 5e-5], rtol=1e-6)
    row = member_row({"a": np.array([1.0, 2.0])}, 1, 0, 4, own)
    assert row["optim/critic_lr"] == pytest.approx(5e-5) and row["optim/lr"] == pytest.approx(1e-3)
    assert learning_rates(S(optax.adam(1e-3).init(params)), 1) is None  # no injected learning rate
