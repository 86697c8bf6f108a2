"""The one training loop (klrl/loop.py) drives sweeps as it drives runs: checkpoints, SIGTERM,
resume bit for bit, the non-finite stop after exactly K skips."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import base_config, lines


def _members(cache_dir, **train):
    from klrl.sweep import grid

    cfg = base_config(cache_dir, iterations=6, checkpoint_every=4, **train)
    return grid(cfg, {"kl.beta": [0.01, 0.1]})


def _sigterm_after(monkeypatch, n_calls: int) -> None:
    """The sweep's step sends SIGTERM to this process on its ``n_calls``-th call."""
    import sys

    S = sys.modules["klrl.sweep"]

    real = S.make_sweep

    def patched(*a, **kw):
        init, step, mesh = real(*a, **kw)
        calls = [0]

        def counting(state, env):
            calls[0] += 1
            if calls[0] == n_calls:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(state, env)

        return init, counting, mesh

    monkeypatch.setattr(S, "make_sweep", patched)


def test_sweep_sigterm_then_resume_is_bit_identical(tiny_task, cache_dir, jax_cache, tmp_path, monkeypatch):
    from klrl.results import load_sweep
    from klrl.sweep import sweep

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
        d = f"member-{j:02d}"
        assert lines(tmp_path / "full" / d / "metrics.jsonl") == lines(tmp_path / "cut" / d / "metrics.jsonl")
    assert [len(r.metrics["reward/task"]) for r in load_sweep(tmp_path / "cut")] == [6, 6]
    # the members differ (their beta), so the comparison above is not of one run with itself
    assert full[0].metrics["ctrl/beta"][0] != full[1].metrics["ctrl/beta"][0]


def test_sweep_resume_refuses_a_changed_member(tiny_task, cache_dir, jax_cache, tmp_path, monkeypatch):
    from klrl.config import ConfigError
    from klrl.io.checkpoint import CheckpointError
    from klrl.sweep import sweep

    members = _members(cache_dir)
    with monkeypatch.context() as m:
        _sigterm_after(m, 1)
        sweep(members, task=tiny_task, out_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match="kl.beta"):
        sweep([members[0], members[1].replace(kl={"beta": 0.5})], task=tiny_task, resume=tmp_path / "s")
    with pytest.raises(ConfigError, match="3 members given"):
        sweep([*members, members[0]], task=tiny_task, resume=tmp_path / "s")
    with pytest.raises(CheckpointError, match="no sweep.json"):
        sweep(members, task=tiny_task, resume=tmp_path / "s" / "member-00")


def test_sweep_nonfinite_member_stops_after_exactly_k(tiny_task, cache_dir, jax_cache, tmp_path):
    from klrl.reliability import RunStopped
    from klrl.sweep import sweep
    from klrl.tasks.base import JaxReward

    def nan_reward(env, ro):
        return jnp.full(ro.response.shape[:1], jnp.nan, jnp.float32)

    task = dataclasses.replace(tiny_task, reward=JaxReward(nan_reward, tiny_task.reward.params))
    members = _members(cache_dir, max_consecutive_skips=2)
    with pytest.raises(RunStopped, match="2 consecutive iterations skipped") as e:
        sweep(members, task=task, out_dir=tmp_path / "s")
    for j in range(2):
        rows = [json.loads(x) for x in lines(tmp_path / "s" / f"member-{j:02d}" / "metrics.jsonl")]
        assert [r["guard/consecutive_skips"] for r in rows] == [1.0, 2.0]
    assert len(e.value.result) == 2


def test_sweep_write_false_keeps_everything_in_memory(tiny_task, cache_dir, jax_cache, tmp_path):
    from klrl.sweep import sweep

    res = sweep(_members(cache_dir), task=tiny_task, write=False)
    assert [r.dir for r in res] == [None, None]
    assert all(
        len(r.metrics["reward/task"]) == 6 and np.isfinite(r.metrics["reward/task"]).all() for r in res
    )
