"""Multi-process runs: 2 processes x 2 CPU devices give the run of 1 process x 4 devices.

Three real processes, started together: the reference (1 process, 4 forced host devices) and a
2-process job on ``localhost`` (2 forced host devices each, gloo collectives), joined through
:func:`klrl.distributed.initialize` (process 0 with arguments, process 1 through the
``KLRL_*`` environment variables). Each runs ``klrl.run`` on the tiny config over all 4 global
devices and dumps its beta trajectory and final parameters; then the three are started again to
resume their run directories from the iteration-3 checkpoint up to iteration 5, and, in the same
processes, to run the rollback job (a second configuration, its own run directories). Every process
gets its own time limit and is killed at the end whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import xla_flags

TIMEOUT = 300  # seconds for the three processes together (they compile in parallel on a shared machine)
RTOL = 1e-4  # what the test demands; the measured difference is printed (run with -s)

DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import klrl.distributed as D

    n_proc, proc_id, port, runs = sys.argv[1:5]
    n_proc, proc_id = int(n_proc), int(proc_id)
    if n_proc > 1:
        if proc_id == 0:  # arguments ...
            D.initialize(f"localhost:{port}", n_proc, proc_id)
        else:  # ... or the environment (KLRL_COORDINATOR, KLRL_NUM_PROCESSES, KLRL_PROCESS_ID)
            D.initialize()
    import jax
    assert jax.process_count() == n_proc and jax.process_index() == proc_id
    assert jax.device_count() == 4 and jax.local_device_count() == 4 // n_proc, jax.devices()

    # The reference policy comes from the session's cache, read to host memory: a multi-process
    # run cannot address the single-device sharding it was saved with (tests/host_cache.py).
    sys.path.insert(0, os.environ["KLRL_TESTS_DIR"])
    import host_cache

    host_cache.install()

    import klrl
    from klrl.config import RunConfig

    from klrl.loop.reliability import RunStopped

    # runs: [[cfg_path, run_dir, out_path, resume_iterations or null], ...], one after another
    for cfg_path, run_dir, out_path, resume_iterations in json.loads(runs):
        cfg = RunConfig.from_dict(json.load(open(cfg_path)))
        try:
            if resume_iterations is not None:  # resume run_dir up to this many iterations
                cfg = cfg.replace(train={"iterations": resume_iterations})
                result = klrl.run(cfg, resume=run_dir)
            else:
                result = klrl.run(cfg, run_dir=run_dir)
        except RunStopped as e:  # e.g. out of rollbacks: the run so far is the result
            result = e.result
        out = {"beta": result.metrics["ctrl/beta"], "final_beta": D.to_host(result.state.ctrl.beta)}
        for path, leaf in jax.tree_util.tree_leaves_with_path(D.to_host(result.state.params)):
            out["param/" + jax.tree_util.keystr(path)] = leaf
        np.savez(out_path, **out)
        print("written by", proc_id, sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else None)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(d: Path, runs: list[tuple[str, int | None]]) -> list[dict[str, dict]]:
    """Start the 1-process reference and the 2-process job together; each process does ``runs`` in
    turn, a run being (``job``, ``resume_iterations``): ``klrl.run`` of ``cfg{job}.json`` on its own run
    directory, or resuming it up to ``resume_iterations``. Collect their dumps (one dict per run);
    kill whatever is left."""
    base = dict(os.environ, JAX_PLATFORMS="cpu", KLRL_TESTS_DIR=str(Path(__file__).resolve().parents[1]))
    for k in ("KLRL_COORDINATOR", "KLRL_NUM_PROCESSES", "KLRL_PROCESS_ID"):
        base.pop(k, None)
    port = _free_port()
    specs = {  # name -> (n_proc, proc_id, run_dir suffix, extra env)
        "single": (1, 0, "single", {"XLA_FLAGS": xla_flags(4)}),
        "p0": (2, 0, "multi", {"XLA_FLAGS": xla_flags(2)}),
        "p1": (2, 1, "multi", {
            "XLA_FLAGS": xla_flags(2),
            "KLRL_COORDINATOR": f"localhost:{port}", "KLRL_NUM_PROCESSES": "2", "KLRL_PROCESS_ID": "1",
        }),
    }  # fmt: skip
    tags = [job + ("" if it is None else f"-resumed{it}") for job, it in runs]
    what = ", ".join(t or "fresh" for t in tags)
    procs: dict[str, subprocess.Popen] = {}
    outputs: dict[str, tuple[int, str]] = {}
    try:
        for name, (n, i, suffix, extra) in specs.items():
            todo = [
                [str(d / f"cfg{job}.json"), str(d / f"run{job}-{suffix}"), str(d / f"{name}{tag}.npz"), it]
                for (job, it), tag in zip(runs, tags, strict=True)
            ]
            procs[name] = subprocess.Popen(
                [sys.executable, str(d / "driver.py"), str(n), str(i), str(port), json.dumps(todo)],
                env={**base, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        import time

        deadline = time.monotonic() + TIMEOUT * len(runs)
        for name, p in procs.items():
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} ({what}) did not finish in {TIMEOUT * len(runs)} s")
            outputs[name] = (p.returncode, text)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, (rc, text) in outputs.items():
        assert rc == 0, f"{name} ({what}) exited {rc}:\n{text[-4000:]}"
    return [{name: dict(np.load(d / f"{name}{tag}.npz")) for name in outputs} for tag in tags]


@pytest.fixture(scope="module")
def launches(tiny_cfg, tiny_task, tmp_path_factory):
    """Two launches of the three processes: 3 iterations from scratch; then the same run directories
    resumed up to 5 iterations, and the rollback job (its own configuration and run directories)."""
    d = tmp_path_factory.mktemp("distributed")
    cfg = tiny_cfg.replace(
        train={"devices": 0},  # all 4 global devices on the data axis
        ctrl={"kind": "dual", "lr": 0.1, "target": 0.01, "estimator": "full"},  # beta follows the KL
        kl={"beta": 0.1},
    )
    (d / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    # A run whose rollback metric crosses at once (the exact KL, ~1e-8 at iteration 0: rounding; the k1
    # estimate there is rounding of either sign): it rolls back to the initial state until
    # ``max_rollbacks`` is spent, on 1 process and on 2.
    rb = tiny_cfg.replace(
        train={"devices": 0, "iterations": 4, "checkpoint_every": 2, "rollback_metric": "kl/exact_seq_sum",
               "rollback_threshold": 1.5, "max_rollbacks": 2},
        kl={"beta": 0.001},
    )  # fmt: skip
    (d / "cfg-rb.json").write_text(json.dumps(rb.to_dict()))
    (d / "driver.py").write_text(DRIVER)
    [fresh] = _launch(d, [("", None)])
    (d / "run-multi-after-3").mkdir()  # what process 0 had written before the resume
    for name in ("metrics.jsonl", "events.jsonl"):
        if (d / "run-multi" / name).exists():
            (d / "run-multi-after-3" / name).write_bytes((d / "run-multi" / name).read_bytes())
    resumed, rollback = _launch(d, [("", 5), ("-rb", None)])
    return fresh, resumed, rollback, d


@pytest.fixture(scope="module")
def jobs(launches):
    """3 iterations from scratch, then the same run directories resumed up to 5 iterations."""
    fresh, resumed, _, d = launches
    return fresh, resumed, d


def _compare(out: dict, what: str) -> dict[str, float]:
    """The processes of the 2-process job against the 1-process reference, and against each other."""
    ref = out["single"]
    worst = {}
    for name in ("p0", "p1"):
        got = out[name]
        assert sorted(got) == sorted(ref)
        np.testing.assert_allclose(got["beta"], ref["beta"], rtol=RTOL, err_msg=f"{what} {name}: beta")
        np.testing.assert_allclose(got["final_beta"], ref["final_beta"], rtol=RTOL)
        errs = [float(np.max(np.abs(got["beta"] - ref["beta"]) / np.abs(ref["beta"])))]
        for k in (k for k in ref if k.startswith("param/")):
            scale = float(np.max(np.abs(ref[k])))
            err = float(np.max(np.abs(got[k] - ref[k])))
            assert err <= RTOL * scale, f"{what} {name} {k}: max|diff| {err:.3g} vs max|param| {scale:.3g}"
            errs.append(err / scale)
        worst[name] = max(errs)
    for k in out["p0"]:  # both processes hold the same replicated result
        np.testing.assert_array_equal(out["p0"][k], out["p1"][k], err_msg=f"{what}: {k}")
    return worst


def test_two_processes_match_one(jobs) -> None:
    fresh, _, _ = jobs
    ref = fresh["single"]
    assert np.all(np.abs(np.diff(np.concatenate([[0.1], ref["beta"]]))) > 1e-4), ref["beta"]  # beta moves
    worst = _compare(fresh, "from scratch")
    print(f"2 processes x 2 devices vs 1 process x 4 devices: worst relative difference {worst}")


def test_two_processes_resume_as_one(jobs) -> None:
    """Both jobs resumed from their iteration-3 checkpoints up to 5: the 2-process resume gives the
    1-process resume's result (which equals an uninterrupted run: tests/io/test_checkpoint.py)."""
    fresh, resumed, d = jobs
    assert len(resumed["single"]["beta"]) == 5  # the whole trajectory: 3 read back + 2 new
    np.testing.assert_array_equal(resumed["single"]["beta"][:3], fresh["single"]["beta"])
    worst = _compare(resumed, "resumed")
    print(f"resumed, 2 processes vs 1: worst relative difference {worst}")
    run = d / "run-multi"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2, 3, 4]  # one writer
    before = (d / "run-multi-after-3" / "metrics.jsonl").read_text().splitlines()
    assert lines[:3] == before  # the lines before the checkpoint are kept as written
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("resume") == 1
    assert (run / "checkpoints" / "5").is_dir()


def test_only_process_zero_writes(jobs) -> None:
    _, _, d = jobs
    run = d / "run-multi"
    lines = (d / "run-multi-after-3" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]  # one writer, not two
    # one event file per writing session (the run, then its resume), as for the single process
    n_tb = len(list((run / "tb").glob("events.out.tfevents.*")))
    assert n_tb == len(list((d / "run-single" / "tb").glob("events.out.tfevents.*"))) == 2
    assert (run / "config.json").exists() and (run / "summary.json").exists()
    single = sorted(p.name for p in (d / "run-single").iterdir())
    assert sorted(p.name for p in run.iterdir()) == single  # the same files as a single-process run
    assert (run / "checkpoints" / "3").is_dir()  # the final checkpoint, saved by both (orbax coordinates)


@pytest.fixture(scope="module")
def rollback_jobs(launches):
    """The rollback job (``cfg-rb.json`` in :func:`launches`) on 1 process and on 2."""
    _, _, rollback, d = launches
    return rollback, d


def test_two_processes_roll_back_as_one(rollback_jobs) -> None:
    out, d = rollback_jobs
    _compare(out, "rollback")
    events, off = {}, {}
    for name in ("single", "multi"):
        lines = (d / f"run-rb-{name}" / "events.jsonl").read_text().splitlines()
        msgs = [json.loads(line)["message"] for line in lines if '"rollback"' in line]
        off[name] = [line for line in lines if '"rollback_off"' in line]
        # the ratio to a ~1e-7 start value differs in its 6th digit between device layouts
        events[name] = [re.sub(r" is \S+x its start", "", m) for m in msgs]
    assert events["multi"] == events["single"]  # one writer, the same decisions
    if off["single"] or off["multi"]:  # a start value that rounds negative: both turn the rollback off
        assert len(off["single"]) == len(off["multi"]) == 1 and not events["multi"]
        assert "is not a positive number" in off["multi"][0]
        return
    # two rollbacks to the initial state: beta compounds (0.001 -> 0.002, then -> 0.004)
    assert len(events["multi"]) == 2
    assert "beta 0.001 -> 0.002" in events["multi"][0] and "beta 0.001 -> 0.004" in events["multi"][1]


# ---- joining that cannot complete: one line and exit 2 in seconds, not a silent wait ----------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("process_id", [1, 0])
def test_a_join_that_cannot_complete_ends_in_one_line(process_id, tmp_path) -> None:
    """Process 1 with no coordinator listening, and process 0 (the coordinator) whose partner never
    comes: ``--distributed-timeout 2`` ends each in one line naming the coordinator and the timeout,
    exit status 2, within seconds (JAX alone waits 300 s, then aborts with a C++ stack trace)."""
    import time

    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "KLRL_CACHE": str(tmp_path / "cache")}
    argv = [
        "--distributed",
        "--coordinator",
        address,
        "--num-processes",
        "2",
        "--process-id",
        str(process_id),
    ]
    argv += ["--distributed-timeout", "2", "--train.out_dir", str(tmp_path / "runs")]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "klrl", "train", *argv], env=env, capture_output=True,
                       text=True, timeout=90)  # fmt: skip
    took = time.monotonic() - t0
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(
        f"error: --distributed: process {process_id} of 2 could not join the run at {address}"
    )
    assert "within 2 s" in lines[0] and "--distributed-timeout" in lines[0]
    assert took < 40, took  # start-up (~5 s on a loaded machine) and the 2 s wait
    assert not (tmp_path / "runs").exists()


def test_no_coordinator_and_no_cluster_is_one_line(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KLRL_", "SLURM_", "OMPI_", "TPU_"))}
    env.update({"JAX_PLATFORMS": "cpu", "KLRL_CACHE": str(tmp_path / "cache")})
    argv = ["train", "--distributed", "--distributed-timeout", "5", "--train.out_dir", str(tmp_path / "runs")]
    p = subprocess.run(
        [sys.executable, "-m", "klrl", *argv], env=env, capture_output=True, text=True, timeout=90
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --distributed: no coordinator given"), p.stderr[
        -3000:
    ]
    assert "--coordinator HOST:PORT" in lines[0]


def test_the_join_timeout_from_the_environment(monkeypatch) -> None:
    import klrl.distributed as D

    monkeypatch.delenv(D.ENV_TIMEOUT, raising=False)
    assert D.timeout_from_env() == D.DEFAULT_TIMEOUT_S == 120.0
    monkeypatch.setenv(D.ENV_TIMEOUT, "7.5")
    assert D.timeout_from_env() == 7.5
    for bad in ("0", "-1", "abc", "inf", "nan"):
        monkeypatch.setenv(D.ENV_TIMEOUT, bad)
        with pytest.raises(ValueError, match="KLRL_DISTRIBUTED_TIMEOUT"):
            D.timeout_from_env()
