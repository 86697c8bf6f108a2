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
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from klrl import distributed, reliability
from klrl.config import ConfigError, RunConfig, check_devices
from klrl.io.logging import MetricsWriter, Progress, hparams_of, new_run_dir
from klrl.parallel import SWEEP, make_mesh, shard_step
from klrl.runner import SUMMARY_KEYS, RunResult, build_task, columns
from klrl.tasks.base import Task
from klrl.train import make_train, set_learning_rate

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


def make_sweep(members: list[RunConfig], task: Task, n_sweep_devices: int = 1):
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
    mesh = make_mesh(base.train.devices, n_sweep_devices)
    check_devices(base, mesh.shape["data"])
    trains = [make_train(m, task, mesh) for m in members]

    def init() -> Any:
        states = []
        for m, t in zip(members, trains, strict=True):
            s = distributed.to_host(t.init(m.train.seed))
            states.append(s._replace(opt_state=set_learning_rate(s.opt_state, m.optim.lr)))
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
        return distributed.put(stacked, NamedSharding(mesh, P(SWEEP)))

    inner = shard_step(jax.vmap(trains[0].shard_step, in_axes=(0, None)), mesh, sweep=True)
    # Pin the outputs to the sharding ``init`` gives: left to itself XLA reports some of them as
    # replicated when the sweep axis has size 1 (equivalent, but a different jit cache key: the
    # second call would compile the program again).
    split = NamedSharding(mesh, P(SWEEP))
    step = jax.jit(inner, donate_argnums=(0,), out_shardings=(split, split))
    return init, step, mesh


def sweep(
    members: list[RunConfig],
    *,
    task: Task | None = None,
    out_dir: str | Path | None = None,
    write: bool = True,
    sweep_devices: int = 1,
    log: Any = None,
) -> list[RunResult]:
    # issue-12b: the sweep directory's lock for the whole sweep, a full disk as one DiskFull line
    # (no signal handlers: this loop does not poll them)
    with reliability.RunGuard(log, signals=False) as guard:
        return _sweep(members, task=task, out_dir=out_dir, write=write, sweep_devices=sweep_devices,
                      log=log, guard=guard)  # fmt: skip


def _sweep(
    members: list[RunConfig],
    *,
    task: Task | None = None,
    out_dir: str | Path | None = None,
    write: bool = True,
    sweep_devices: int = 1,
    log: Any = None,
    guard: reliability.RunGuard,
) -> list[RunResult]:
    """Run all ``members`` in one compiled program; one :class:`RunResult` each.

    With ``write``, ``out_dir`` (default: a new run directory) gets ``member-XX/``
    sub-directories, each with its own config, ``metrics.jsonl`` and event file,
    and a ``sweep.json`` index. With several processes only process 0 writes.
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    check_members(members)
    base = members[0]
    task = task or build_task(base, None if base.train.quiet else log)
    init, step, mesh = make_sweep(members, task, sweep_devices)
    env = distributed.replicate(task.env, mesh) if distributed.is_multiprocess() else task.env
    root: Path | None = None
    writers: list[MetricsWriter] = []
    dirs: list[Path | None] = [None] * len(members)
    if write and distributed.is_main():
        root = Path(out_dir) if out_dir is not None else new_run_dir(base)
        root.mkdir(parents=True, exist_ok=True)
        guard.hold(root)  # issue-12b
        for i, m in enumerate(members):
            d = root / f"member-{i:02d}"
            d.mkdir(exist_ok=True)
            (d / "config.json").write_text(json.dumps(m.to_dict(), indent=1))
            writers.append(MetricsWriter(d, hparams=hparams_of(m)))
            dirs[i] = d
        (root / "sweep.json").write_text(json.dumps({"members": [str(d.name) for d in dirs]}, indent=1))
        (root / "task.json").write_text(json.dumps(task.info, indent=1, default=str))
    if write:
        root = distributed.agree_path(root)
        dirs = [root / f"member-{i:02d}" for i in range(len(members))]
    state = init()
    rows: list[list[dict[str, Any]]] = [[] for _ in members]
    quiet = base.train.quiet or not distributed.is_main()
    progress = Progress(base.train.iterations, base.train.log_every, quiet)
    pending = None
    t0 = time.time()

    def flush(i, m):
        m = distributed.to_host(m)
        for j in range(len(members)):
            mj = {k: float(v[j]) for k, v in m.items()}
            rows[j].append({"iteration": i, **mj})
            if writers:
                writers[j].write(i, mj)
        progress.update(
            i, {k: float(np.mean(v)) for k, v in m.items()}, extra=f"({len(members)} members, mean)"
        )

    for i in range(base.train.iterations):
        state, metrics = step(state, env)
        if pending is not None:
            flush(*pending)
        pending = (i, metrics)
    flush(*pending)
    elapsed = time.time() - t0
    results = []
    for j, m in enumerate(members):
        r = RunResult(
            m, dirs[j], columns(rows[j]), unstack(state, j), {"train_s": elapsed, "task": task.info}
        )
        if writers:  # process 0 only
            writers[j].close({k: rows[j][-1][k] for k in SUMMARY_KEYS if k in rows[j][-1]})
            (dirs[j] / "summary.json").write_text(json.dumps(r.summary(), indent=1))
        results.append(r)
    if writers:  # process 0 only: report.md with the table, diagnosis timelines and plots
        from klrl.report import maybe_write_report

        maybe_write_report(results, log)
    return results


sweep.__doc__ = _sweep.__doc__  # issue-12b


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
