"""``klrl.run(config)`` and ``klrl.sweep(members)``: training from Python; the command line is a thin
layer over them.

A run is a sweep of one member. Both are checked at their entry (:mod:`klrl.checks`: the
configuration, then the task and the models against the policy, then the devices), built by one
:func:`build_program` (one :func:`klrl.step.train.make_train` per program) and driven by the one loop
(:func:`klrl.loop.driver.drive`: logging, checkpoints, signals, guard, rollback, resume); results are
:mod:`klrl.analysis.results`.

A sweep is one compiled program: ``vmap`` over stacked train states. Its members may differ only in
what lives in the train state (:data:`klrl.config.sweep.SWEEPABLE`: ``kl.beta``, the controller,
``train.seed``, ``optim.lr``); on a ``(sweep, data)`` mesh the members are split over the ``sweep``
axis and each member's batch over the ``data`` devices of its group. The mesh may span several
processes (:mod:`klrl.distributed`); then only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl import distributed
from klrl.algo.control import from_config
from klrl.analysis.results import SUMMARY_KEYS, RunResult, Sweep, columns, load_run, load_sweep
from klrl.checks import check_program, preflight
from klrl.config import ConfigError, RunConfig
from klrl.io.resume import prepare as prepare_resume
from klrl.loop import reliability
from klrl.loop.driver import ROLLED_BACK, drive
from klrl.loop.program import Program
from klrl.models import peft
from klrl.models.hf import CheckpointFormatError
from klrl.registry import TASKS, is_adaptive
from klrl.rewards.standardize import reward_norm_env, standardize_task, standardized
from klrl.step.evaluate import make_heldout_eval
from klrl.step.parallel import mesh_from_config, shard_step
from klrl.step.parts import Train, TrainState, as_ref_dtype, init_state, set_learning_rate, state_shardings
from klrl.step.train import make_train
from klrl.tasks.base import Task
from klrl.tasks.text import save_policy, value_models

__all__ = [
    "ROLLED_BACK",
    "SUMMARY_KEYS",
    "RunResult",
    "build_program",
    "build_task",
    "columns",
    "load_run",
    "load_sweep",
    "member_state",
    "run",
    "sweep",
]


def adopt_adapter(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``lora.rank`` and ``lora.alpha`` of its ``model.adapter`` (a PEFT directory: the initial
    policy's adapters keep their own rank and scale); ``cfg`` itself without one. A missing or unreadable
    adapter config is a :class:`ConfigError` naming the file."""
    if not cfg.model.adapter:
        return cfg
    path = Path(cfg.model.adapter)
    try:
        r, alpha = peft.adapter_options(path)
    except CheckpointFormatError as e:
        raise ConfigError(f"model.adapter: {e}") from None
    return cfg.replace(lora={"rank": r, "alpha": alpha})


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
    hooks: Sequence[Any] = (),
    checked: bool = False,
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
    checked again.

    SIGTERM/SIGINT finish the current iteration, checkpoint and return
    (``result.info['stopped']`` names the signal). :class:`klrl.loop.reliability.RunStopped` is raised
    when the non-finite guard skipped ``train.max_consecutive_skips`` iterations in a row
    (the state is checkpointed) or the quality rollback hit ``train.max_rollbacks``.
    Bad input raises :class:`ConfigError` or :class:`klrl.io.checkpoint.CheckpointError`.
    """
    # the whole run inside RunGuard: signals from the start (a SIGTERM during the task build or the
    # compile stops at the first iteration boundary), the run directory's lock, a full disk as one line
    with reliability.RunGuard(log) as guard:
        (result,), stop_error, task = _train(
            [cfg], False, task, run_dir, write, log, resume, guard, on_step, 1, models, hooks, checked
        )
        if result.dir is not None and distributed.is_main():
            if cfg.model.path and result.state is not None:  # a pretrained start ends as an HF directory
                save_policy(task, result.state, result.dir / "policy", adopt_adapter(cfg))
            if report is not None:
                report(result)
        if stop_error is not None:
            raise reliability.RunStopped(f"stopped: {stop_error}", result)
        return result


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
    :func:`run`'s (``row.members[j]``: member ``j``'s row); ``checked``: as :func:`run`'s (mode ``"sweep"``).
    """
    # as klrl.run: signals from the start, the sweep directory's lock, a full disk as one line
    with reliability.RunGuard(log) as guard:
        results, stop_error, task = _train(
            list(members),
            True,
            task,
            out_dir,
            write,
            log,
            resume,
            guard,
            on_step,
            sweep_devices,
            {},
            hooks,
            checked,
        )
        results = Sweep(results)
        if results[0].dir is not None and distributed.is_main():
            for r in results:  # as a run's: each member's final policy (pretrained model.path)
                if r.config.model.path and r.state is not None and r.dir is not None:
                    save_policy(task, r.state, r.dir / "policy", adopt_adapter(r.config))
            if report is not None:
                report(results)
        if stop_error is not None:
            raise reliability.RunStopped(f"stopped: {stop_error}", results)
        return results


def _train(members, stacked, task, out_dir, write, log, resume, guard, on_step, sweep_devices, models,
           hooks=(), checked=False):  # fmt: skip
    """Check, build and drive the program of ``members``: ``(results, stop_error, task)``. The checks before
    anything is built are :func:`klrl.checks.preflight` (a Hub name in a ``model.*`` path is read from the
    local Hugging Face cache there), unless ``checked``: the caller ran it on these members (the command
    line does, before it joins a distributed run)."""
    if not checked:
        members = preflight(members, "sweep" if stacked else "run", write=write, resume=resume,
                            sweep_devices=sweep_devices, task_given=task is not None)  # fmt: skip
    plan = None
    if resume is not None:
        if distributed.is_main() and Path(resume).is_dir():
            guard.hold(resume)  # before reading it: a second writer is refused, not interleaved
        plan = prepare_resume(members if stacked else members[0], resume)
    prog, task = build_program(
        members,
        task,
        stacked=stacked,
        write=write,
        resume=plan,
        log=log,
        sweep_devices=sweep_devices,
        **models,
    )
    results, stop_error = drive(
        prog, write=write, out_dir=out_dir, resume=plan, log=log, guard=guard, on_step=on_step, hooks=hooks
    )
    return results, stop_error, task


# ---- the program ---------------------------------------------------------------------------------------
def build_program(
    members: list[RunConfig],
    task: Task | None = None,
    *,
    stacked: bool,
    write: bool = True,
    resume: Any = None,
    log: Any = None,
    sweep_devices: int = 1,
    **models: Any,
) -> tuple[Program, Task]:
    """The :class:`~klrl.loop.program.Program` of ``members`` (one, unstacked: a run; ``stacked``: a
    sweep, split over ``sweep_devices`` device groups) on ``task`` (default: the one the first member
    names), and the task it trains on (standardized, with a ``reward=`` of ``models``).

    ``make_train`` is called once: members differ only in what lives in the train state, so each
    member's initial state comes from its config (:func:`member_state`) and one step serves them all
    (``vmap`` over the stacked states). The task and the models are checked against the policy first
    (:func:`klrl.checks.check_program`). ``resume`` (a :class:`klrl.io.resume.Resume`) keeps the
    reward normalisation of the run resumed; ``write`` turns the step's sample rows on
    (``train.samples_every``). The task's ``info["notes"]`` (lines, e.g. the text task's count of
    prompts cut to the budget) are logged once every check has passed, the adapters' and LoRA
    targets' in ``make_train`` included, so an error is the first line (not with ``train.quiet``)."""
    members = [adopt_adapter(m) for m in members]
    base, tc = members[0], members[0].train
    mesh = mesh_from_config(tc, sweep_devices)
    task = task or build_task(base, None if tc.quiet else log)
    if base.reward.standardize:  # the reward reads env['reward_norm'] (klrl.rewards.standardize)
        task = standardize_task(task)
        if models.get("reward") is not None:
            models = {**models, "reward": standardized(models["reward"])}
    if base.model.path and "value" not in models and not stacked:
        # a separate value trunk from model.value_path, its head drawn from train.seed (a sweep's members
        # draw a fresh value model each, from their seeds)
        models = {**value_models(base, task), **models}
    check_program(members, task, mesh.shape["data"], policy=models.get("policy"), reward=models.get("reward"))
    n_samples = tc.samples_n if write and tc.samples_every > 0 else 0
    adaptive = any(is_adaptive(m.ctrl.kind) for m in members)  # ctrl/target: NaN for fixed members
    train = make_train(base, task, mesh, log_target=adaptive, samples=n_samples, **models)
    if base.model.adapter and not tc.quiet and distributed.is_main():  # the initial policy's adapters
        (log or partial(print, file=sys.stderr, flush=True))(peft.adapter_line(base.model.adapter))
    task = train.context.task  # (a ``reward=`` passed in is part of it)
    # one gain and bias for every member (the env is shared): from the first member's seed
    env, norm_info = reward_norm_env(train, task.env, seed=tc.seed, resume=resume,
                                     log=None if tc.quiet else (log or True))  # fmt: skip
    env = distributed.replicate(env, mesh) if distributed.is_multiprocess() else env
    states = _stacked(train, members) if stacked else _single(train, base)
    if not tc.quiet and distributed.is_main():  # the task's notes (e.g. prompts cut), once every check
        for line in task.info.get("notes", ()):  # passed (the adapters' and LoRA targets' in make_train)
            (log or partial(print, file=sys.stderr, flush=True))(line)
    prog = Program(
        configs=list(members),
        stacked=stacked,
        env=env,
        task_info={**task.info, **norm_info},
        reward_check=getattr(task.reward, "check", None),
        tokenizer=task.tokenizer,
        prompt_texts=task.prompt_texts,
        evaluate=make_heldout_eval(train, stacked=stacked),
        heldout_check=getattr(task.heldout.reward, "check", None) if task.heldout is not None else None,
        **states,
    )
    return prog, task


def _single(train: Train, cfg: RunConfig) -> dict[str, Any]:
    """A run's state as ``train`` makes it: a frozen reference kept as the task's arrays (one copy,
    also after a restore: ``train.place``), restored straight onto the run's mesh."""
    ctx = train.context
    return dict(
        init=lambda: train.init(cfg.train.seed),
        step=train.step,
        place=train.place,
        shardings=train.state_shardings,
        frozen_ref=(lambda: placed_reference(ctx, train.state_shardings.ref_params))
        if ctx.ref_frozen
        else None,
    )


def _stacked(train: Train, members: list[RunConfig]) -> dict[str, Any]:
    """A sweep's state: the members' states stacked on a leading axis split over ``'sweep'`` (each
    member's parameters over its group's fsdp/tensor), one ``vmap`` of ``train``'s step over them."""
    mesh = train.mesh
    split = state_shardings(train.context, mesh, sweep=True)

    shared = train.context.ref_frozen  # one frozen reference (the LoRA base) for every member

    def init() -> Any:
        # host values stacked, then split: ``init`` gives the state as ``step`` returns it (so the second
        # call does not compile again); a shared reference is the task's own arrays, placed once
        states = [member_state(train, m) for m in members]
        ref = states[0].ref_params
        rest = [distributed.to_host(s._replace(ref_params=None) if shared else s) for s in states]
        del states
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *rest)
        if not shared:
            return distributed.put(stacked, split)
        placed = distributed.put(stacked, split._replace(ref_params=None))
        return placed._replace(ref_params=jax.device_put(ref, split.ref_params))

    # The outputs are pinned to the sharding ``init`` gives: left to itself XLA reports some of them
    # as replicated when the sweep axis has size 1 (equivalent, but a different jit cache key: the
    # second call would compile the program again).
    inner = shared_ref_vmap(train.shard_step) if shared else jax.vmap(train.shard_step, in_axes=(0, None))
    one = jax.eval_shape(lambda: train.init(members[0].train.seed))
    n = len(members)
    stack = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), t)
    abstract = stack(one._replace(ref_params=None))
    step = shard_step(inner, mesh, sweep=True, state_shardings=split, kept="ref_params" if shared else None,
                      kept_shared=shared)  # fmt: skip
    return dict(
        init=init,
        step=step,
        place=lambda s: distributed.put(jax.tree.map(np.asarray, s), split),
        abstract=abstract._replace(ref_params=one.ref_params if shared else stack(one.ref_params)),
        frozen_ref=(lambda: placed_reference(train.context, split.ref_params)) if shared else None,
    )


def placed_reference(ctx: Any, sharding: Any) -> Any:
    """The frozen reference as the state holds it (the task's arrays; quantised with model.ref_quant)."""
    ref = ctx.ref_init if ctx.ref_init is not None else as_ref_dtype(ctx, ctx.policy_params)
    return jax.device_put(ref, sharding)


def shared_ref_vmap(fn: Any) -> Any:
    """``vmap`` of ``fn(state, env) -> (state, out)`` over the members' axis of every state field but
    ``ref_params``, which is one copy for all members and returned as given."""

    def member(rest: Any, ref: Any, env: Any) -> Any:
        new, out = fn(rest._replace(ref_params=ref), env)
        return new._replace(ref_params=None), out

    mapped = jax.vmap(member, in_axes=(0, None, None))

    def call(state: Any, env: Any) -> Any:
        new, out = mapped(state._replace(ref_params=None), state.ref_params, env)
        return new._replace(ref_params=state.ref_params), out

    return call


def member_state(train: Train, cfg: RunConfig) -> TrainState:
    """The initial state of the sweep member ``cfg`` from the sweep's one ``train`` (built for the first
    member): its seed, its ``kl.beta``, its controller (``ctrl.*``) and its peak learning rate
    (``optim.lr``, the optimiser's injected hyper-parameter), on ``train``'s mesh. The same arrays as
    ``make_train(cfg, ...).init(cfg.train.seed)`` with the learning rate set: everything else a member's
    ``make_train`` would fix is equal across members (:func:`klrl.config.sweep.check_members`)."""
    ctx = dataclasses.replace(train.context, cfg=cfg, controller=from_config(cfg.ctrl))
    s = init_state(ctx, train.mesh, cfg.train.seed)
    return s._replace(opt_state=set_learning_rate(s.opt_state, cfg.optim.lr))
