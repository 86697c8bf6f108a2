"""``klrl.run(config)`` and ``klrl.sweep(members)``: training from Python; the command line is a thin
layer over them.

A run is a sweep of one member. Both are checked at their entry (:mod:`klrl.checks`: the
configuration, then the task and the models against the policy, then the devices), built by one
:func:`klrl.loop.build.make_program` (one :func:`klrl.step.train.make_train` per program) and driven
by the one loop (:func:`klrl.loop.driver.drive`: logging, checkpoints, signals, guard, rollback,
resume); results are :mod:`klrl.analysis.results`.

A sweep is one compiled program: ``vmap`` over stacked train states. Its members may differ only in
what lives in the train state (:data:`klrl.config.sweep.SWEEPABLE`: ``kl.beta``, the controller,
``train.seed``, ``optim.lr``); on a ``(sweep, data)`` mesh the members are split over the ``sweep``
axis and each member's batch over the ``data`` devices of its group. The mesh may span several
processes (:mod:`klrl.distributed`); then only process 0 writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from klrl import distributed
from klrl.analysis.results import SUMMARY_KEYS, RunResult, Sweep, columns, load_run, load_sweep
from klrl.checks import check_program, preflight
from klrl.config import RunConfig
from klrl.io.resume import prepare as prepare_resume
from klrl.loop import reliability, user
from klrl.loop.build import adopt_adapter, build_task, make_program, member_state
from klrl.loop.driver import ROLLED_BACK, drive
from klrl.tasks.base import Task
from klrl.tasks.text import save_policy

__all__ = [
    "ROLLED_BACK",
    "SUMMARY_KEYS",
    "RunResult",
    "build_task",
    "columns",
    "load_run",
    "load_sweep",
    "make_program",
    "member_state",
    "run",
    "sweep",
]


def run(
    cfg: RunConfig,
    *,
    task: Task | None = None,
    run_dir: str | Path | None = None,
    write: bool = True,
    log: Any = None,
    resume: str | Path | None = None,
    report: Callable[[RunResult], Any] | None = None,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
    hooks: Sequence[Any] = (),
    checked: bool = False,
    metrics: Sequence[Callable[..., dict[str, float]]] = (),
    **models: Any,
) -> RunResult:
    """Train ``cfg`` to the end and return its metrics, final state and run directory.

    ``write=False`` keeps everything in memory (no run directory, no checkpoints).
    ``resume=RUN_DIR`` continues that run from its latest complete checkpoint up to
    ``cfg.train.iterations`` (see :func:`klrl.io.resume.check_resumable` for what ``cfg`` may change);
    ``metrics.jsonl`` is cut back to the checkpoint, so the result is the same, bit for bit,
    as a run that was never interrupted. ``report(result)`` is called at the end of a written run
    (e.g. :func:`klrl.analysis.report.maybe_write_report`); ``models`` go to
    :func:`klrl.step.train.make_train` (``policy=``, ``policy_params=``, ...).
    ``on_step(iteration, metrics)`` is called with each iteration's metrics as they are recorded
    (e.g. for a live plot; see :func:`klrl.loop.driver.drive`). ``hooks``: objects with
    ``on_step(loop, row)`` and ``on_stop(loop)`` (:class:`klrl.loop.hooks.Hook`: ``row.it``,
    ``row.members[0]`` the row as ``metrics.jsonl`` has it; ``loop.rows``, ``loop.dirs``), told after
    the built-in hooks (metrics, checkpoints, samples, progress, trackers). ``checked``: ``cfg`` already
    passed :func:`klrl.checks.preflight` (mode ``"run"``, the same ``write`` and ``resume``) and is not
    checked again. ``metrics``: functions ``fn(row_metrics, samples) -> {name: float}`` whose values are
    written with each row as ``user/<name>`` (:mod:`klrl.loop.user`; ``train.metric_fns`` names them
    as ``module:function``, ``train.hooks`` names hooks).

    SIGTERM/SIGINT finish the current iteration, checkpoint and return
    (``result.info['stopped']`` names the signal). :class:`klrl.loop.reliability.RunStopped` is raised
    when the non-finite guard skipped ``train.max_consecutive_skips`` iterations in a row
    (the state is checkpointed) or the quality rollback hit ``train.max_rollbacks``.
    Bad input raises :class:`ConfigError` or :class:`klrl.io.checkpoint.CheckpointError`.
    """
    return _go([cfg], False, task, run_dir, write, log, resume, report, on_step, hooks, checked, metrics, 1,
               models)  # fmt: skip


def sweep(
    members: list[RunConfig],
    *,
    task: Task | None = None,
    out_dir: str | Path | None = None,
    write: bool = True,
    sweep_devices: int = 1,
    log: Any = None,
    resume: str | Path | None = None,
    report: Callable[[list[RunResult]], Any] | None = None,
    on_step: Callable[[int, dict[str, Any]], Any] | None = None,
    hooks: Sequence[Any] = (),
    checked: bool = False,
    metrics: Sequence[Callable[..., dict[str, Any]]] = (),
) -> Sweep:
    """Run all ``members`` in one compiled program; one :class:`RunResult` each.

    The loop is a single run's (:mod:`klrl.loop.driver`): with ``write``, ``out_dir`` (default: a new run
    directory) gets one sub-directory per member, named after its swept values
    (:func:`klrl.analysis.results.member_names`: ``kl.beta=0.1,train.seed=1``, else ``member-XX``), each with
    its own config, ``metrics.jsonl`` and event file (with an HParams session), a ``sweep.json`` index
    (``members`` and ``axes``), and ``checkpoints/`` of the stacked state every
    ``train.checkpoint_every`` iterations. SIGTERM/SIGINT checkpoint and return (``info['stopped']``);
    ``resume=SWEEP_DIR`` continues the sweep exactly (bit for bit against an uninterrupted one).
    The non-finite guard and the quality rollback apply per member (a rollback restores the whole
    sweep to a checkpoint good for the members that crossed; the others replay exactly).
    A member on a pretrained ``model.path`` ends with its ``policy/`` as a run does.
    ``report(results)`` is called at the end of a written sweep. With several processes only
    process 0 writes. ``on_step(iteration, metrics)`` gets each iteration's ``{name: array over
    members}`` as it is recorded (e.g. for a live plot). The result is a list with
    ``.to_frame()`` (:func:`klrl.analysis.results.to_frame`). ``sweep_devices``: the device groups
    the members are split over (the rest of the devices split each member's batch). ``hooks``: as
    :func:`run`'s (``row.members[j]``: member ``j``'s row); ``checked``: as :func:`run`'s (mode ``"sweep"``);
    ``metrics``: as :func:`run`'s.
    """
    return _go(list(members), True, task, out_dir, write, log, resume, report, on_step, hooks, checked,
               metrics, sweep_devices, {})  # fmt: skip


def _go(members, stacked, task, out_dir, write, log, resume, report, on_step, hooks, checked, metrics,
        sweep_devices, models):  # fmt: skip
    """:func:`run` (one member, not ``stacked``: its one result) and :func:`sweep` (a :class:`Sweep`): check,
    build, drive, then each member's final ``policy/`` (a pretrained ``model.path``) and ``report``. The whole
    of it inside :class:`~klrl.loop.reliability.RunGuard`: signals from the start (a SIGTERM during the task
    build or the compile stops at the first iteration boundary), the run directory's lock, a full disk as
    one line. The checks before anything is built are :func:`klrl.checks.preflight` (a Hub name in a
    ``model.*`` path is read from the local Hugging Face cache there), unless ``checked``: the caller ran it
    on these members (the command line does, before it joins a distributed run)."""
    with reliability.RunGuard(log) as guard:
        given = task is not None
        members, plan = _checked(members, stacked, given, write, resume, guard, sweep_devices, checked)
        spec_hooks, spec_metrics = user.from_config(members[0])  # train.hooks, train.metric_fns
        prog, task = make_program(members, task, stacked=stacked, write=write, resume=plan, log=log,
                                  check=check_program, sweep_devices=sweep_devices, **models)  # fmt: skip
        results, stop_error = drive(prog, write=write, out_dir=out_dir, resume=plan, log=log, guard=guard,
                                    on_step=on_step, hooks=[*hooks, *spec_hooks],
                                    metrics=[*metrics, *spec_metrics])  # fmt: skip
        out = Sweep(results) if stacked else results[0]
        if results[0].dir is not None and distributed.is_main():
            for r in results:  # a pretrained start ends as an HF directory
                if r.config.model.path and r.state is not None:
                    save_policy(task, r.state, r.dir / "policy", adopt_adapter(r.config))
            if report is not None:
                report(out)
        if stop_error is not None:
            raise reliability.RunStopped(f"stopped: {stop_error}", out)
        return out


def _checked(members, stacked, task_given, write, resume, guard, sweep_devices, checked=False):  # fmt: skip
    """``members`` through :func:`klrl.checks.preflight` (unless ``checked``) and the resume plan (None: a
    fresh start)."""
    if not checked:
        members = preflight(members, "sweep" if stacked else "run", write=write, resume=resume,
                            sweep_devices=sweep_devices, task_given=task_given)  # fmt: skip
    if resume is None:
        return members, None
    if distributed.is_main() and Path(resume).is_dir():
        guard.hold(resume)  # before reading it: a second writer is refused, not interleaved
    return members, prepare_resume(members if stacked else members[0], resume)
