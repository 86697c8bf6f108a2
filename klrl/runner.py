"""``klrl.run(config)``: a training run from Python; the command line is a thin layer over it."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl import distributed, reliability
from klrl.config import ConfigError, RunConfig, check_devices
from klrl.io import checkpoint as ckpt
from klrl.io import readers
from klrl.io.logging import MetricsWriter, Progress, hparams_of, new_run_dir
from klrl.io.resume import complete_lines, replace_file
from klrl.io.resume import prepare as prepare_resume
from klrl.io.resume import restore as restore_resume  # issue-12b
from klrl.parallel import make_mesh
from klrl.tasks.base import Task

SUMMARY_KEYS = (
    "reward/task",
    "kl/seq_sum",
    "kl/token_mean",
    "kl/exact_seq_sum",
    "ctrl/beta",
    "response/length",
)


@dataclass
class RunResult:
    """What a run leaves: ``metrics[name]`` is a NumPy array over iterations."""

    config: RunConfig
    dir: Path | None
    metrics: dict[str, np.ndarray]
    state: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for k in SUMMARY_KEYS:
            if k in self.metrics and len(self.metrics[k]):
                v = self.metrics[k]
                n = max(1, min(5, len(v) // 5))
                out[k] = {"start": float(np.mean(v[:n])), "end": float(np.mean(v[-n:]))}
        return out


def build_task(cfg: RunConfig, log: Any = None) -> Task:
    if cfg.task.name == "testbed":
        from klrl.tasks.testbed import make_testbed

        return make_testbed(cfg, log)
    from klrl.tasks.wordclass import make_task

    return make_task(cfg, log)


def columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Metric rows -> ``{name: array over iterations}``; a name missing from a row is NaN there."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "iteration"))
    return {k: np.array([float(r.get(k, np.nan)) for r in rows]) for k in keys}


ROLLED_BACK = "metrics.rolled_back.jsonl"


def run(
    cfg: RunConfig,
    *,
    task: Task | None = None,
    run_dir: str | Path | None = None,
    write: bool = True,
    log: Any = None,
    resume: str | Path | None = None,
) -> RunResult:
    # issue-12b: the whole run inside RunGuard (signals from the start, the run directory's lock,
    # a full disk as one DiskFull line); the body is _run
    with reliability.RunGuard(log) as guard:
        return _run(cfg, task=task, run_dir=run_dir, write=write, log=log, resume=resume, guard=guard)


def _run(
    cfg: RunConfig,
    *,
    task: Task | None = None,
    run_dir: str | Path | None = None,
    write: bool = True,
    log: Any = None,
    resume: str | Path | None = None,
    guard: reliability.RunGuard,
) -> RunResult:
    """Train ``cfg`` to the end and return its metrics, final state and run directory.

    ``write=False`` keeps everything in memory (no run directory, no checkpoints).
    ``resume=RUN_DIR`` continues that run from its latest complete checkpoint up to
    ``cfg.train.iterations`` (see :func:`klrl.io.resume.check_resumable` for what ``cfg`` may change);
    ``metrics.jsonl`` is cut back to the checkpoint, so the result is the same, bit for bit,
    as a run that was never interrupted.

    SIGTERM/SIGINT finish the current iteration, checkpoint and return
    (``result.info['stopped']`` names the signal). :class:`klrl.reliability.RunStopped` is raised
    when the non-finite guard skipped ``train.max_consecutive_skips`` iterations in a row
    (the state is checkpointed) or the quality rollback hit ``train.max_rollbacks``.
    Bad input raises :class:`ConfigError` or :class:`klrl.io.checkpoint.CheckpointError`.
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    tc = cfg.train
    metric = tc.rollback_metric
    plan = None
    if resume is not None:
        if not write:
            raise ConfigError("resume: a resumed run writes to its run directory (write=True)")
        if jax.process_index() == 0 and Path(resume).is_dir():  # issue-12b: lock before reading
            guard.hold(resume)
        plan = prepare_resume(cfg, resume)
    if metric and not write:
        raise ConfigError("train.rollback_metric: the quality rollback needs checkpoints (write=True)")
    mesh = make_mesh(tc.devices)
    check_devices(cfg, mesh.shape["data"])
    task = task or build_task(cfg, log if not tc.quiet else None)
    from klrl.train import make_train

    train = make_train(cfg, task, mesh)
    main = jax.process_index() == 0  # several processes (klrl.distributed): only process 0 writes
    env = distributed.replicate(task.env, mesh) if jax.process_count() > 1 else task.env
    abstract = jax.eval_shape(lambda: train.init(tc.seed))
    if metric:
        names = jax.eval_shape(train.step, abstract, task.env)[1]
        if metric not in names:
            raise ConfigError(
                f"train.rollback_metric: {metric!r} is not a metric of this run "
                f"(e.g. {', '.join(sorted(n for n in names if n.startswith(('eval/', 'reward/'))))})"
            )

    out: Path | None = None
    writer = None
    rows: list[dict[str, Any]] = []
    rollbacks = 0
    if plan is not None:
        out = plan.dir
        # issue-12b: a checkpoint, or the initial state for a directory with nothing done yet
        state, meta = restore_resume(plan, abstract, lambda: train.init(tc.seed))
        state = distributed.replicate(state, mesh)  # every process restored the same host values
        rollbacks = int(meta.get("rollbacks", 0))
        # past this point the resume is valid: cut metrics back to the checkpoint (atomically);
        # every process reads the same first lines (a replacement is a rename), only process 0 writes
        n_lines = int(meta["metrics_lines"])
        lines = complete_lines(out / "metrics.jsonl")
        rows = [json.loads(line) for line in lines[:n_lines]]
        if main:
            if len(lines) != n_lines or (out / "metrics.jsonl").stat().st_size != sum(map(len, lines)):
                replace_file(out / "metrics.jsonl", b"".join(lines[:n_lines]))
            replace_file(out / "config.json", json.dumps(cfg.to_dict(), indent=1).encode())
            writer = MetricsWriter(out, hparams=hparams_of(cfg))
            msg = (
                f"resumed from checkpoint {plan.step} ({len(lines) - n_lines} metrics lines after it dropped)"
            )
            writer.event(plan.step, "resume", msg)
            if not tc.quiet:
                log(f"{out}: {msg}")
    else:
        if write and main:
            out = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
            out.mkdir(parents=True, exist_ok=True)
            guard.hold(out)  # issue-12b: before anything is written into it
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            (out / "task.json").write_text(json.dumps(task.info, indent=1, default=str))
            writer = MetricsWriter(out, hparams=hparams_of(cfg))
        if write:  # every process saves checkpoints (orbax coordinates them) into process 0's directory
            out = distributed.agree_path(out)
        state = train.init(tc.seed)
    # the state a rollback to step 0 restores (a host copy: ``init`` cannot be re-run once ``step``
    # has donated the controller's parameter arrays)
    initial = ckpt.host_copy(state if plan is None else train.init(tc.seed)) if metric else None
    mgr = ckpt.manager(out, keep=tc.keep_checkpoints, async_save=True) if out is not None else None
    trace = [float(r.get(metric, math.nan)) for r in rows] if metric else []
    base: float | None = None  # the rollback metric at iteration 0, the reference of the threshold
    if metric and plan is not None:
        saved = plan.meta.get("rollback_base") or {}
        base = saved.get("value") if saved.get("metric") == metric else (trace[0] if trace else None)

    progress = Progress(tc.iterations, tc.log_every, tc.quiet or not main)
    t0 = time.time()
    i = int(state.iteration)
    start = i
    last_saved = i if plan is not None else -1
    stopped: str | None = None
    stop_error: str | None = None

    def flush(it: int, m: Any) -> None:
        nonlocal base
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        rows.append({"iteration": it, **m})
        if metric:
            trace.append(m.get(metric, math.nan))
            if base is None:
                base = trace[0]
                if not (math.isfinite(base) and base > 0):
                    msg = f"quality rollback off: {metric} = {base} at iteration 0 is not a positive number"
                    log(msg)
                    if writer:
                        writer.event(it, "rollback_off", msg)
        if writer:
            writer.write(it, m)
        progress.update(it, m)

    def save(step: int) -> None:
        nonlocal last_saved
        if mgr is None or step == last_saved:
            return
        b = base if base is not None and math.isfinite(base) else None
        meta = {"config": cfg.to_dict(), "version": ckpt.version(), "iteration": step,
                "metrics_lines": len(rows), "rollbacks": rollbacks,
                "rollback_base": {"metric": metric, "value": b} if metric else None}  # fmt: skip
        ckpt.save(mgr, step, state, meta)
        last_saved = step

    def check() -> str | None:
        """What the newest metrics row asks for: None, 'skips' or 'rollback'."""
        if reliability.skip_stop(rows[-1].get("guard/consecutive_skips", 0.0), tc.max_consecutive_skips):
            return "skips"
        if metric and reliability.is_bad(trace[-1], base, tc.rollback_threshold):
            return "rollback"
        return None

    def roll_back() -> int:
        """Restore the newest good checkpoint with beta x factor; returns its step."""
        nonlocal state, rollbacks, last_saved
        mgr.wait_until_finished()
        dec = reliability.decide_rollback(trace, ckpt.steps(mgr), tc.rollback_threshold, base)
        if rollbacks >= tc.max_rollbacks:
            raise _Stop(
                f"{metric} = {dec.value:.4g} at iteration {dec.crossing} is {dec.ratio:.3f}x its start, past "
                f"train.rollback_threshold {tc.rollback_threshold}, after {rollbacks} rollbacks "
                f"(train.max_rollbacks); newest good checkpoint: {dec.step}"
            )
        failed_beta = float(state.ctrl.beta)  # the beta in force when the metric crossed
        new = initial if dec.step == 0 else ckpt.restore(mgr, abstract, dec.step)[0]
        new = distributed.replicate(new, mesh)
        old_beta = float(new.ctrl.beta)
        beta = reliability.rollback_beta(old_beta, failed_beta, tc.rollback_factor)
        # (``new``'s beta times 0 plus the value keeps the state's placement on the mesh)
        state = new._replace(ctrl=new.ctrl._replace(beta=new.ctrl.beta * 0 + jnp.float32(beta)))
        for s in ckpt.steps(mgr):
            if s > dec.step:
                mgr.delete(s)
        last_saved = dec.step if dec.step > 0 else -1
        # metrics after the restored state move to metrics.rolled_back.jsonl (appended, never lost)
        path = out / "metrics.jsonl"
        lines = complete_lines(path)
        if main:
            with open(out / ROLLED_BACK, "ab") as f:
                f.write(b"".join(lines[dec.step :]))
                f.flush()
                os.fsync(f.fileno())
            os.truncate(path, sum(map(len, lines[: dec.step])))  # the writer appends (O_APPEND) from here
        del rows[dec.step :], trace[dec.step :]
        rollbacks += 1
        msg = (
            f"rollback {rollbacks}/{tc.max_rollbacks}: {metric} = {dec.value:.4g} at iteration "
            f"{dec.crossing} is {dec.ratio:.3f}x its start (threshold {tc.rollback_threshold}); restored "
            f"{'the initial state' if dec.step == 0 else f'checkpoint {dec.step}'}, "
            f"beta {old_beta:.4g} -> {float(state.ctrl.beta):.4g}"
        )
        if writer:
            writer.event(dec.crossing, "rollback", msg)
        log(msg)
        return dec.step

    pending = None  # (iteration, metrics) of the newest step, fetched while the next one runs
    try:
        with guard.signals as signals:  # issue-12b: installed since the start of run()
            while True:
                stopping = signals.received is not None  # no new step: sync, checkpoint, return
                fetch = [pending] if pending is not None else []
                pending = None
                sync = True
                if not stopping and i < tc.iterations:
                    state, metrics = train.step(state, env)
                    i += 1
                    every = tc.checkpoint_every
                    sync = i == tc.iterations or (every > 0 and i % every == 0)
                    if sync:
                        fetch.append((i - 1, metrics))
                    else:
                        pending = (i - 1, metrics)
                action = None
                for it, m in fetch:
                    flush(it, m)
                    action = action or check()
                if action == "rollback":
                    pending = None
                    try:
                        i = roll_back()
                    except _Stop as e:
                        stop_error = str(e)
                        break
                    continue
                if action == "skips":
                    if pending is not None:  # rows must match the checkpointed state
                        flush(*pending)
                        pending = None
                    save(i)
                    where = f"checkpoint {i} in {mgr.directory}" if mgr else "not saved (write=False)"
                    n_skips = int(rows[-1]["guard/consecutive_skips"])
                    stop_error = (
                        f"{n_skips} consecutive iterations skipped by the non-finite guard (NaN/inf in loss, "
                        f"gradients, reward or KL; train.max_consecutive_skips={tc.max_consecutive_skips}); "
                        f"last good state: {where}"
                    )
                    break
                if sync:
                    save(i)
                if stopping:
                    stopped = signals.name
                    break
                if i >= tc.iterations and pending is None:
                    break
    finally:
        if mgr is not None:
            ckpt.finish(mgr)  # issue-12b: wait + close; a second error on the way out is dropped
    elapsed = time.time() - t0
    info = {"train_s": elapsed, "task": task.info, "start_iteration": start, "iteration": i,
            "stopped": stopped, "rollbacks": rollbacks,
            "checkpoint": last_saved if last_saved >= 0 else None}  # fmt: skip
    if writer is not None:
        final = rows[-1] if rows else {}
        writer.close({k: final[k] for k in SUMMARY_KEYS if k in final})
    result = RunResult(cfg, out, columns(rows), state, info)
    if out is not None and main:
        (out / "summary.json").write_text(json.dumps(result.summary(), indent=1))
        from klrl.report import maybe_write_report

        maybe_write_report(result, log)
    if stop_error is not None:
        raise reliability.RunStopped(f"stopped: {stop_error}", result)
    return result


run.__doc__ = _run.__doc__  # issue-12b


class _Stop(Exception):
    pass


def load_run(run_dir: str | Path) -> RunResult:
    """Read a finished or running run from disk (config and metrics; no state)."""
    d = Path(run_dir)
    cfg, rows = readers.read_run(d)  # a damaged file: RunDirError (a ValueError) naming it
    return RunResult(cfg, d, columns(rows))


def load_sweep(sweep_dir: str | Path) -> list[RunResult]:
    """Read a sweep from disk: one :class:`RunResult` per member (config and metrics; no state).

    Members are those ``sweep.json`` lists, else the ``member-XX/`` sub-directories in order.
    """
    d = Path(sweep_dir)
    return [load_run(d / n) for n in readers.read_sweep_members(d)]
