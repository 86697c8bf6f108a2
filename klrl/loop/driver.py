"""The one training loop, for a single run and for a sweep (members stacked in one state).

:func:`drive` steps a :class:`Program` to ``train.iterations``: metrics rows (one
``metrics.jsonl`` and event file per member), checkpoints of the whole (stacked) state every
``train.checkpoint_every`` iterations, SIGTERM/SIGINT (finish the iteration, checkpoint, return),
the non-finite stop (after exactly ``train.max_consecutive_skips`` skips), the quality rollback
and resume: the same code for both, so a sweep resumes exactly like a run, bit for bit.

Layout: a single run keeps everything in its run directory; a sweep keeps ``sweep.json``,
``task.json`` and ``checkpoints/`` in the sweep directory and one directory (config, metrics,
events, summary) per member, named after its swept values (``member-XX`` in older sweeps).
Metrics are fetched one step late (the host writes iteration ``i`` while the device runs ``i + 1``).
The run directory's files are in :mod:`klrl.loop.files`, the stop lines and the reward-failure checks
in :mod:`klrl.loop.stops`, :class:`Program` in :mod:`klrl.loop.program`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl import distributed
from klrl.analysis.results import RunResult, varying_fields
from klrl.config import ConfigError
from klrl.io import checkpoint as ckpt
from klrl.io.logging import MetricsWriter, Progress, new_run_dir, sweep_progress
from klrl.io.resume import Resume
from klrl.io.resume import restore as restore_resume
from klrl.loop import reliability
from klrl.loop.files import (
    ROLLED_BACK,
    SAMPLES_ROLLED_BACK,
    create_dirs,
    cut_to_checkpoint,
    member_dirs,
    move_rolled_back,
    results,
    rollback_bases,
)
from klrl.loop.hostmem import release_freed_memory
from klrl.loop.metrics import alias_map, latest, learning_rates, member_row, timings, with_aliases
from klrl.loop.program import Program
from klrl.loop.stops import (
    base_message,
    give_up_message,
    restamp,
    reward_error,
    reward_failure,
    rollback_message,
    skips_message,
)
from klrl.step.samples import due

__all__ = ["ROLLED_BACK", "SAMPLES_ROLLED_BACK", "Program", "drive"]


class _Stop(Exception):
    pass


def drive(
    prog: Program,
    *,
    write: bool = True,
    out_dir: str | Path | None = None,
    resume: Resume | None = None,
    log: Callable[[str], None] | None = None,
    guard: reliability.RunGuard | None = None,
    on_step: Callable[[int, dict[str, Any]], Any] | None = None,
) -> tuple[list[RunResult], str | None]:
    """Run ``prog`` to the end (or a stop); returns one :class:`RunResult` per member and the
    reason of a guard/rollback stop (None otherwise). See the module docstring.

    ``guard`` (:class:`klrl.loop.reliability.RunGuard`, entered by the caller before anything was built)
    holds the signal handlers installed since then and takes the run directory's lock here, before
    anything is written into a new directory.

    ``on_step(iteration, metrics)`` (e.g. a live plot in a notebook) is called on the host after each
    row is recorded (one step late, as rows are), with the run's metrics (``{name: float}``) or, for
    a sweep, ``{name: array over members}``; on process 0 only."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    cfgs, n_m, stacked = prog.configs, len(prog.configs), prog.stacked
    tc = cfgs[0].train
    metric = tc.rollback_metric
    if metric and not write:
        raise ConfigError("train.rollback_metric: the quality rollback needs checkpoints (write=True)")
    main = distributed.is_main()  # several processes (klrl.distributed): only process 0 writes
    abstract = prog.abstract if prog.abstract is not None else jax.eval_shape(prog.init)
    restore_to = ckpt.target(abstract, prog.shardings)  # (shardings=None: host arrays)
    if metric:
        names = jax.eval_shape(prog.step, abstract, prog.env)[1]
        if metric not in names:
            raise ConfigError(
                f"train.rollback_metric: {metric!r} is not a metric of this run "
                f"(e.g. {', '.join(sorted(n for n in names if n.startswith(('eval/', 'reward/'))))})"
            )
    root: Path | None = None
    writers: list[MetricsWriter] = []
    rows: list[list[dict[str, Any]]] = [[] for _ in cfgs]
    rollbacks = 0
    swept = varying_fields(cfgs) if stacked else []
    aliases = alias_map(tc.metric_aliases)
    alias_names = set(aliases.values())
    if resume is not None:
        root = resume.dir
        dirs = member_dirs(root, cfgs, stacked, existing=True)
        # a checkpoint, or the initial state for a directory with nothing done yet (killed before
        # its first checkpoint); checksums verified (klrl.io.checkpoint)
        state, meta = restore_resume(resume, restore_to, prog.init)
        state = prog.place(state)  # host values (the same on every process), or already on prog.shardings
        rollbacks = int(meta.get("rollbacks", 0))
        # past this point the resume is valid: cut metrics back to the checkpoint (atomically); every
        # process reads the same first lines (a replacement is a rename), only process 0 writes
        n_lines = int(meta["metrics_lines"])
        rows, writers, msg = cut_to_checkpoint(resume, n_lines, cfgs, dirs, swept, alias_names, main)
        if main and not tc.quiet:
            log(f"{root}: {msg}")
    else:
        if write and main:
            root = Path(out_dir) if out_dir is not None else new_run_dir(cfgs[0])
            root.mkdir(parents=True, exist_ok=True)
            if guard is not None:
                guard.hold(root)  # one writer per run directory, before anything is written into it
            writers = create_dirs(root, cfgs, stacked, swept, prog.task_info)
        if write:  # every process saves checkpoints (orbax coordinates them) into process 0's directory
            root = distributed.agree_path(root)
        state = prog.init()
    if root is not None:
        dirs = member_dirs(root, cfgs, stacked, existing=stacked and resume is not None)
    else:
        dirs = [None] * n_m
    # the state a rollback to step 0 restores (a host copy: ``init`` cannot be re-run once ``step``
    # has donated the controller's parameter arrays)
    initial = ckpt.host_copy(state if resume is None else prog.init()) if metric else None
    mgr = ckpt.manager(root, keep=tc.keep_checkpoints, async_save=True) if root is not None else None
    traces = [[float(r.get(metric, math.nan)) for r in rows[j]] for j in range(n_m)] if metric else []
    bases: list[float | None] = [None] * n_m  # the rollback metric at iteration 0 (the threshold's reference)
    if metric and resume is not None:
        bases = rollback_bases(resume.meta, metric, traces)

    quiet = tc.quiet or not main
    t0 = time.time()
    i = len(rows[0])
    start = i
    progress = Progress(tc.iterations, tc.log_every, quiet, start=start)
    last_saved = i if resume is not None else -1
    stopped: str | None = None
    stop_error: str | None = None

    lrs = learning_rates(state, n_m)  # (read before the first step donates the state)
    clock = {"last": None}  # when the previous row was flushed (None: none yet in this process)

    sample_log = None
    if writers and prog.tokenizer is not None and tc.samples_every > 0:
        from klrl.step.samples import SampleLog

        sample_log = SampleLog(
            prog.tokenizer, dirs, writers, tc.samples_every, tc.iterations, prog.prompt_texts
        )

    heldout_rows: dict[int, Any] = {}  # held-out metrics waiting for their row

    def flush(it: int, m: Any) -> None:
        m = dict(distributed.to_host(m))
        if it in heldout_rows:
            m.update(distributed.to_host(heldout_rows.pop(it)))
        from klrl.step.samples import pop_samples

        sample_rows = pop_samples(m)  # decoded and written every train.samples_every iterations
        if sample_log is not None:
            sample_log.write(it, sample_rows, stacked)
        now = time.time()
        # wall time per iteration: between two rows (one step late, so in steady state the step's time);
        # the first row of this process holds the compile and is not timed
        dt = None if clock["last"] is None else now - clock["last"]
        clock["last"] = now
        for j in range(n_m):
            mj = member_row(m, j if stacked else None, it, cfgs[j].train.batch_size, lrs)
            rows[j].append({"iteration": it, **mj})
            if writers and dt is not None and dt > 0:
                writers[j].write_timing(it, timings(mj, cfgs[j].train.batch_size, dt))
            if metric:
                traces[j].append(mj.get(metric, math.nan))
                if bases[j] is None:
                    bases[j] = traces[j][0]
                    msg = base_message(metric, bases[j])
                    if msg is not None:
                        msg = msg if not stacked else f"member {j:02d}: {msg}"
                        log(msg)
                        if writers:
                            writers[j].event(it, "rollback_off", msg)
            if writers:  # the aliases only in metrics.jsonl and the event file, not in the rows
                writers[j].write(it, with_aliases(mj, aliases) if aliases else mj)
        if on_step is not None and main:
            on_step(it, latest(rows, stacked))
        if stacked:
            means, text = sweep_progress(m)
            progress.update(it, means, extra=text)
        else:
            progress.update(it, {k: float(v) for k, v in m.items()})

    def save(step: int) -> None:
        nonlocal last_saved
        if mgr is None or step == last_saved:
            return
        b = [x if x is not None and math.isfinite(x) else None for x in bases]
        base_meta = None
        if metric:
            base_meta = {"metric": metric, "values": b} if stacked else {"metric": metric, "value": b[0]}
        meta = {"config": cfgs[0].to_dict(), "version": ckpt.version(), "iteration": step,
                "metrics_lines": len(rows[0]), "rollbacks": rollbacks,
                "rollback_base": base_meta}  # fmt: skip
        if stacked:
            meta["members"] = [c.to_dict() for c in cfgs]
        ckpt.save(mgr, step, state, meta)
        last_saved = step

    def check() -> str | None:
        """What the newest metrics rows ask for: None, 'skips' or 'rollback'."""
        skips = max(r[-1].get("guard/consecutive_skips", 0.0) for r in rows)
        if reliability.skip_stop(skips, tc.max_consecutive_skips):
            return "skips"
        if metric and any(
            reliability.is_bad(traces[j][-1], bases[j], tc.rollback_threshold) for j in range(n_m)
        ):
            return "rollback"
        return None

    def roll_back() -> int:
        """Restore the newest checkpoint good for every member whose metric crossed, with those
        members' beta x factor (the other members replay exactly); returns its step."""
        nonlocal state, rollbacks, last_saved, lrs
        mgr.wait_until_finished()
        steps = ckpt.steps(mgr)
        decs = {}
        for j in range(n_m):
            d = reliability.decide_rollback(traces[j], steps, tc.rollback_threshold, bases[j])
            if d is not None:
                decs[j] = d
        who = (lambda j: f"member {j:02d}: ") if stacked else (lambda j: "")
        j0, d0 = next(iter(decs.items()))
        if rollbacks >= tc.max_rollbacks:
            raise _Stop(give_up_message(who(j0), metric, d0, tc.rollback_threshold, rollbacks))
        target = min(d.step for d in decs.values())
        failed = np.asarray(distributed.to_host(state.ctrl.beta), np.float32)  # beta when the metric crossed
        new = initial if target == 0 else ckpt.restore(mgr, restore_to, target)[0]
        old = np.asarray(distributed.to_host(new.ctrl.beta), np.float32)
        new_beta = reliability.rollback_betas(old, failed, list(decs), tc.rollback_factor)
        new = new._replace(ctrl=new.ctrl._replace(beta=new_beta))
        beta = new_beta.reshape(-1)
        state = prog.place(new)
        lrs = learning_rates(new, n_m)
        clock["last"] = None  # the next row follows a restore: not timed
        for s in ckpt.steps(mgr):
            if s > target:
                mgr.delete(s)
        last_saved = target if target > 0 else -1
        # metrics (and samples) after the restored state move to *.rolled_back.jsonl (never lost)
        move_rolled_back(dirs, target, main)
        for j in range(n_m):
            del rows[j][target:], traces[j][target:]
        rollbacks += 1
        for j, d in decs.items():
            msg = rollback_message(rollbacks, tc.max_rollbacks, who(j), metric, d, tc.rollback_threshold,
                                   target, float(old.reshape(-1)[j]), float(beta[j]))  # fmt: skip
            if writers:
                writers[j].event(d.crossing, "rollback", msg)
            log(msg)
        return target

    stop_reward: tuple[int, Exception] | None = None
    reward_stop: str | None = None
    rejected_at: dict[int, np.ndarray] = {}

    def failed_reward(m: Any) -> Exception | None:
        """The host reward's failure, if this row's iteration was rejected and a function failed."""
        if prog.reward_check is None:
            return None
        skipped = np.asarray(distributed.to_host(m["guard/skipped"])).reshape(-1)
        e = reward_failure(prog.reward_check, skipped)
        if e is not None:
            rejected_at[0] = skipped
        return e

    def accepted_none(it: int) -> bool:
        # several sweep device groups call the reward concurrently: a group scored before the failure
        # may have accepted this iteration; then only an older checkpoint is good for every member
        return bool((rejected_at.get(0, np.ones(1)) > 0).all())

    def where_saved() -> str:
        if mgr is None:
            return "not saved (write=False)"
        return f"checkpoint {last_saved} in {mgr.directory}" if last_saved >= 0 else "none yet"

    pending = None  # (iteration, metrics) of the newest step, fetched while the next one runs
    try:
        with guard.signals if guard is not None else reliability.StopSignals(log) as signals:
            while True:
                stopping = signals.received is not None  # no new step: sync, checkpoint, return
                fetch = [pending] if pending is not None else []
                pending = None
                sync = True
                if (
                    not stopping
                    and i < tc.iterations
                    and prog.evaluate is not None
                    and due(i, cfgs[0].data.eval_every, tc.iterations)
                ):
                    # before the step donates the state: the held-out metrics of the state after i updates
                    heldout_rows[i] = jax.block_until_ready(prog.evaluate(state, prog.env))
                    err = reward_error(prog.heldout_check)
                    if err is not None:  # the state is good (only the evaluation's reward failed)
                        heldout_rows.pop(i)
                        if pending is not None:
                            flush(*pending)
                            pending = None
                        save(len(rows[0]))
                        reward_stop = f"{err} (held-out evaluation); last good state: {where_saved()}"
                        break
                if not stopping and i < tc.iterations:
                    release_freed_memory()  # freed heap (compiles, checkpoints) back before the step
                    state, metrics = prog.step(state, prog.env)
                    if i == start:  # the call compiled the step: its heap, while the step runs
                        release_freed_memory()
                    i += 1
                    every = tc.checkpoint_every
                    sync = i == tc.iterations or (every > 0 and i % every == 0)
                    if sync:
                        fetch.append((i - 1, metrics))
                    else:
                        pending = (i - 1, metrics)
                action = None
                for it, m in fetch:
                    if action is None:  # rows end where the stop was decided
                        failure = failed_reward(m)
                        if failure is not None:
                            action = "reward"
                            stop_reward = (it, failure)
                            break
                        flush(it, m)
                        action = check()
                if action == "reward":
                    # a host reward function failed: the iteration (and any after it, see
                    # klrl.rewards.host) was rejected by the guard, so the state holds the last good
                    # parameters; it is saved as the state after the rows written, and the run ends
                    pending = None
                    it, err = stop_reward
                    if mgr is not None and accepted_none(it):
                        state = prog.place(restamp(ckpt.host_copy(state), rows))
                        save(len(rows[0]))
                    reward_stop = f"{err}; last good state: {where_saved()}"
                    i = len(rows[0])
                    break
                if action == "rollback":
                    pending = None
                    try:
                        i = roll_back()
                    except _Stop as e:
                        stop_error = str(e)
                        break
                    continue
                if action == "skips":
                    # the step after the K-th skip was a no-op (klrl.step.train.guard): its row is
                    # dropped and, for a single run, the state is the one after exactly K skips
                    pending = None
                    if not stacked:
                        save(len(rows[0]))
                    n_skips = int(max(r[-1]["guard/consecutive_skips"] for r in rows))
                    stop_error = skips_message(n_skips, tc.max_consecutive_skips, where_saved())
                    i = len(rows[0])
                    break
                if sync:
                    save(i)
                if stopping:
                    stopped = signals.name
                    break
                if i >= tc.iterations and pending is None:
                    break
    finally:
        progress.close()
        if sample_log is not None:
            sample_log.close()
        if mgr is not None:
            ckpt.finish(mgr)  # wait + close; a second error on the way out is dropped
        release_freed_memory()  # (the saves' freed heap, before the export and the report)
    elapsed = time.time() - t0
    info = {"train_s": elapsed, "task": prog.task_info, "start_iteration": start, "iteration": i,
            "stopped": stopped, "rollbacks": rollbacks,
            "checkpoint": last_saved if last_saved >= 0 else None}  # fmt: skip
    out = results(cfgs, dirs, rows, state, stacked, info, writers, max(i - 1, 0))
    if reward_stop is not None:
        from klrl.rewards.host import RewardFunctionError

        err = RewardFunctionError(reward_stop)
        err.result = out
        raise err
    return out, stop_error
