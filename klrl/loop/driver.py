"""The one training loop, for a single run and for a sweep (members stacked in one state).

:func:`drive` steps a :class:`Program` to ``train.iterations``: metrics rows (one ``metrics.jsonl``
and event file per member), checkpoints of the whole (stacked) state every ``train.checkpoint_every``
iterations, SIGTERM/SIGINT (finish the iteration, checkpoint, return), the non-finite stop (after
exactly ``train.max_consecutive_skips`` skips), the quality rollback, a failed host reward function
and resume: the same code for both, so a sweep resumes exactly like a run, bit for bit.

The driver itself is short: it opens the run (new or resumed) into a :class:`~klrl.loop.hooks.Loop`,
steps it and records each step's row; the rest is done by hooks (:mod:`klrl.loop.hooks`, built by
:func:`klrl.loop.wiring.hooks`), every one called the same way, in one list: ``before_step``,
``on_metrics``, ``on_row`` (every ``every`` rows), ``sync_due``/``on_sync``, ``on_note``, ``truncate``,
``on_stop``. A hook that needs the loop to do something returns a request, and the driver does it the
same way whichever hook asked: a :class:`~klrl.loop.hooks.Note` goes to every hook's ``on_note``; a
:class:`~klrl.loop.hooks.Stop` ends the loop (the state saved first through ``on_sync`` when it asks);
a :class:`~klrl.loop.hooks.Restore` rolls the run back (every hook's ``truncate``, then the state, the
rows and the iteration set back). Metrics are fetched one step late (the host writes iteration ``i``
while the device runs ``i + 1``), at once when a hook wants the state synced (a checkpoint is due).

Layout: a single run keeps everything in its run directory; a sweep keeps ``sweep.json``,
``task.json`` and ``checkpoints/`` in the sweep directory and one directory (config, metrics,
events, summary) per member, named after its swept values (``member-XX`` in older sweeps).
The run directory's files are in :mod:`klrl.loop.files`, the stop lines and the reward-failure checks
in :mod:`klrl.loop.stops`, :class:`Program` in :mod:`klrl.loop.program`.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax

from klrl import distributed
from klrl.io import checkpoint as ckpt
from klrl.io.logging import new_run_dir
from klrl.io.results import RunResult
from klrl.io.resume import Resume
from klrl.io.resume import restore as restore_resume
from klrl.loop import frozen, reliability, wiring
from klrl.loop.compile import CacheStats, compile_line, phase_log, xla_banners
from klrl.loop.files import (
    ROLLED_BACK,
    SAMPLES_ROLLED_BACK,
    create_dirs,
    cut_to_checkpoint,
    member_dirs,
    results,
)
from klrl.loop.hooks import Hook, Loop, Note, ReadyTimes, Restore, Row, Stop
from klrl.loop.hostmem import release_freed_memory
from klrl.loop.metrics import alias_map, learning_rates, member_row
from klrl.loop.program import Program
from klrl.loop.samples import pop_samples

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
    hooks: Sequence[Any] = (),
    metrics: Sequence[Callable[..., dict[str, float]]] = (),
) -> tuple[list[RunResult], str | None]:
    """Run ``prog`` to the end (or a stop); returns one :class:`RunResult` per member and the line of a
    stop that is the run's error (a guard, the rollback limit; None otherwise). A stop that raises (a
    failed host reward function: :class:`~klrl.rewards.host.RewardFunctionError`) raises once the results
    are written (``.result``: them). See the module docstring.

    ``guard`` (:class:`klrl.loop.reliability.RunGuard`, entered by the caller before anything was built)
    holds the signal handlers installed since then and takes the run directory's lock here, before
    anything is written into a new directory.

    ``on_step(iteration, metrics)`` (e.g. a live plot in a notebook) is called on the host after each
    row is recorded (one step late, as rows are), with the run's metrics (``{name: float}``) or, for
    a sweep, ``{name: array over members}``; on process 0 only. ``hooks``: the user's own hooks
    (:func:`klrl.loop.user.as_hook`: a :class:`~klrl.loop.hooks.Hook`, ``klrl.hook(fn, every=N)``, an
    object with ``on_row(loop, row)``), called after the built-in ones and the trackers, on every process;
    ``metrics``: the user's metric functions (:mod:`klrl.loop.user`: ``user/<name>`` in every
    row, before it is written)."""
    log = log or _stderr
    restore_to = _restore_target(prog)
    if resume is not None:
        loop = _resumed(prog, resume, restore_to, log)
    else:
        loop = _new(prog, write, out_dir, guard)
    all_hooks = wiring.hooks(loop, resume, restore_to, guard, log, on_step, hooks, metrics)
    ready = ReadyTimes()  # when each step's outputs became ready (the rows' timing)
    try:
        with contextlib.ExitStack() as entered:
            for h in all_hooks:  # (a hook that is a context manager is entered while the loop runs)
                if hasattr(h, "__enter__"):
                    entered.enter_context(h)
            while _iteration(loop, all_hooks, ready):
                pass
    finally:
        for h in all_hooks:
            h.on_stop(loop)
        ready.close()
        release_freed_memory()  # (the saves' freed heap, before the export and the report)
    return _finish(loop)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _restore_target(prog: Program) -> Any:
    """Where a checkpoint is restored to (the state's shapes, dtypes and shardings; shardings=None:
    host arrays), once the hooks' needs of the program are known to be met
    (:func:`klrl.loop.wiring.check`)."""
    abstract = prog.abstract if prog.abstract is not None else jax.eval_shape(prog.init)
    wiring.check(prog, abstract)
    return ckpt.target(abstract, prog.shardings)


def _new(prog: Program, write: bool, out_dir: str | Path | None, guard: reliability.RunGuard | None) -> Loop:
    """A new run: its directory and files (process 0 writes; every process saves checkpoints, which
    orbax coordinates, into process 0's directory) and the initial state."""
    cfgs, main = prog.configs, distributed.is_main()  # several processes: only process 0 writes
    root = None
    if write and main:
        fresh = out_dir is None or not Path(out_dir).exists()
        root = Path(out_dir) if out_dir is not None else new_run_dir(cfgs[0])
        root.mkdir(parents=True, exist_ok=True)
        try:
            if guard is not None:
                guard.hold(root)  # one writer per run directory, before anything is written into it
            create_dirs(root, cfgs, prog.stacked, prog.task_info)
        except OSError:  # (a full disk from the start) no directory without its config is left behind
            if fresh:
                shutil.rmtree(root, ignore_errors=True)
            raise
    if write:
        root = distributed.agree_path(root)
    state = prog.init()
    dirs = member_dirs(root, cfgs, prog.stacked) if root is not None else [None] * len(cfgs)
    return Loop(prog, root, dirs, [], state, [[] for _ in cfgs], start=0, main=main)


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
    aliases = set(alias_map(tc.metric_aliases).values())
    n_lines = int(meta["metrics_lines"])
    rows, msgs = cut_to_checkpoint(resume, n_lines, cfgs, dirs, aliases, main)
    if msgs and not tc.quiet:
        log(f"{resume.dir}: {msgs[0]}")
    rollbacks = int(meta.get("rollbacks", 0))
    loop = Loop(prog, resume.dir, dirs, [], state, rows, len(rows[0]), rollbacks, main)
    loop.opening = [Note(j, resume.step, "resume", m) for j, m in enumerate(msgs)]
    return loop


def _iteration(loop: Loop, hooks: list[Hook], ready: ReadyTimes) -> bool:
    """One pass: the hooks asked before a step, a step (unless one asked to stop, or all are done), the
    rows fetched by now recorded, the first request done, the state synced when a hook wants it;
    False when the loop is over."""
    fetch = [loop.pending] if loop.pending is not None else []
    loop.pending = None
    sync = True
    request = _first(h.before_step(loop) for h in hooks)  # e.g. a signal; the held-out evaluation
    if request is None and loop.i < loop.iterations:
        sync = _step(loop, fetch, hooks, ready)
    # the rows fetched by now are recorded before any stop, and a request of theirs comes first
    request = _record(loop, hooks, fetch) or request
    if request is not None:
        return _act(request, loop, hooks)
    if sync:
        _sync(loop, hooks, loop.i)
    return loop.i < loop.iterations or loop.pending is not None


def _first(requests: Iterable[Any]) -> Any:
    """The first request of ``requests`` (the hooks' answers, in their order): the hooks after it are not
    asked when ``requests`` is a generator (before a step, before a row is made), all of them are when it
    is a list (a recorded row is told to every hook)."""
    return next((r for r in requests if r is not None), None)


def _step(loop: Loop, fetch: list[_Fetch], hooks: list[Hook], ready: ReadyTimes) -> bool:
    """One step; its metrics fetched now (a hook wants the state after it synced: returns True) or with
    the next one, with when its outputs were ready (:class:`~klrl.loop.hooks.ReadyTimes`)."""
    release_freed_memory()  # freed heap (compiles, checkpoints) back before the step
    if loop.i == loop.start:  # the call compiles the step (klrl.loop.compile: its line, XLA's banners)
        loop.state, metrics = _first_step(loop)
    else:
        loop.state, metrics = loop.prog.step(loop.state, loop.prog.env)
    done = (loop.i, metrics, ready.watch(metrics))
    if loop.i == loop.start:  # the call compiled the step: its heap, while the step runs
        release_freed_memory()
    loop.i += 1
    sync = any([h.sync_due(loop.i) for h in hooks])
    if sync:
        fetch.append(done)
    else:
        loop.pending = done
    return sync


def _sync(loop: Loop, hooks: list[Hook], step: int) -> None:
    """Each hook told that ``loop.state`` is the state after ``step`` updates (e.g. a checkpoint)."""
    for h in hooks:
        h.on_sync(loop, step)


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


def _record(loop: Loop, hooks: list[Hook], fetch: list[_Fetch]) -> Stop | Restore | None:
    """Record the fetched rows in order, each told to every hook, until one asks to stop or restore
    (rows end where that was decided); notes are passed on at once."""
    for it, m, when in fetch:
        m = dict(distributed.to_host(m))
        request = _first(_notes(loop, hooks, h.on_metrics(loop, it, m)) for h in hooks)
        if request is not None:  # (the row is not recorded)
            return request
        row = _row(loop, it, m, when())
        request = _first([_notes(loop, hooks, h.on_row(loop, row)) for h in hooks if it % h.every == 0])
        if request is not None:
            return request
    return None


def _notes(loop: Loop, hooks: list[Hook], answer: Any) -> Stop | Restore | None:
    """A hook's answer (None, a request or a list of them): its notes passed to every hook, its first
    stop or restore returned."""
    out = None
    for r in answer if isinstance(answer, list | tuple) else [answer]:
        if isinstance(r, Note):
            for h in hooks:
                h.on_note(loop, r)
        elif isinstance(r, Stop | Restore):
            out = out or r
        elif r is not None:
            raise TypeError(f"a hook returned {type(r).__name__}, not a Note, Stop or Restore (or None)")
    return out


def _row(loop: Loop, it: int, m: dict[str, Any], ready: float) -> Row:
    """The step's host metrics ``m`` (ready at ``ready``) as row ``it``, appended to every member's rows."""
    samples = pop_samples(m)  # decoded and written every train.samples_every iterations
    members = []
    for j, c in enumerate(loop.configs):
        mj = member_row(m, j if loop.stacked else None, it, c.train.batch_size, loop.lrs)
        loop.rows[j].append({"iteration": it, **mj})
        members.append(mj)
    return Row(it, m, members, samples, ready)


def _act(request: Stop | Restore, loop: Loop, hooks: list[Hook]) -> bool:
    """Do what a hook asked for (the pending step's row dropped); False when the loop is over."""
    loop.pending = None
    if isinstance(request, Restore):  # every output cut back to the step, then the state set to it
        for h in hooks:
            h.truncate(loop, request.step)
        for rows in loop.rows:
            del rows[request.step :]
        loop.state = loop.prog.place(request.state)
        loop.lrs = learning_rates(request.state, len(loop.configs))
        loop.i, loop.rollbacks = request.step, loop.rollbacks + 1
        _notes(loop, hooks, list(request.notes))
        return True
    if request.rewind:
        loop.i = loop.recorded
    if request.state is not None:
        loop.state = loop.prog.place(request.state(loop.state))
    if request.save:
        _sync(loop, hooks, loop.recorded)
    loop.stop, loop.stop_line = request, request.line(loop) if callable(request.line) else request.line
    return False


def _finish(loop: Loop) -> tuple[list[RunResult], str | None]:
    """The results (process 0 writes the summaries); a stop that raises raises."""
    info = {"train_s": time.time() - loop.t0, "task": loop.prog.task_info, "start_iteration": loop.start,
            "iteration": loop.i, "stopped": loop.stopped, "rollbacks": loop.rollbacks,
            "checkpoint": loop.checkpoint}  # fmt: skip
    write = loop.main and loop.root is not None
    out = results(loop.configs, loop.dirs, loop.rows, loop.state, loop.stacked, info, write)
    if loop.stop is not None and loop.stop.raises is not None:
        err = loop.stop.raises(loop.stop_line)
        err.result = out
        raise err
    return out, loop.stop_error
