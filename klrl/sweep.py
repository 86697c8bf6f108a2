"""A beta study as one compiled program: ``vmap`` over stacked train states.

Members may differ in what lives in the train state: the initial beta
(``kl.beta``), the controller (``ctrl.kind`` and every numeric ``ctrl`` field),
the seed (``train.seed``) and the peak learning rate (``optim.lr``, an optax
injected hyper-parameter). Everything else fixes array shapes or the program
and must be equal across members; a difference is a :class:`ConfigError`
naming the field.

On a ``(sweep, data)`` mesh the members are split over the ``sweep`` axis and
each member's batch over the ``data`` devices of its group. The mesh may span
several processes (:mod:`klrl.distributed`); then only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl import distributed
from klrl.analysis.results import SUMMARY_KEYS, RunResult, Sweep
from klrl.api import build_task
from klrl.config import ConfigError, RunConfig, check_devices, check_task
from klrl.io.resume import prepare as prepare_resume
from klrl.loop import reliability
from klrl.loop.driver import Program, drive
from klrl.rewards.standardize import reward_norm_env, standardize_task
from klrl.step.evaluate import make_heldout_eval
from klrl.step.parallel import mesh_from_config, shard_step
from klrl.step.parts import state_shardings
from klrl.step.train import make_train, set_learning_rate
from klrl.tasks.base import Task

# fields a member may change; all else must match the first member
SWEEPABLE = {
    ("kl", "beta"),
    ("optim", "lr"),
    ("train", "seed"),
    ("train", "name"),
    *(
        ("ctrl", f.name)
        for f in dataclasses.fields(RunConfig().ctrl)
        if f.name not in ("unit", "estimator", "drives")
    ),
}


def grid(base: RunConfig, axes: dict[str, list[Any]]) -> list[RunConfig]:
    """The Cartesian product of ``{'section.field': [values]}`` applied to ``base``."""
    names = list(axes)
    out = []
    for values in itertools.product(*(axes[n] for n in names)):
        upd: dict[str, dict[str, Any]] = {}
        for n, v in zip(names, values, strict=True):
            section, field = n.split(".", 1)
            upd.setdefault(section, {})[field] = v
        out.append(base.replace(**upd))
    return out


def parse_axis(spec: str, base: RunConfig) -> tuple[str, list[Any]]:
    """``'kl.beta=0.01,0.1'`` -> ``('kl.beta', [0.01, 0.1])``, values typed like the field."""
    if "=" not in spec:
        raise ConfigError(f"--sweep: expected section.field=v1,v2,... (got {spec!r})")
    name, raw = spec.split("=", 1)
    if "." not in name or not hasattr(base, name.split(".")[0]):
        raise ConfigError(f"--sweep: unknown field {name!r}")
    section, field = name.split(".", 1)
    sub = getattr(base, section)
    if not hasattr(sub, field):
        raise ConfigError(f"--sweep: unknown field {name!r}")
    kind = type(getattr(sub, field))

    def typed(v: str) -> Any:
        v = v.strip()
        if kind is bool:
            if v.lower() not in ("1", "true", "0", "false"):
                raise ValueError(f"not a boolean: {v!r}")
            return v.lower() in ("1", "true")
        return kind(v)

    try:
        return name, [typed(v) for v in raw.split(",")]
    except ValueError as e:
        raise ConfigError(f"--sweep {name}: {e}") from e


def check_members(members: list[RunConfig]) -> None:
    if not members:
        raise ConfigError("sweep: no members")
    first = members[0].to_dict()
    for m in members[1:]:
        d = m.to_dict()
        for section, fields in d.items():
            for k, v in fields.items():
                if v != first[section][k] and (section, k) not in SWEEPABLE:
                    raise ConfigError(
                        f"{section}.{k}: cannot differ between sweep members (it fixes the program)"
                    )


def stack(states: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def unstack(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


def make_sweep(members: list[RunConfig], task: Task, n_sweep_devices: int = 1, samples: int = 0):
    """``(init, step, mesh)`` for the stacked members.

    ``init()`` returns the stacked state already split over the ``sweep`` axis, as ``step``
    returns it (so the second call does not compile again); ``step(state, env)`` takes the
    task's ``env`` replicated (see :func:`klrl.distributed.replicate` for several processes).
    """
    check_members(members)
    base = members[0]
    n = len(members)
    if n % n_sweep_devices:
        raise ConfigError(f"sweep: {n} members do not split over {n_sweep_devices} sweep device groups")
    mesh = mesh_from_config(base.train, n_sweep_devices)
    check_devices(base, mesh.shape["data"])
    adaptive = any(m.ctrl.kind != "fixed" for m in members)  # ctrl/target: NaN for fixed members
    trains = [make_train(m, task, mesh, log_target=adaptive, samples=samples) for m in members]
    # members' leading axis over 'sweep'; each member's parameters over its group's fsdp/tensor
    split = state_shardings(trains[0].context, mesh, sweep=True)

    def init() -> Any:
        states = []
        for m, t in zip(members, trains, strict=True):
            s = distributed.to_host(t.init(m.train.seed))
            states.append(s._replace(opt_state=set_learning_rate(s.opt_state, m.optim.lr)))
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
        return distributed.put(stacked, split)

    # The outputs are pinned to the sharding ``init`` gives: left to itself XLA reports some of them
    # as replicated when the sweep axis has size 1 (equivalent, but a different jit cache key: the
    # second call would compile the program again).
    inner = jax.vmap(trains[0].shard_step, in_axes=(0, None))
    step = shard_step(inner, mesh, sweep=True, state_shardings=split)
    return init, step, mesh


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
    ``report(results)`` is called at the end of a written sweep. With several processes only
    process 0 writes. ``on_step(iteration, metrics)`` gets each iteration's ``{name: array over
    members}`` as it is recorded (e.g. for a live plot). The result is a list with
    ``.to_frame()`` (:func:`klrl.analysis.results.to_frame`).
    """
    check_members(members)
    # as klrl.run: signals from the start, the sweep directory's lock, a full disk as one line
    with reliability.RunGuard(log) as guard:
        return _sweep(members, task, out_dir, write, sweep_devices, log, resume, report, guard, on_step)


def _sweep(members, task, out_dir, write, sweep_devices, log, resume, report, guard, on_step=None) -> Sweep:
    base = members[0]
    plan = None
    if resume is not None:
        if not write:
            raise ConfigError("resume: a resumed sweep writes to its sweep directory (write=True)")
        if distributed.is_main() and Path(resume).is_dir():
            guard.hold(resume)  # before reading it: a second writer is refused, not interleaved
        plan = prepare_resume(members, resume)
    task = task or build_task(base, None if base.train.quiet else log)
    for m in members:
        check_task(m, task)  # lengths, top_k and vocabulary against the task, before anything compiles
    if base.reward.standardize:  # the reward reads env['reward_norm'] (klrl.rewards.standardize)
        task = standardize_task(task)
    n_samples = base.train.samples_n if write and base.train.samples_every > 0 else 0
    init, step, mesh = make_sweep(members, task, sweep_devices, samples=n_samples)
    evaluate = make_heldout_eval(make_train(base, task, mesh), stacked=True)
    base_train = make_train(base, task, mesh)
    # one gain and bias for every member (the env is shared): from the first member's seed
    env, norm_info = reward_norm_env(base_train, task.env, seed=base.train.seed, resume=plan,
                                     log=None if base.train.quiet else (log or True))  # fmt: skip
    env = distributed.replicate(env, mesh) if distributed.is_multiprocess() else env
    split = state_shardings(base_train.context, mesh, sweep=True)
    one = jax.eval_shape(lambda: base_train.init(base.train.seed))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct((len(members), *x.shape), x.dtype), one)
    prog = Program(
        configs=list(members),
        stacked=True,
        init=init,
        step=step,
        place=lambda s: distributed.put(jax.tree.map(np.asarray, s), split),
        env=env,
        task_info={**task.info, **norm_info},
        abstract=abstract,
        reward_check=getattr(task.reward, "check", None),
        tokenizer=task.tokenizer,
        prompt_texts=task.prompt_texts,
        evaluate=evaluate,
        heldout_check=getattr(task.heldout.reward, "check", None) if task.heldout is not None else None,
    )
    results, stop_error = drive(
        prog, write=write, out_dir=out_dir, resume=plan, log=log, guard=guard, on_step=on_step
    )
    results = Sweep(results)
    if results[0].dir is not None and distributed.is_main() and report is not None:
        report(results)
    if stop_error is not None:
        raise reliability.RunStopped(f"stopped: {stop_error}", results)
    return results


def summary_table(results: list[RunResult], axes: list[str] | None = None) -> str:
    """One markdown table: a row per member, start -> end of the summary metrics."""
    axes = axes or []
    keys = [k for k in SUMMARY_KEYS if results and k in results[0].metrics]
    head = ["member", *axes, *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results):
        s = r.summary()
        vals = [str(_get(r.config, a)) for a in axes]
        vals += [f"{s[k]['start']:.3g} -> {s[k]['end']:.3g}" for k in keys]
        lines.append("| " + " | ".join([f"{i:02d}", *vals]) + " |")
    return "\n".join(lines)


def _get(cfg: RunConfig, dotted: str) -> Any:
    section, field = dotted.split(".", 1)
    return getattr(getattr(cfg, section), field)
