"""Resuming directories that a kill or a user left behind (klrl/io/resume.py, issue 30):

* a sweep killed before its first complete checkpoint (during the compile, or while its first
  checkpoint was being written) resumes from iteration 0 as a single run does, bit for bit against a
  sweep that was never interrupted; with metrics rows but no checkpoint too (issue 41: the rows are
  recomputed);
* a step directory that holds no finished save (empty, foreign files, a copy cut short) is skipped:
  the run resumes from the newest complete checkpoint, moves the directory aside (named in its one
  resume line), writes that step again itself and ends bit for bit as an uninterrupted run; a run and
  a sweep alike;
* a finished checkpoint whose data is damaged is still refused, its message naming the older ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import base_config, lines  # noqa: E402  (jax_cache: a conftest fixture)


def _members(cache_dir, **train):
    from klrl.config.sweep import grid

    cfg = base_config(cache_dir, iterations=4, checkpoint_every=2, keep_checkpoints=10, **train)
    return grid(cfg, {"kl.beta": [0.01, 0.1]})


def _snapshot(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _digests(d: Path, step: int) -> dict:
    from klrl.io import checkpoint as ckpt

    mgr = ckpt.manager(d, read_only=True)
    try:
        return ckpt.read_meta(mgr, step)["arrays"]
    finally:
        mgr.close()


def _same_sweep(full, resumed, a: Path, b: Path) -> None:
    """Every member's metrics (values and ``metrics.jsonl`` bytes) and the last checkpoint's arrays."""
    for x, y in zip(full, resumed, strict=True):
        assert x.metrics.keys() == y.metrics.keys()
        for k in x.metrics:
            assert x.metrics[k].tobytes() == y.metrics[k].tobytes(), k
        name = x.dir.name
        assert lines(a / name / "metrics.jsonl") and lines(a / name / "metrics.jsonl") == lines(
            b / name / "metrics.jsonl"
        )
    assert _digests(a, 4) == _digests(b, 4)  # the state itself, every array
    assert full[0].metrics["ctrl/beta"][0] != full[1].metrics["ctrl/beta"][0]  # two different members


@pytest.fixture(scope="module")
def full_sweep(tiny_task, cache_dir, jax_cache, tmp_path_factory):
    """A 2-member sweep of 4 iterations, never interrupted, checkpoints 2 and 4."""
    from klrl.api import sweep

    d = tmp_path_factory.mktemp("full-sweep") / "s"
    return sweep(_members(cache_dir), task=tiny_task, out_dir=d), d


class _Killed(BaseException):
    """Stands for kill -9 at the first step (the compile): none of the run's own clean-up applies."""


def _killed_at_the_first_step(monkeypatch) -> None:
    import klrl.api as api

    real = api.make_program

    def patched(*a, **kw):
        prog, task = real(*a, **kw)

        def step(state, env):
            raise _Killed

        prog.step = step
        return prog, task

    monkeypatch.setattr(api, "make_program", patched)


# ---- item 5: a sweep killed before its first checkpoint ---------------------------------------------


def test_sweep_killed_before_its_first_checkpoint_resumes_from_0(full_sweep, tiny_task, cache_dir, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    from klrl.api import sweep
    from klrl.io import checkpoint as ckpt

    full, full_dir = full_sweep
    members = _members(cache_dir)
    d = tmp_path / "s"
    with monkeypatch.context() as m:
        _killed_at_the_first_step(m)
        with pytest.raises(_Killed):
            sweep(members, task=tiny_task, out_dir=d)
    # what else a kill -9 leaves: the lock file (its flock died with the process), orbax's temporary
    # directory of the first checkpoint being written, a member killed before its metrics file was opened
    (d / ".klrl.lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere", "since": 0}))
    (d / "checkpoints" / "2.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    (d / full[1].dir.name / "metrics.jsonl").unlink()
    assert (d / "sweep.json").is_file() and ckpt.complete_steps(d) == []
    resumed = sweep(members, task=tiny_task, resume=d)
    assert resumed[0].info["start_iteration"] == 0 and resumed[0].info["iteration"] == 4
    _same_sweep(full, resumed, full_dir, d)
    event = json.loads(lines(d / full[0].dir.name / "events.jsonl")[0])
    assert event["event"] == "resume" and event["message"].startswith("resumed from checkpoint 0")


def _hand_made_sweep(d: Path, members) -> None:
    """A sweep directory as create_dirs leaves it before the first iteration (no checkpoint)."""
    from klrl.analysis.results import member_names, sweep_axes

    names = member_names(members)
    (d / "checkpoints").mkdir(parents=True)  # (orbax's manager makes it before the first step)
    (d / "task.json").write_text("{}")
    for n, c in zip(names, members, strict=True):
        (d / n).mkdir()
        (d / n / "config.json").write_text(json.dumps(c.to_dict()))
        (d / n / "metrics.jsonl").write_text("")
    (d / "sweep.json").write_text(json.dumps({"members": names, "axes": sweep_axes(members)}, default=str))


def test_sweep_with_rows_but_no_checkpoint_resumes_from_0(cache_dir, tmp_path):
    """As a single run: with metrics rows written before the first checkpoint was committed, the plan
    is a fresh start (the rows are recomputed: tests/loop/test_kill_points.py); prepare changes nothing. A
    member changed since is refused like any resume."""
    from klrl.config import ConfigError
    from klrl.io.resume import prepare

    members = _members(cache_dir)
    d = tmp_path / "s"
    _hand_made_sweep(d, members)
    plan = prepare(members, d)
    assert plan.fresh and plan.step == 0 and len(plan.meta["members"]) == 2
    member = d / json.loads((d / "sweep.json").read_text())["members"][1]
    (member / "metrics.jsonl").write_text('{"iteration": 0}\n')
    before = _snapshot(d)
    plan = prepare(
        members, d
    )  # (refused before issue 41: '1 metrics lines were written before the first one')
    assert plan.fresh and plan.step == 0 and plan.meta["metrics_lines"] == 0
    assert _snapshot(d) == before
    with pytest.raises(ConfigError, match="kl.beta"):
        prepare([members[0], members[1].replace(kl={"beta": 0.5})], d)


@pytest.mark.slow
def test_sweep_kill9_before_its_first_checkpoint_resumes(full_sweep, cache_dir, jax_cache, tmp_path):
    """The reported case, as reported: the sweep's process killed with SIGKILL once ``sweep.json`` exists
    (2 s after its first member's metrics file was opened: the program build or the compile)."""
    import subprocess
    import sys
    import time

    from conftest import cli_args
    from test_reliability import _env, _start

    full, full_dir = full_sweep
    cfg = base_config(cache_dir, iterations=4, checkpoint_every=2, keep_checkpoints=10)
    args = [*cli_args(cfg), "--sweep", "kl.beta=0.01,0.1", "--train.out_dir", str(tmp_path)]
    args += ["--train.name", "s"]
    p = _start(args, jax_cache, "init")  # (the phase driver marks no compile of a sweep's program)
    time.sleep(2.0)
    p.kill()
    p.communicate()
    d = tmp_path / "s"
    from klrl.io import checkpoint as ckpt

    assert (d / "sweep.json").is_file() and not ckpt.complete_steps(d)  # (the compile takes 10 s or more)
    script = Path(__file__).resolve().parents[2] / "experiments" / "run.py"
    q = subprocess.run([sys.executable, str(script), "--resume", str(d)], env=_env(jax_cache),
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert q.returncode == 0, q.stderr[-3000:]
    for x in full:
        assert lines(d / x.dir.name / "metrics.jsonl") == lines(full_dir / x.dir.name / "metrics.jsonl")


# ---- item 6: a step directory that holds no finished save ---------------------------------------------


def _junk(step_dir: Path, kind: str, complete: Path) -> None:
    """``step_dir`` as something other than a finished save: ``complete`` is a finished checkpoint."""
    if kind == "empty":
        step_dir.mkdir()
    elif kind == "garbage":
        step_dir.mkdir()
        (step_dir / "notes.txt").write_text("not a checkpoint")
        (step_dir / "state").write_bytes(b"\x00" * 100)
    elif kind == "half_copy":  # a copy cut short: no commit record, a data file missing
        shutil.copytree(complete, step_dir)
        for p in [*step_dir.rglob("commit_success.txt"), step_dir / "_CHECKPOINT_METADATA"]:
            p.unlink()
        max((p for p in step_dir.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size).unlink()
    else:
        raise AssertionError(kind)


@pytest.fixture(scope="module")
def run8(tiny_task, cache_dir, jax_cache, tmp_path_factory):
    """A run of 8 iterations, never interrupted, checkpoints 2, 4, 6, 8."""
    import klrl

    cfg = base_config(cache_dir, iterations=8, checkpoint_every=2, keep_checkpoints=10)
    d = tmp_path_factory.mktemp("run8") / "r"
    return klrl.run(cfg, task=tiny_task, run_dir=d), d


@pytest.mark.parametrize("kind", ["empty", "garbage", "half_copy"])
def test_newest_step_directory_without_a_finished_save_is_skipped(kind, run8, tiny_task, tmp_path):
    """The run had written checkpoint 4 and 8 metrics rows; ``checkpoints/6`` holds no finished save: the
    resume goes back to 4 (rows cut to 4), moves 6 aside, says so in one line, writes 6 and 8 itself."""
    import klrl
    from klrl.io import checkpoint as ckpt

    full, src = run8
    d = shutil.copytree(src, tmp_path / "r")
    for s in (6, 8):
        shutil.rmtree(d / "checkpoints" / str(s))
    _junk(d / "checkpoints" / "6", kind, src / "checkpoints" / "6")
    junk = _snapshot(d / "checkpoints" / "6")
    assert ckpt.complete_steps(d) == [2, 4] and ckpt.incomplete_steps(d) == [6]
    said = []
    r = klrl.run(full.config.replace(train={"quiet": False}), task=tiny_task, resume=d, log=said.append)
    assert r.info["start_iteration"] == 4 and r.info["iteration"] == 8
    assert lines(d / "metrics.jsonl") == lines(src / "metrics.jsonl")  # bit for bit, 8 rows
    for k in full.metrics:
        assert full.metrics[k].tobytes() == r.metrics[k].tobytes(), k
    assert ckpt.complete_steps(d) == [2, 4, 6, 8] and _digests(d, 8) == _digests(src, 8)
    assert _snapshot(d / "checkpoints" / "6.incomplete") == junk  # moved aside whole, nothing deleted
    line = [x for x in said if "resumed from checkpoint" in x]
    assert len(line) == 1 and "\n" not in line[0], said
    assert "checkpoints/6" in line[0] and "moved aside to checkpoints/6.incomplete" in line[0]
    event = json.loads(lines(d / "events.jsonl")[-1])
    assert event["event"] == "resume" and "checkpoints/6.incomplete" in event["message"]


def test_skipped_step_directory_in_a_sweep_and_a_second_time(full_sweep, tiny_task, cache_dir, tmp_path):
    """A sweep alike; an earlier ``<step>.incomplete`` is kept (the next one gets ``-2``)."""
    from klrl.api import sweep

    full, src = full_sweep
    d = shutil.copytree(src, tmp_path / "s")
    shutil.rmtree(d / "checkpoints" / "4")
    (d / "checkpoints" / "4").mkdir()
    (d / "checkpoints" / "4.incomplete").mkdir()  # from an earlier resume
    resumed = sweep(_members(cache_dir), task=tiny_task, resume=d)
    assert resumed[0].info["start_iteration"] == 2
    _same_sweep(full, resumed, src, d)
    assert (d / "checkpoints" / "4.incomplete").is_dir() and (d / "checkpoints" / "4.incomplete-2").is_dir()
    message = json.loads(lines(d / full[1].dir.name / "events.jsonl")[-1])["message"]
    assert "moved aside to checkpoints/4.incomplete-2" in message


def test_damaged_finished_checkpoint_is_refused_naming_the_older_ones(run8, tmp_path, capsys):
    """A finished save whose data changed after it was written is damage, not a leftover: refused (one
    line, exit 2, nothing changed), the message saying which older checkpoints there are."""
    from conftest import run_main

    _, src = run8
    d = shutil.copytree(src, tmp_path / "r")
    data = max((p for p in (d / "checkpoints" / "8" / "state").rglob("d/*") if p.is_file()),
               key=lambda p: p.stat().st_size)  # fmt: skip
    data.write_bytes(data.read_bytes()[:100])
    before = _snapshot(d)
    status, err = run_main(["--resume", str(d), "--train.iterations", "10"], capsys)
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "checkpoint 8" in err, err
    assert "older checkpoints: 2, 4, 6" in err and "to resume from 6" in err, err
    # the array and the step's files named, none of the storage library's text (issue 41: TensorStore's
    # '<bound method pybind11_detail_function_record_v1...' was in the message)
    assert f"cannot be read from {d / 'checkpoints' / '8' / 'state'} (a file is truncated)" in err, err
    assert not any(w in err for w in ("pybind", "TensorStore", "<bound", "Exception:")), err
    assert _snapshot(d) == before
    # export names them too, as --step
    from conftest import one_line_error

    from klrl.cli import main

    line = one_line_error(capsys, main, ["export", str(d), str(tmp_path / "out")])
    assert "checkpoint 8" in line and "(older checkpoints: 2, 4, 6; export one with --step 6)" in line, line
    assert not any(w in line for w in ("pybind", "TensorStore", "<bound")), line


def test_is_finished_needs_the_commit_record_and_both_items(tmp_path):
    from klrl.io import checkpoint as ckpt

    s = tmp_path / "7"
    (s / "state").mkdir(parents=True)
    (s / "meta").mkdir()
    assert not ckpt.is_finished(s)
    (s / "_CHECKPOINT_METADATA").write_text(json.dumps({"init_timestamp_nsecs": 1}))
    assert not ckpt.is_finished(s)  # begun, never committed
    (s / "_CHECKPOINT_METADATA").write_text(json.dumps({"commit_timestamp_nsecs": 2}))
    assert ckpt.is_finished(s)  # (orbax versions without commit_success.txt)
    (s / "_CHECKPOINT_METADATA").unlink()
    (s / "commit_success.txt").write_text("ok")
    assert ckpt.is_finished(s)
    shutil.rmtree(s / "meta")
    assert not ckpt.is_finished(s)
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "5").write_text("a file named after a step")  # blocks step 5: moved aside
    assert ckpt.incomplete_steps(tmp_path) == [3, 5] and ckpt.complete_steps(tmp_path) == []
    assert ckpt.set_aside(tmp_path, [3, 5]) == ["checkpoints/3.incomplete", "checkpoints/5.incomplete"]
    assert (tmp_path / "checkpoints" / "5.incomplete").read_text() == "a file named after a step"
