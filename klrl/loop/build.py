"""The one room that builds the program: :func:`make_program` turns the members' configs, a task and a
mesh into the :class:`~klrl.loop.program.Program` that :func:`klrl.loop.driver.drive` drives, for a run
(one member, unstacked) and a sweep (``vmap`` over the members' stacked train states) alike.

It builds the task (:func:`build_task`, from the task registry), standardises its reward
(:mod:`klrl.rewards.standardize`), attaches a pretrained run's value model, calls
:func:`klrl.step.train.make_train` once, and stacks, vmaps and shards the members' states
(:func:`member_state`). :func:`klrl.run` and :func:`klrl.sweep` (:mod:`klrl.api`) check, call it and drive.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl import distributed
from klrl.algo.control import from_config
from klrl.config import ConfigError, RunConfig
from klrl.loop.compile import elapsed, enable_cache, phase_log
from klrl.loop.program import Program
from klrl.models import peft
from klrl.models.hf import CheckpointFormatError
from klrl.registry import TASKS, is_adaptive
from klrl.rewards.standardize import reward_norm_env, standardize_task, standardized
from klrl.step.context import as_ref_dtype, init_state, state_shardings
from klrl.step.evaluate import make_heldout_eval
from klrl.step.optim import set_learning_rate
from klrl.step.parallel import mesh_from_config, shard_step
from klrl.step.stages import Train, TrainState
from klrl.step.train import make_train
from klrl.tasks.base import Task
from klrl.tasks.pretrain import cache_root
from klrl.tasks.text import value_models

__all__ = ["adopt_adapter", "build_task", "make_program", "member_state"]


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


def make_program(
    members: list[RunConfig],
    task: Task | None = None,
    mesh: Any = None,
    *,
    stacked: bool,
    write: bool = True,
    resume: Any = None,
    log: Any = None,
    check: Callable[..., None] | None = None,
    sweep_devices: int = 1,
    **models: Any,
) -> tuple[Program, Task]:
    """The :class:`~klrl.loop.program.Program` of ``members`` (one, unstacked: a run; ``stacked``: a
    sweep) on ``task`` (default: the one the first member names) and ``mesh`` (default: the first
    member's ``train.mesh`` split over ``sweep_devices`` device groups), and the task it trains on
    (standardized, with a ``reward=`` of ``models``).

    ``make_train`` is called once: members differ only in what lives in the train state, so each
    member's initial state comes from its config (:func:`member_state`) and one step serves them all
    (``vmap`` over the stacked states). ``check(members, task, n_data, policy=, reward=)`` checks the
    task and the models against the policy before the compile (:func:`klrl.checks.check_program`, which
    :mod:`klrl.api` passes; None: unchecked). ``resume`` (a :class:`klrl.io.resume.Resume`) keeps the
    reward normalisation of the run resumed; ``write`` turns the step's sample rows on
    (``train.samples_every``). The task's ``info["notes"]`` (lines, e.g. the text task's count of
    prompts cut to the budget) are logged once every check has passed, the adapters' and LoRA
    targets' in ``make_train`` included, so an error is the first line (not with ``train.quiet``)."""
    members = [adopt_adapter(m) for m in members]
    base, tc = members[0], members[0].train
    mesh = mesh if mesh is not None else mesh_from_config(tc, sweep_devices)
    say = log or partial(print, file=sys.stderr, flush=True)
    enable_cache(cache_root(base.task.cache_dir))  # (klrl.loop.compile: before anything compiles)
    phase = phase_log(tc.quiet) if distributed.is_main() else None
    t0 = time.time()
    if phase is not None and task is None:
        phase(
            f"building the task {base.task.name}"
            + (f" on {base.model.path}" if base.model.path else "")
            + " (model load, reference) ..."
        )
    task, models = _task_and_models(members, task, stacked, None if tc.quiet else (log or phase), models)
    if phase is not None:
        phase(f"task ready in {elapsed(t0)}")
    if check is not None:
        check(members, task, mesh.shape["data"], policy=models.get("policy"), reward=models.get("reward"))
    n_samples = tc.samples_n if write and tc.samples_every > 0 else 0
    adaptive = any(is_adaptive(m.ctrl.kind) for m in members)  # ctrl/target: NaN for fixed members
    # a sweep's members share one base: no merged copy of it per member in the rollout
    train = make_train(
        base, task, mesh, log_target=adaptive, samples=n_samples, fold_rollout=not stacked, **models
    )
    if base.model.adapter and not tc.quiet and distributed.is_main():  # the initial policy's adapters
        say(peft.adapter_line(base.model.adapter))
    task = train.context.task  # (a ``reward=`` passed in is part of it)
    # one gain and bias for every member (the env is shared): from the first member's seed
    env, norm_info = reward_norm_env(
        train, task.env, seed=tc.seed, resume=resume, log=None if tc.quiet else (log or True)
    )
    env = distributed.replicate(env, mesh) if distributed.is_multiprocess() else env
    states = _stacked(train, members) if stacked else _single(train, base)
    if not tc.quiet and distributed.is_main():  # the task's notes (e.g. prompts cut), once every check
        for line in task.info.get("notes", ()):  # passed (the adapters' and LoRA targets' in make_train)
            say(line)
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


def _task_and_models(
    members: list[RunConfig], task: Task | None, stacked: bool, log: Any, models: dict[str, Any]
) -> tuple[Task, dict[str, Any]]:
    """The task (built if not given; ``log``: its build's log) and the models ``make_train`` gets: the
    reward standardised with ``reward.standardize`` and a pretrained run's value model attached."""
    base = members[0]
    task = task or build_task(base, log)
    if base.reward.standardize:  # the reward reads env['reward_norm'] (klrl.rewards.standardize)
        task = standardize_task(task)
        if models.get("reward") is not None:
            models = {**models, "reward": standardized(models["reward"])}
    if base.model.path and "value" not in models and not stacked:
        # a separate value trunk from model.value_path, its head drawn from train.seed (a sweep's members
        # draw a fresh value model each, from their seeds)
        models = {**value_models(base, task), **models}
    return task, models


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
