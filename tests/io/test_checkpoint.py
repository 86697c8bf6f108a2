"""Checkpoints, resume, preemption (issue 6).

* A run stopped after N iterations and resumed for N more equals one run of 2N iterations,
  bit for bit (metrics.jsonl bytes and every leaf of the final state), for a fixed and a PI
  controller (whose integral lives in the state).
* ``kill -9`` at random moments, several times during checkpoint writes: every resume starts
  from the latest complete checkpoint, keeps every metrics line up to it, and recomputes the
  lines after it exactly as the killed process had written them.
* SIGTERM / SIGINT: the run checkpoints and exits with status 0 / 130, in bounded time.
* Bad input to ``--resume`` (changed model or batch, missing, corrupt or foreign checkpoints):
  exit status 2, one line, and the run directory is left byte-for-byte as it was.

The in-process runs and the subprocesses share JAX's persistent compilation cache (a session
temporary directory), so the tiny step compiles about once per session.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "run.py"

from conftest import base_config, cli_args, lines, run_main, xla_flags  # noqa: E402  (jax_cache: a conftest fixture)

# ---- shared helpers ---------------------------------------------------------------------------


def sub_env(jax_cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()  # the session's code generation, no forced devices
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(jax_cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def snapshot(d: Path) -> dict[str, str]:
    """path -> sha256 of every file under ``d``: to prove a failed resume changed nothing."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def assert_trees_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit for bit (NaN-safe)


# ---- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fixed", "pi"])
def test_resume_is_bit_exact(kind, tiny_task, cache_dir, jax_cache, tmp_path):
    """``pi`` also stores the reference in bfloat16 (``model.ref_dtype``) and refreshes it every 2
    iterations: its dtype and values round-trip through the checkpoint."""
    import klrl
    from klrl.io import checkpoint as ckpt

    n = 3
    ctrl = {"kind": kind, "target": 0.05, "kp": 0.5, "ki": 0.5} if kind == "pi" else {"kind": kind}
    cfg = base_config(cache_dir, iterations=2 * n).replace(ctrl=ctrl)
    if kind == "pi":
        cfg = cfg.replace(model={"ref_dtype": "bfloat16"}, kl={"ref_update_every": 2, "ref_mix": 0.5})
    straight = klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "straight")
    half = klrl.run(cfg.replace(train={"iterations": n}), task=tiny_task, run_dir=tmp_path / "split")
    assert half.info["iteration"] == n

    # the checkpoint at the end of the first half: the whole state and the meta record
    mgr = ckpt.manager(tmp_path / "split", read_only=True)
    assert ckpt.latest_step(mgr) == n
    # a frozen reference is left out (klrl.loop.frozen), identified by its digest; a refreshed one is saved
    want = half.state._replace(ref_params=None) if kind == "fixed" else half.state
    state, meta = ckpt.restore(mgr, jax.eval_shape(lambda: want))
    mgr.close()
    assert_trees_equal(state, want)
    assert ("frozen_ref" in meta) == (kind == "fixed")
    assert meta["iteration"] == n and meta["metrics_lines"] == n and meta["version"] == klrl.__version__
    assert meta["config"] == cfg.replace(train={"iterations": n}).to_dict()

    # lines after the checkpoint (as a crash leaves them, the last one torn) are rewritten
    metrics = tmp_path / "split" / "metrics.jsonl"
    with open(metrics, "ab") as f:
        f.write(b'{"iteration": 3, "reward/task": 123.0}\n{"iteration": 4, "rew')
    resumed = klrl.run(cfg, task=tiny_task, resume=tmp_path / "split")
    assert resumed.info["start_iteration"] == n and resumed.info["iteration"] == 2 * n

    assert metrics.read_bytes() == (tmp_path / "straight" / "metrics.jsonl").read_bytes()
    assert_trees_equal(resumed.state, straight.state)
    if kind == "pi":  # the integral term is part of what was restored, and it moved; the bf16 reference too
        assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {np.dtype(jax.numpy.bfloat16)}
        assert float(straight.state.ctrl.integral) != 0.0
        assert float(straight.state.ctrl.beta) != cfg.kl.beta
    for k, v in straight.metrics.items():
        np.testing.assert_array_equal(resumed.metrics[k], v)
    events = [json.loads(x) for x in lines(tmp_path / "split" / "events.jsonl")]
    assert [e["event"] for e in events] == ["resume"] and events[0]["iteration"] == n
    assert len(list((tmp_path / "split" / "tb").glob("events.out.tfevents.*"))) == 2


def test_checkpoints_with_the_reference_inside_still_resume(tiny_task, cache_dir, jax_cache, tmp_path):
    """A checkpoint written before frozen references were left out (``ref_params`` saved, no
    ``frozen_ref`` record) resumes to the same run, bit for bit."""
    import klrl
    from klrl.io import checkpoint as ckpt

    cfg = base_config(cache_dir, iterations=3)
    straight = klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "straight")
    half = klrl.run(cfg.replace(train={"iterations": 2}), task=tiny_task, run_dir=tmp_path / "old")
    mgr = ckpt.manager(tmp_path / "old", read_only=True)
    state, meta = ckpt.restore(mgr, jax.eval_shape(lambda: half.state._replace(ref_params=None)))
    mgr.close()
    meta = {k: v for k, v in meta.items() if k not in ("frozen_ref", "arrays", "digest")}
    mgr = ckpt.manager(tmp_path / "old")
    mgr.delete(2)
    ckpt.save(mgr, 2, state._replace(ref_params=tiny_task.policy_params), meta)  # the old layout
    ckpt.finish(mgr)
    resumed = klrl.run(cfg, task=tiny_task, resume=tmp_path / "old")
    assert resumed.info["start_iteration"] == 2
    assert_trees_equal(resumed.state, straight.state)


def test_checkpoint_every_and_keep(tiny_task, cache_dir, jax_cache, tmp_path):
    import klrl
    from klrl.io import checkpoint as ckpt

    cfg = base_config(cache_dir, iterations=7, checkpoint_every=2, keep_checkpoints=2)
    klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "r")
    mgr = ckpt.manager(tmp_path / "r", read_only=True)
    assert ckpt.steps(mgr) == [6, 7]  # every 2, the end, the newest 2 kept
    assert ckpt.read_meta(mgr, 6)["metrics_lines"] == 6
    mgr.close()
    assert not [p for p in (tmp_path / "r" / "checkpoints").iterdir() if "tmp" in p.name]


# ---- bad input to --resume ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tiny_task, cache_dir, jax_cache, tmp_path_factory):
    import klrl

    d = tmp_path_factory.mktemp("finished") / "run"
    klrl.run(base_config(cache_dir, iterations=2), task=tiny_task, run_dir=d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _damage(d: Path, case: str) -> None:
    step = max(int(p.name) for p in (d / "checkpoints").iterdir() if p.name.isdigit())
    c = d / "checkpoints" / str(step)
    if case == "corrupt_state":
        for p in (c / "state").rglob("*"):
            if p.is_file() and p.stat().st_size > 0:
                p.write_bytes(random.Random(0).randbytes(p.stat().st_size))
    elif case == "corrupt_meta":
        for p in (c / "meta").rglob("*"):
            if p.is_file() and "commit" not in p.name:
                p.write_text("{not json")
    elif case == "other_version":
        for p in (c / "meta").rglob("*"):
            if p.is_file() and "commit" not in p.name:
                meta = json.loads(p.read_text())
                p.write_text(json.dumps({**meta, "version": "0.0.1"}))
    elif case.startswith(("manifest_", "data_", "d_", "bitrot")):  # issue 12: damaged files of the state
        state = c / "state"
        data = max((p for p in state.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
        if case == "manifest_truncated":
            (state / "manifest.ocdbt").write_bytes((state / "manifest.ocdbt").read_bytes()[:40])
        elif case == "manifest_deleted":
            (state / "manifest.ocdbt").unlink()
        elif case == "data_truncated":
            data.write_bytes(data.read_bytes()[:1000])
        elif case == "data_emptied":
            data.write_bytes(b"")
        elif case == "data_deleted":
            data.unlink()
        elif case == "d_deleted":
            import shutil

            for sub in state.rglob("d"):
                shutil.rmtree(sub)
        else:  # bitrot: 64 bytes XOR-ed in the middle of the largest data file; every file still parses
            b = bytearray(data.read_bytes())
            mid = len(b) // 2
            b[mid : mid + 64] = bytes(x ^ 0x5A for x in b[mid : mid + 64])
            data.write_bytes(bytes(b))
    elif case == "no_checkpoints":
        import shutil

        shutil.rmtree(d / "checkpoints")
    elif case == "only_partial_checkpoint":  # what a kill during the first save leaves
        c.rename(c.with_name(f"{step}.orbax-checkpoint-tmp-1234"))
    elif case == "other_model":  # config.json of another model: the checkpoint's config disagrees
        cfg = json.loads((d / "config.json").read_text())
        cfg["model"]["d_model"] = 64
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        raise AssertionError(case)


BAD_RESUMES = {
    # name -> (damage, extra arguments, words the one-line message must contain)
    "changed_model": (None, ["--model.d_model", "64"], ["model.d_model"]),
    "changed_batch": (None, ["--train.batch_size", "32", "--ppo.epochs", "1"],
                      ["train.batch_size", "ppo.epochs"]),
    "changed_beta": (None, ["--kl.beta", "0.5"], ["kl.beta"]),
    "changed_schedule": (None, ["--optim.schedule", "linear"], ["optim.schedule"]),
    "fewer_iterations": (None, ["--train.iterations", "1"], ["train.iterations"]),
    "missing_dir": ("missing", [], ["not a klrl run directory"]),
    "corrupt_state": ("corrupt_state", [], ["unreadable"]),
    "corrupt_meta": ("corrupt_meta", [], ["unreadable"]),
    "other_version": ("other_version", [], ["0.0.1"]),
    "other_model": ("other_model", [], ["model.d_model"]),
    "manifest_truncated": ("manifest_truncated", [], ["unreadable"]),
    "manifest_deleted": ("manifest_deleted", [], ["unreadable"]),
    "data_truncated": ("data_truncated", [], ["unreadable"]),
    "data_emptied": ("data_emptied", [], ["unreadable"]),
    "data_deleted": ("data_deleted", [], ["unreadable"]),
    "d_deleted": ("d_deleted", [], ["unreadable"]),
    # (the XOR-ed bytes may land in zstd-compressed data: then the decoder, not the digest, finds the damage)
    "bitrot": ("bitrot", [], ["damaged"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_RESUMES))
def test_bad_resume_exits_2_and_changes_nothing(case, finished_run, tmp_path, capsys):
    damage, extra, words = BAD_RESUMES[case]
    d = _copy(finished_run, tmp_path / "run")
    if damage == "missing":
        d = tmp_path / "nowhere"
    elif damage is not None:
        _damage(d, damage)
    before = snapshot(d) if d.exists() else None
    status, err = run_main(["--resume", str(d), *extra], capsys)
    assert status == 2, err
    msg = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(msg) == 1, err
    # nothing else: no "RuntimeError: Event loop is closed" from orbax's reads still in flight
    assert err.splitlines() == msg, err
    for w in words:
        assert w in msg[0], msg[0]
    if before is not None:
        assert snapshot(d) == before


@pytest.mark.parametrize("case", ["no_checkpoints", "only_partial_checkpoint"])
def test_rows_without_a_committed_checkpoint_are_recomputed_from_0(case, finished_run, tmp_path, capsys):
    """What a kill before the first commit leaves (rows, the first save's temporary directory), or a
    run whose checkpoints were removed: resumed from iteration 0, its rows recomputed bit for bit (issue
    41: refused before, 'no complete checkpoint ... 2 metrics lines were written before the first one')."""
    d = _copy(finished_run, tmp_path / "run")
    _damage(d, case)
    status, err = run_main(["--resume", str(d)], capsys)
    assert status == 0, err
    assert lines(d / "metrics.jsonl") == lines(finished_run / "metrics.jsonl")
    event = json.loads(lines(d / "events.jsonl")[-1])
    assert event["message"].startswith(
        "resumed from checkpoint 0, the initial state (no complete checkpoint; 2"
    )


def test_resume_of_a_finished_run_with_more_iterations_continues(finished_run, tmp_path, capsys):
    d = _copy(finished_run, tmp_path / "run")
    status, err = run_main(
        ["--resume", str(d), "--train.iterations", "3", "--train.checkpoint_every", "5"], capsys
    )
    assert status == 0, err
    assert len(lines(d / "metrics.jsonl")) == 3
    assert json.loads((d / "config.json").read_text())["train"]["iterations"] == 3


# ---- kill -9, SIGTERM, SIGINT: one run directory driven through many processes --------------------

KILL_TRIALS = 10


@pytest.fixture(scope="module")
def chain(tiny_task, cache_dir, jax_cache, tmp_path_factory):
    """Start a long run with a checkpoint every iteration; kill -9 it KILL_TRIALS times at random
    moments (odd trials: as soon as a checkpoint write is seen in progress), resuming each time;
    then stop it with SIGTERM, then SIGINT, then resume it to the end. Returns observations."""
    root = tmp_path_factory.mktemp("chain")
    d = root / "run"
    cfg = base_config(cache_dir, iterations=10_000, checkpoint_every=1, keep_checkpoints=2)
    env = sub_env(jax_cache)
    rng = random.Random(1234)
    obs = {"kills": [], "signals": {}, "dir": d}
    from klrl.io import checkpoint as ckpt

    def start(resume: bool, iterations: int | None = None) -> subprocess.Popen:
        args = (
            ["--resume", str(d)]
            if resume
            else [*cli_args(cfg), "--train.out_dir", str(root), "--train.name", "run"]
        )
        if iterations is not None:
            args += ["--train.iterations", str(iterations)]
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def complete_steps() -> list[str]:
        c = d / "checkpoints"
        return [x for x in os.listdir(c) if x.isdigit()] if c.exists() else []

    def resumes() -> int:
        return sum(1 for x in lines(d / "events.jsonl") if b'"resume"' in x)

    def wait_for_progress(p: subprocess.Popen, n_before: int, n_resumes: int, timeout: float = 240) -> None:
        """Until the process (the ``n_resumes``-th resume, if > 0) has written a metrics line of its own
        beyond ``n_before`` lines, and a checkpoint exists, so that there is something to resume from."""
        t0 = time.time()
        while resumes() < n_resumes or len(lines(d / "metrics.jsonl")) <= n_before or not complete_steps():
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"process ended early ({p.returncode}): {err.decode()[-2000:]}")
            assert time.time() - t0 < timeout, "no progress"
            time.sleep(0.01)

    def latest() -> tuple[int, dict]:
        mgr = ckpt.manager(d, read_only=True)
        try:
            step = ckpt.latest_step(mgr)
            return step, ckpt.read_meta(mgr, step)
        finally:
            mgr.close()

    prev_lines: list[bytes] = []
    prev_step = 0
    for trial in range(KILL_TRIALS):
        n_start = prev_step
        p = start(resume=trial > 0)
        wait_for_progress(p, n_start, trial)
        during_write = trial % 2 == 1
        if during_write:  # kill as soon as orbax is seen writing a temporary step directory
            t0 = time.time()
            while time.time() - t0 < 30 and p.poll() is None:
                if any(".orbax-checkpoint-tmp" in x for x in os.listdir(d / "checkpoints")):
                    break
                time.sleep(0.002)
        else:
            time.sleep(rng.uniform(0.0, 0.6))
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()
        tmp_left = [x for x in os.listdir(d / "checkpoints") if ".orbax-checkpoint-tmp" in x]
        step, meta = latest()
        now = lines(d / "metrics.jsonl")
        obs["kills"].append(
            {"trial": trial, "during_write": during_write, "tmp_left": tmp_left, "step": step,
             "meta": meta, "lines": now, "prev_lines": prev_lines, "prev_step": prev_step}
        )  # fmt: skip
        prev_lines, prev_step = now, step

    # SIGTERM, then SIGINT: each on a resumed process, after it has made progress
    for j, (sig, name) in enumerate(((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT"))):
        p = start(resume=True)
        wait_for_progress(p, prev_step, KILL_TRIALS + j)
        time.sleep(rng.uniform(0.0, 0.5))
        t0 = time.time()
        p.send_signal(sig)
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        elapsed = time.time() - t0
        step, meta = latest()
        now = lines(d / "metrics.jsonl")
        obs["signals"][name] = {
            "status": p.returncode, "seconds": elapsed, "step": step, "meta": meta, "lines": now,
            "out": out.decode(), "err": err.decode(),
        }  # fmt: skip
        prev_lines, prev_step = now, step

    # finally, resume to the end
    final_n = prev_step + 2
    p = start(resume=True, iterations=final_n)
    out, err = p.communicate(timeout=300)
    obs["final"] = {
        "status": p.returncode,
        "n": final_n,
        "lines": lines(d / "metrics.jsonl"),
        "err": err.decode(),
    }
    obs["events"] = [json.loads(x) for x in lines(d / "events.jsonl")]
    return obs


@pytest.mark.slow
def test_kill9_resumes_from_latest_complete_checkpoint(chain):
    kills = chain["kills"]
    assert len(kills) == KILL_TRIALS
    resumes = [e for e in chain["events"] if e["event"] == "resume"]
    # every process after the first resumed from the checkpoint that was latest when the previous died
    sig = chain["signals"]
    expected = [k["step"] for k in kills] + [sig["SIGTERM"]["step"], sig["SIGINT"]["step"]]
    assert [e["iteration"] for e in resumes] == expected
    for k in kills:
        step, meta, now = k["step"], k["meta"], k["lines"]
        assert step is not None and step >= 1
        assert meta["iteration"] == step and meta["metrics_lines"] == step
        # no metrics line up to the checkpoint is lost; at most the iterations since it are redone
        assert len(now) >= step
        rows = [json.loads(x) for x in now]
        assert [r["iteration"] for r in rows] == list(range(len(rows)))
        # lines up to the previous checkpoint survived the resume byte for byte; the lines the previous
        # (killed) process wrote after its checkpoint were recomputed identically (determinism)
        prev = k["prev_lines"]
        common = min(len(prev), len(now))
        assert now[:common] == prev[:common]
        assert step >= k["prev_step"]
    # odd trials killed the process while orbax was writing a step; the partial step was never taken
    # for a complete one (latest_step above), and at least some kills did land inside a write
    assert sum(1 for k in kills if k["tmp_left"]) >= 1, [k["tmp_left"] for k in kills]
    print("kill -9 trials (checkpoint step, metrics lines, partial step dirs left):")
    print([(k["step"], len(k["lines"]), len(k["tmp_left"])) for k in kills])
    final = chain["final"]
    assert final["status"] == 0, final["err"]
    rows = [json.loads(x) for x in final["lines"]]
    assert [r["iteration"] for r in rows] == list(range(final["n"]))
    assert not [x for x in os.listdir(chain["dir"] / "checkpoints") if "tmp" in x]


@pytest.mark.slow
@pytest.mark.parametrize("name,status", [("SIGTERM", 0), ("SIGINT", 130)])
def test_signal_checkpoints_and_exits(chain, name, status):
    s = chain["signals"][name]
    assert s["status"] == status, s["err"]
    assert "Traceback" not in s["err"]
    # the checkpoint is the state at the last metrics line: nothing done is lost
    assert s["step"] == s["meta"]["metrics_lines"] == len(s["lines"])
    assert f"stopped by {name}" in s["out"]
    assert s["seconds"] < 60  # bounded: one iteration, one checkpoint, exit (about 1-2 s unloaded)
    print(f"{name}: stopped {s['seconds']:.2f}s after the signal")


# ---- issue 12: damaged checkpoints from a fresh process, checksums ----------------------------------


@pytest.mark.parametrize("case", ["data_truncated", "data_emptied"])
def test_damaged_checkpoint_is_one_line_from_a_fresh_process(case, finished_run, tmp_path, jax_cache):
    """orbax's reads still in flight when one fails used to print 13-139 lines of ``RuntimeError: Event
    loop is closed`` after the error line (about 1 run in 2); stderr must be the error line alone."""
    d = _copy(finished_run, tmp_path / "run")
    _damage(d, case)
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--resume", str(d)], cwd=ROOT, env=sub_env(jax_cache),
        capture_output=True, timeout=300,
    )  # fmt: skip
    err = p.stderr.decode().splitlines()
    assert p.returncode == 2, p.stderr.decode()
    assert len(err) == 1 and err[0].startswith("error:") and "unreadable" in err[0], p.stderr.decode()


def test_checksums_change_with_any_byte_shape_or_dtype():
    """The SHA-256 record of checkpoints before the sharding-invariant digest (still verified)."""
    from klrl.io import checkpoint as ckpt

    rng = np.random.default_rng(0)
    state = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int32)}
    ref = ckpt.checksums(state)
    # the documented recipe, by hand: SHA-256 over dtype string, shape and the C-order bytes
    assert set(ref) == {"['a']", "['b']"}
    assert ref["['b']"] == hashlib.sha256(b"<i4(5,)" + np.arange(5, dtype="<i4").tobytes()).hexdigest()
    ckpt.verify(state, ref, "here")  # unchanged: no error
    flipped = state["a"].copy()
    flipped.view(np.uint8).reshape(-1)[7] ^= 1
    changes = {
        "byte": {**state, "a": flipped},
        "shape": {**state, "a": state["a"].reshape(4, 3)},
        "dtype": {**state, "b": state["b"].astype(np.uint32)},
    }
    for name, bad in changes.items():
        with pytest.raises(ckpt.CheckpointError, match="is damaged") as e:
            ckpt.verify(bad, ref, "checkpoint 3 in X")
        assert "\n" not in str(e.value) and "checkpoint 3 in X" in str(e.value), name
    with pytest.raises(ckpt.CheckpointError, match="other leaves"):
        ckpt.verify({"a": state["a"]}, ref, "here")


def test_checkpoints_record_digests(finished_run):
    from klrl.io import checkpoint as ckpt
    from klrl.io import digest

    mgr = ckpt.manager(finished_run, read_only=True)
    try:
        step = ckpt.latest_step(mgr)
        meta = ckpt.read_meta(mgr, step)
        state, _ = ckpt.restore(mgr, ckpt.saved_structure(mgr, step), step)  # (NamedTuples as dicts)
    finally:
        mgr.close()
    assert meta["digest"] == digest.DIGEST and meta["arrays"]
    assert all(len(h) == 32 and isinstance(shape, list) for _, shape, h in meta["arrays"].values())
    assert any("params" in k for k in meta["arrays"])
    # the record is the restored arrays' dtype, shape and digest
    assert meta["arrays"] == digest.digests(state)


def test_plan_line_sizes_by_hand():
    """The start-of-run line: each checkpoint's bytes (by hand: 1000x1000 float32 twice, 500x1000 bfloat16,
    a scalar int32) by top-level field, and ``keep`` times that."""
    from typing import NamedTuple

    import jax

    from klrl.io import checkpoint as ckpt

    class State(NamedTuple):
        params: dict
        opt_state: tuple
        iteration: object

    f32, bf16 = np.float32, jax.numpy.bfloat16
    s = State(
        {"w": jax.ShapeDtypeStruct((1000, 1000), f32)},
        (jax.ShapeDtypeStruct((1000, 1000), f32), jax.ShapeDtypeStruct((500, 1000), bf16)),
        jax.ShapeDtypeStruct((), np.int32),
    )
    assert ckpt.state_bytes(s) == {"opt_state": 5_000_000, "params": 4_000_000, "iteration": 4}
    line = ckpt.plan_line(s, 3, 10, "/r")
    assert line.startswith("checkpoints: every 10 iterations and at the end, the newest 3 kept"), line
    assert "each 9.0 MB of arrays (opt_state 5.0 MB, params 4.0 MB; up to 27.0 MB on disk)" in line, line
    assert line.endswith("in /r/checkpoints") and "\n" not in line


def test_a_run_says_how_many_checkpoints_it_keeps(tiny_task, cache_dir, jax_cache, tmp_path):
    import klrl

    said = []
    cfg = base_config(cache_dir, iterations=1, quiet=False, keep_checkpoints=2)
    klrl.run(cfg, task=tiny_task, run_dir=tmp_path / "r", log=said.append)
    line = [x for x in said if x.startswith("checkpoints:")]
    assert len(line) == 1 and "the newest 2 kept (train.keep_checkpoints)" in line[0], said
    # the frozen reference is not checkpointed (klrl.loop.frozen): its size is not in the line
    assert (
        "params" in line[0] and "ref_params" not in line[0] and str(tmp_path / "r" / "checkpoints") in line[0]
    )
    said.clear()
    klrl.run(cfg.replace(train={"quiet": True}), task=tiny_task, run_dir=tmp_path / "q", log=said.append)
    assert not [x for x in said if x.startswith("checkpoints:")]
