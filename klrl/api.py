"""``klrl.run(config)``: a training run from Python; the command line is a thin layer over it.

The loop itself (logging, checkpoints, signals, guard, rollback, resume) is :mod:`klrl.loop.driver`,
shared with :func:`klrl.sweep.sweep`; results are :mod:`klrl.analysis.results`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from klrl import distributed
from klrl.analysis.results import SUMMARY_KEYS, RunResult, columns, load_run, load_sweep
from klrl.config import ConfigError, RunConfig, check_devices, check_task
from klrl.io.resume import prepare as prepare_resume
from klrl.loop import reliability
from klrl.loop.driver import ROLLED_BACK, Program, drive
from klrl.registry import TASKS
from klrl.rewards.standardize import reward_norm_env
from klrl.step.evaluate import make_heldout_eval
from klrl.step.parallel import mesh_from_config
from klrl.step.train import make_train
from klrl.tasks.base import Task

__all__ = [
    "ROLLED_BACK",
    "SUMMARY_KEYS",
    "RunResult",
    "build_task",
    "columns",
    "load_run",
    "load_sweep",
    "run",
]


def build_task(cfg: RunConfig, log: Any = None) -> Task:
    """The task ``cfg.task.name`` names, from the task registry (:func:`klrl.tasks.base.register_task`)."""
    return TASKS.get(cfg.task.name)(cfg, log)


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
    (e.g. for a live plot; see :func:`klrl.loop.driver.drive`).

    SIGTERM/SIGINT finish the current iteration, checkpoint and return
    (``result.info['stopped']`` names the signal). :class:`klrl.loop.reliability.RunStopped` is raised
    when the non-finite guard skipped ``train.max_consecutive_skips`` iterations in a row
    (the state is checkpointed) or the quality rollback hit ``train.max_rollbacks``.
    Bad input raises :class:`ConfigError` or :class:`klrl.io.checkpoint.CheckpointError`.
    """
    # the whole run inside RunGuard: signals from the start (a SIGTERM during the task build or the
    # compile stops at the first iteration boundary), the run directory's lock, a full disk as one line
    with reliability.RunGuard(log) as guard:
        return _run(cfg, task, run_dir, write, log, resume, report, models, guard, on_step)


def _run(cfg, task, run_dir, write, log, resume, report, models, guard, on_step=None) -> RunResult:
    tc = cfg.train
    plan = None
    if resume is not None:
        if not write:
            raise ConfigError("resume: a resumed run writes to its run directory (write=True)")
        if distributed.is_main() and Path(resume).is_dir():
            guard.hold(resume)  # before reading it: a second writer is refused, not interleaved
        plan = prepare_resume(cfg, resume)
    if tc.rollback_metric and not write:
        raise ConfigError("train.rollback_metric: the quality rollback needs checkpoints (write=True)")
    mesh = mesh_from_config(tc)
    check_devices(cfg, mesh.shape["data"])
    task = task or build_task(cfg, log if not tc.quiet else None)
    check_task(cfg, task)  # lengths, top_k and vocabulary against the task, before anything compiles
    if cfg.reward.standardize:  # the reward reads env['reward_norm'] (klrl.rewards.standardize)
        from klrl.rewards.standardize import standardize_task, standardized

        task = standardize_task(task)
        if models.get("reward") is not None:
            models = {**models, "reward": standardized(models["reward"])}
    if cfg.model.path and "value" not in models:
        from klrl.tasks.text import value_models

        models = {**value_models(cfg, task), **models}  # a separate value trunk from model.value_path
    n_samples = tc.samples_n if write and tc.samples_every > 0 else 0
    train = make_train(cfg, task, mesh, samples=n_samples, **models)
    task = train.context.task  # (a ``reward=`` passed in is part of it)
    evaluate = make_heldout_eval(train)
    env, norm_info = reward_norm_env(train, task.env, seed=tc.seed, resume=plan,
                                     log=(log or True) if not tc.quiet else None)  # fmt: skip
    env = distributed.replicate(env, mesh) if distributed.is_multiprocess() else env
    prog = Program(
        configs=[cfg],
        stacked=False,
        init=lambda: train.init(tc.seed),
        step=train.step,
        place=train.place,  # (a frozen reference equal to the loaded one takes its arrays: one copy)
        shardings=train.state_shardings,  # a checkpoint is restored straight onto this mesh
        env=env,
        task_info={**task.info, **norm_info},
        reward_check=getattr(task.reward, "check", None),
        tokenizer=task.tokenizer,
        prompt_texts=task.prompt_texts,
        evaluate=evaluate,
        heldout_check=getattr(task.heldout.reward, "check", None) if task.heldout is not None else None,
    )
    (result,), stop_error = drive(
        prog, write=write, out_dir=run_dir, resume=plan, log=log, guard=guard, on_step=on_step
    )
    if result.dir is not None and distributed.is_main():
        if cfg.model.path and result.state is not None:  # a pretrained start ends as an HF directory
            from klrl.tasks.text import save_policy

            save_policy(task, result.state, result.dir / "policy")
        if report is not None:
            report(result)
    if stop_error is not None:
        raise reliability.RunStopped(f"stopped: {stop_error}", result)
    return result
