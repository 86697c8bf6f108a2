"""The one training loop, for a single run and for a sweep (members stacked in one state).

:func:`drive` steps a :class:`Program` to ``train.iterations``: metrics rows (one ``metrics.jsonl``
and event file per member), checkpoints of the whole (stacked) state every ``train.checkpoint_every``
iterations, SIGTERM/SIGINT (finish the iteration, checkpoint, return), the non-finite stop (after
exactly ``train.max_consecutive_skips`` skips), the quality rollback, a failed host reward function
and resume: the same code for both, so a sweep resumes exactly like a run, bit for bit.

The driver itself is short: it opens the run (new or resumed) into a :class:`~klrl.loop.hooks.Loop`,
steps it and records each step's row; the rest is done by the hooks of :mod:`klrl.loop.hooks`
(checkpoints, metrics sink, samples, progress, rollback, reward failure, held-out evaluation, signals),
each told of every recorded row (``on_step``) and of the end (``on_stop``). Metrics are fetched one
step late (the host writes iteration ``i`` while the device runs ``i + 1``), at once at a checkpoint.

Layout: a single run keeps everything in its run directory; a sweep keeps ``sweep.json``,
``task.json`` and ``checkpoints/`` in the sweep directory and one directory (config, metrics,
events, summary) per member, named after its swept values (``member-XX`` in older sweeps).
The run directory's files are in :mod:`klrl.loop.files`, the stop lines and the reward-failure checks
in :mod:`klrl.loop.stops`, :class:`Program` in :mod:`klrl.loop.program`.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from klrl import distributed
from klrl.config import ConfigError
from klrl.io import checkpoint as ckpt
from klrl.io.logging import new_run_dir
from klrl.io.results import RunResult, varying_fields
from klrl.io.resume import Resume
from klrl.io.resume import restore as restore_resume
from klrl.loop import frozen, reliability
from klrl.loop.compile import CacheStats, compile_line, phase_log, xla_banners
from klrl.loop.files import (
    ROLLED_BACK,
    SAMPLES_ROLLED_BACK,
    create_dirs,
    cut_to_checkpoint,
    member_dirs,
    results,
    rollback_bases,
)
from klrl.loop.hooks import (
    Checkpoints,
    HeldOut,
    Hook,
    KLSignNote,
    Loop,
    MetricsSink,
    ProgressLine,
    QualityRollback,
    ReadyTimes,
    Rejected,
    RewardFailure,
    Row,
    Signals,
)
from klrl.loop.hostmem import release_freed_memory
from klrl.loop.metrics import alias_map, learning_rates, member_row
from klrl.loop.program import Program
from klrl.loop.samples import Samples, pop_samples
from klrl.loop.stops import skips_message
from klrl.loop.trackers import WandbTracker
from klrl.loop.user import MetricFns

__all__ = ["ROLLED_BACK", "SAMPLES_ROLLED_BACK", "Program", "drive"]

_Fetch = tuple[int, Any, Callable[[], float]]  # a step's (iteration, metrics, when its outputs were ready)


def drive(
    prog: Program,
    *,
    write: bool = True,
    out_dir: str | Path | None = None,
    resume: Resume | None = None,
    log: Callable[[str], None] | None = None,
    guard: reliability.RunGuard | None = None,
    on_step: Callable[[int, dict[str, Any]], Any] | None = None,
    hooks: Sequence[Hook] = (),
    metrics: Sequence[Callable[..., dict[str, float]]] = (),
) -> tuple[list[RunResult], str | None]:
    """Run ``prog`` to the end (or a stop); returns one :class:`RunResult` per member and the
    reason of a guard/rollback stop (None otherwise). See the module docstring. A failed host reward
    function raises :class:`~klrl.rewards.host.RewardFunctionError` (``.result``: the results).

    ``guard`` (:class:`klrl.loop.reliability.RunGuard`, entered by the caller before anything was built)
    holds the signal handlers installed since then and takes the run directory's lock here, before
    anything is written into a new directory.

    ``on_step(iteration, metrics)`` (e.g. a live plot in a notebook) is called on the host after each
    row is recorded (one step late, as rows are), with the run's metrics (``{name: float}``) or, for
    a sweep, ``{name: array over members}``; on process 0 only. ``hooks``: the user's own objects with
    ``on_step(loop, row)`` and ``on_stop(loop)`` (:class:`~klrl.loop.hooks.Hook`), told after the
    built-in ones and the trackers, on every process; ``metrics``: the user's metric functions
    (:class:`klrl.loop.user.MetricFns`: ``user/<name>`` in every row, before it is written)."""
    log = log or _stderr
    restore_to = _restore_target(prog)
    if resume is not None:
        loop = _resumed(prog, resume, restore_to, log)
    else:
        loop = _new(prog, write, out_dir, guard)
    user = list(hooks)
    hooks = _hooks(loop, resume, restore_to, guard, log, on_step)
    hooks.user += user
    if metrics:
        hooks.metric_fns.append(MetricFns(list(metrics), hooks.samples))
    try:
        with hooks.signals:
            while _iteration(loop, hooks):
                pass
    finally:
        for h in hooks.stopping_order:
            h.on_stop(loop)
        release_freed_memory()  # (the saves' freed heap, before the export and the report)
    return _finish(loop, hooks.ckpts)


@dataclass
class _Hooks:
    """The loop's hooks by name (the driver calls a few of them at their own moments: the signals
    before an iteration, the held-out evaluation before a step, the checkpoints at a sync point)."""

    signals: Signals
    ckpts: Checkpoints
    heldout: HeldOut
    reward: RewardFailure
    rollback: QualityRollback
    samples: Samples
    sink: MetricsSink
    progress: ProgressLine
    ready: ReadyTimes
    user: list[Hook]  # the KL sign note, the trackers (log.wandb) and the user's hooks, in this order
    metric_fns: list[Hook] = field(default_factory=list)  # the user's metric functions (klrl.loop.user)

    @property
    def row_order(self) -> list[Hook]:
        """The hooks told of a recorded row, in this order (the samples' decoding before the sink's
        clock; the progress line last)."""
        return [self.samples, *self.metric_fns, self.rollback, self.sink, self.progress, *self.user]

    @property
    def stopping_order(self) -> list[Hook]:
        return [self.progress, self.samples, self.ckpts, self.rollback, self.sink, self.heldout, self.reward,
                self.ready, *self.user]  # fmt: skip


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _restore_target(prog: Program) -> Any:
    """Where a checkpoint is restored to (the state's shapes, dtypes and shardings; shardings=None:
    host arrays), once ``train.rollback_metric`` is known to be usable."""
    metric = prog.configs[0].train.rollback_metric  # (with write=True: klrl.checks.preflight)
    abstract = prog.abstract if prog.abstract is not None else jax.eval_shape(prog.init)
    restore_to = ckpt.target(abstract, prog.shardings)
    if metric:
        names = jax.eval_shape(prog.step, abstract, prog.env)[1]
        if metric not in names:
            raise ConfigError(
                f"train.rollback_metric: {metric!r} is not a metric of this run "
                f"(e.g. {', '.join(sorted(n for n in names if n.startswith(('eval/', 'reward/'))))})"
            )
    return restore_to


def _new(prog: Program, write: bool, out_dir: str | Path | None, guard: reliability.RunGuard | None) -> Loop:
    """A new run: its directory and files (process 0 writes; every process saves checkpoints, which
    orbax coordinates, into process 0's directory) and the initial state."""
    cfgs, main = prog.configs, distributed.is_main()  # several processes: only process 0 writes
    root, writers = None, []
    if write and main:
        fresh = out_dir is None or not Path(out_dir).exists()
        root = Path(out_dir) if out_dir is not None else new_run_dir(cfgs[0])
        root.mkdir(parents=True, exist_ok=True)
        try:
            if guard is not None:
                guard.hold(root)  # one writer per run directory, before anything is written into it
            swept = varying_fields(cfgs) if prog.stacked else []
            writers = create_dirs(root, cfgs, prog.stacked, swept, prog.task_info)
        except OSError:  # (a full disk from the start) no directory without its config is left behind
            if fresh:
                shutil.rmtree(root, ignore_errors=True)
            raise
    if write:
        root = distributed.agree_path(root)
    state = prog.init()
    dirs = member_dirs(root, cfgs, prog.stacked) if root is not None else [None] * len(cfgs)
    return Loop(prog, root, dirs, writers, state, [[] for _ in cfgs], start=0, main=main)


def _resumed(prog: Program, resume: Resume, restore_to: Any, log: Callable[[str], None]) -> Loop:
    """A resumed run: a checkpoint (or the initial state of a directory killed before its first one;
    checksums verified, klrl.io.checkpoint), its files cut back to it (atomically; every process reads
    the same first lines, only process 0 writes)."""
    cfgs, main, tc = prog.configs, distributed.is_main(), prog.configs[0].train
    dirs = member_dirs(resume.dir, cfgs, prog.stacked, existing=True)
    if not frozen.saved_with_reference(resume.meta):  # (older checkpoints hold the frozen reference too)
        restore_to = frozen.without(prog, restore_to)
    state, meta = restore_resume(resume, restore_to, prog.init)
    state = frozen.restored(prog, state, meta, f"checkpoint {resume.step} in {resume.dir}")
    state = prog.place(state)  # host values (the same on every process), or already on prog.shardings
    swept = varying_fields(cfgs) if prog.stacked else []
    aliases = set(alias_map(tc.metric_aliases).values())
    n_lines = int(meta["metrics_lines"])
    rows, writers, msg = cut_to_checkpoint(resume, n_lines, cfgs, dirs, swept, aliases, main)
    if main and not tc.quiet:
        log(f"{resume.dir}: {msg}")
    rollbacks = int(meta.get("rollbacks", 0))
    return Loop(prog, resume.dir, dirs, writers, state, rows, len(rows[0]), rollbacks, main)


def _hooks(loop: Loop, resume: Resume | None, restore_to: Any, guard: reliability.RunGuard | None,
           log: Callable[[str], None], on_step: Callable[..., Any] | None) -> _Hooks:  # fmt: skip
    """The loop's hooks, set up for ``loop`` (new or resumed)."""
    prog, tc, n = loop.prog, loop.configs[0].train, len(loop.configs)
    metric, traces, bases, initial = tc.rollback_metric, [], [None] * n, None
    if metric:
        # the state a rollback to step 0 restores (a host copy: ``init`` cannot be re-run once ``step``
        # has donated the controller's parameter arrays)
        initial = ckpt.host_copy(frozen.without(prog, loop.state if resume is None else prog.init()))
        traces = [[float(r.get(metric, math.nan)) for r in rows] for rows in loop.rows]
        if resume is not None:  # the rollback metric at iteration 0 (the threshold's reference)
            bases = rollback_bases(resume.meta, metric, traces)
    rollback = QualityRollback(tc, loop.stacked, log, traces, bases, initial)
    mgr = None if loop.root is None else ckpt.manager(loop.root, keep=tc.keep_checkpoints, async_save=True)
    if mgr is not None and loop.main and not tc.quiet:  # how many checkpoints, how big (the disk they take)
        log(
            ckpt.plan_line(
                frozen.without(prog, restore_to), tc.keep_checkpoints, tc.checkpoint_every, loop.root
            )
        )
    last_saved = loop.start if resume is not None else -1
    ckpts = Checkpoints(mgr, tc.checkpoint_every, tc.iterations, frozen.without(prog, restore_to),
                        rollback.base_meta, last_saved)  # fmt: skip
    loop.t0 = time.time()
    quiet = tc.quiet or not loop.main
    progress = ProgressLine.of(tc.iterations, tc.log_every, quiet, loop.start)
    loop.lrs = learning_rates(loop.state, n)  # (read before the first step donates the state)
    signals = Signals(guard.signals if guard is not None else None, log)
    sink = MetricsSink(alias_map(tc.metric_aliases), on_step)
    heldout, reward, samples = HeldOut(prog), RewardFailure(prog), Samples.of(loop)
    trackers: list[Hook] = []
    if loop.main and not tc.quiet:
        trackers.append(KLSignNote(loop.configs[0].kl.estimator, log))
    if loop.configs[0].log.wandb and loop.main:  # (wandb imported there, only then)
        trackers.append(WandbTracker(loop, samples, sink.aliases, log))
    return _Hooks(signals, ckpts, heldout, reward, rollback, samples, sink, progress, ReadyTimes(), trackers)


def _iteration(loop: Loop, hooks: _Hooks) -> bool:
    """One pass: a step (unless a signal came or all are done), the rows fetched by now recorded, what
    they ask for done, a checkpoint when due; False when the loop is over."""
    stopping = hooks.signals.received is not None  # no new step: sync, checkpoint, return
    fetch = [loop.pending] if loop.pending is not None else []
    loop.pending = None
    sync = True
    if not stopping and loop.i < loop.iterations:
        # before the step donates the state: the held-out metrics of the state after i updates
        err = hooks.reward.heldout_error() if hooks.heldout.before_step(loop) else None
        if err is not None:
            return _heldout_stop(loop, hooks, fetch, err)
        sync = _step(loop, fetch, hooks)
    action = _record(loop, hooks, fetch)
    if action is not None:
        loop.pending = None
        return _act(action, loop, hooks)
    if sync:
        hooks.ckpts.save(loop, loop.i)
    if stopping:
        loop.stopped = hooks.signals.name
        return False
    return loop.i < loop.iterations or loop.pending is not None


def _heldout_stop(loop: Loop, hooks: _Hooks, fetch: list[_Fetch], err: Exception) -> bool:
    """The held-out evaluation's reward failed (``err``) before step ``loop.i``: the rows fetched by now
    (the previous step's, pending when it was not a checkpoint) recorded first, as any row, so the
    state saved is the state after exactly the rows written; what a row asks for comes first."""
    action = _record(loop, hooks, fetch)
    if action is not None and not _act(action, loop, hooks):
        return False
    hooks.reward.heldout_stop(loop, hooks.ckpts, err)
    return False


def _step(loop: Loop, fetch: list[_Fetch], hooks: _Hooks) -> bool:
    """One step; its metrics fetched now (a checkpoint is due: returns True) or with the next one,
    with when its outputs were ready (:class:`~klrl.loop.hooks.ReadyTimes`)."""
    release_freed_memory()  # freed heap (compiles, checkpoints) back before the step
    if loop.i == loop.start:  # the call compiles the step (klrl.loop.compile: its line, XLA's banners)
        loop.state, metrics = _first_step(loop)
    else:
        loop.state, metrics = loop.prog.step(loop.state, loop.prog.env)
    done = (loop.i, metrics, hooks.ready.watch(metrics))
    if loop.i == loop.start:  # the call compiled the step: its heap, while the step runs
        release_freed_memory()
    loop.i += 1
    sync = hooks.ckpts.due(loop.i)
    if sync:
        fetch.append(done)
    else:
        loop.pending = done
    return sync


def _first_step(loop: Loop) -> tuple[Any, Any]:
    """The first step of this process's loop, which compiles it: a phase line before and one with its
    seconds and the persistent cache's reads after (:func:`klrl.loop.compile.phase_log`), XLA's
    banners to the run's ``xla.log`` (:func:`klrl.loop.compile.xla_banners`)."""
    say = phase_log(loop.configs[0].train.quiet) if loop.main else None
    n = len(loop.configs)
    if say is not None:
        say(f"compiling the train step{f' ({n} members in one program)' if n > 1 else ''} ...")
    snap, t0 = CacheStats.snapshot(), time.time()
    with xla_banners(loop.root if loop.main else None, say):
        out = loop.prog.step(loop.state, loop.prog.env)
    if say is not None:
        callbacks = any(c.reward.fn.strip() for c in loop.configs)
        say(compile_line(time.time() - t0, CacheStats.since(snap), callbacks))
    return out


def _record(loop: Loop, hooks: _Hooks, fetch: list[_Fetch]) -> Rejected | str | None:
    """Record the fetched rows in order, until one asks for something (rows end where a stop was
    decided): a :class:`Rejected` (a host reward failed), ``'skips'`` or ``'rollback'``; else None."""
    for it, m, ready in fetch:
        rejected = hooks.reward.rejected(it, m)
        if rejected is not None:
            return rejected
        row = _row(loop, hooks.heldout, it, m, ready())
        for h in hooks.row_order:
            h.on_step(loop, row)
        skips = max(r[-1].get("guard/consecutive_skips", 0.0) for r in loop.rows)
        if reliability.skip_stop(skips, loop.configs[0].train.max_consecutive_skips):
            return "skips"
        if hooks.rollback.crossed():
            return "rollback"
    return None


def _row(loop: Loop, heldout: HeldOut, it: int, m: Any, ready: float) -> Row:
    """The step's metrics ``m`` (ready at ``ready``) on the host as row ``it``, appended to every
    member's rows."""
    m = dict(distributed.to_host(m))
    m.update(heldout.take(it))
    samples = pop_samples(m)  # decoded and written every train.samples_every iterations
    members = []
    for j, c in enumerate(loop.configs):
        mj = member_row(m, j if loop.stacked else None, it, c.train.batch_size, loop.lrs)
        loop.rows[j].append({"iteration": it, **mj})
        members.append(mj)
    return Row(it, m, members, samples, ready)


def _act(action: Rejected | str, loop: Loop, hooks: _Hooks) -> bool:
    """Do what a row asked for; False when the loop is over."""
    if isinstance(action, Rejected):
        hooks.reward.stop(loop, hooks.ckpts, action)
        return False
    if action == "rollback":
        loop.stop_error = hooks.rollback.roll_back(loop, hooks.ckpts)
        if loop.stop_error is not None:
            return False
        hooks.sink.restart_clock()  # the next row follows a restore: not timed
        return True
    # the step after the K-th skip was a no-op (klrl.step.train.guard): its row is dropped and, for a
    # single run, the state is the one after exactly K skips
    if not loop.stacked:
        hooks.ckpts.save(loop, loop.recorded)
    n_skips = int(max(r[-1]["guard/consecutive_skips"] for r in loop.rows))
    max_skips = loop.configs[0].train.max_consecutive_skips
    loop.stop_error = skips_message(n_skips, max_skips, hooks.ckpts.where_saved())
    loop.i = loop.recorded
    return False


def _finish(loop: Loop, ckpts: Checkpoints) -> tuple[list[RunResult], str | None]:
    """The results (process 0 closes the writers and writes the summaries); a reward stop raises."""
    info = {"train_s": time.time() - loop.t0, "task": loop.prog.task_info, "start_iteration": loop.start,
            "iteration": loop.i, "stopped": loop.stopped, "rollbacks": loop.rollbacks,
            "checkpoint": ckpts.last_saved if ckpts.last_saved >= 0 else None}  # fmt: skip
    out = results(loop.configs, loop.dirs, loop.rows, loop.state, loop.stacked, info, loop.writers,
                  max(loop.i - 1, 0))  # fmt: skip
    RewardFailure.raise_stop(loop, out)
    return out, loop.stop_error
