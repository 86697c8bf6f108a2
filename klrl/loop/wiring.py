"""The hooks of a run, built for one :class:`~klrl.loop.hooks.Loop` (new or resumed), in the order the
driver calls them (:mod:`klrl.loop.hooks` says what each does and which files it owns):

signals, the host reward's failure, the held-out evaluation, the samples, the user's metric functions,
the non-finite guard's stop, the quality rollback, the metrics sink, the progress line, the KL sign
note, the trackers (W&B), the checkpoints, then the user's hooks. A row's metrics are complete before
the sink writes them (the held-out keys merged before the row is made; the samples decoded and the
``user/*`` keys added before the sink); the skip stop's request comes before the rollback's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from klrl.config import ConfigError
from klrl.io import checkpoint as ckpt
from klrl.io.resume import Resume
from klrl.loop import frozen, reliability
from klrl.loop.files import rollback_bases
from klrl.loop.hooks import (
    Checkpoints,
    HeldOut,
    Hook,
    KLSignNote,
    Loop,
    MetricsSink,
    ProgressLine,
    QualityRollback,
    RewardFailure,
    Signals,
    SkipStop,
)
from klrl.loop.metrics import alias_map, learning_rates
from klrl.loop.program import Program
from klrl.loop.samples import Samples
from klrl.loop.trackers import WandbTracker
from klrl.loop.user import MetricFns, as_hook

__all__ = ["check", "hooks"]


def check(prog: Program, abstract: Any) -> None:
    """What the hooks need of the program, before anything is written: each quality-rollback guard's
    metric (``train.rollback_metric``, ``train.rollback_guards``) is a metric of the step (``abstract``:
    the state's shapes; the step traced, not run)."""
    guards = prog.configs[0].train.guards()  # (with write=True: klrl.checks.preflight)
    if not guards:
        return
    names = jax.eval_shape(prog.step, abstract, prog.env)[1]
    for g in guards:
        if g.metric not in names:
            some = sorted(n for n in names if n.startswith(("eval/", "reward/", "text/")))
            raise ConfigError(
                f"train.{'rollback_guards' if g.spec else 'rollback_metric'}: {g.metric!r} is not a metric "
                f"of this run (e.g. {', '.join(some)})"
            )


def hooks(loop: Loop, resume: Resume | None, restore_to: Any, guard: reliability.RunGuard | None,
          log: Callable[[str], None], on_step: Callable[..., Any] | None, user: Sequence[Any] = (),
          metrics: Sequence[Callable[..., dict[str, float]]] = ()) -> list[Hook]:  # fmt: skip
    """The hooks of ``loop`` (see the module docstring); ``user``: the user's hook objects, ``metrics``
    their metric functions, ``on_step`` their row callback (:class:`~klrl.loop.hooks.MetricsSink`)."""
    prog, tc = loop.prog, loop.configs[0].train
    ckpts = _checkpoints(loop, resume, restore_to, log)
    rollback = _rollback(loop, resume, log, ckpts)
    ckpts.base_meta = rollback.base_meta
    ckpts.tell(loop)
    loop.t0 = time.time()
    loop.lrs = learning_rates(loop.state, len(loop.configs))  # (read before the first step donates the state)
    sink = MetricsSink.open(loop, alias_map(tc.metric_aliases), on_step)  # (before the samples: its writers)
    samples = Samples.of(loop)
    out: list[Hook] = [Signals(guard.signals if guard is not None else None, log), RewardFailure(prog),
                       HeldOut(prog), samples]  # fmt: skip
    if metrics:
        out.append(MetricFns(list(metrics), samples))
    quiet = tc.quiet or not loop.main
    out += [SkipStop(tc.max_consecutive_skips), rollback, sink,
            ProgressLine.of(tc.iterations, tc.log_every, quiet, loop.start)]  # fmt: skip
    if not quiet:
        out.append(KLSignNote(loop.configs[0].kl.estimator, log))
    if loop.configs[0].log.wandb and loop.main:  # (wandb imported there, only then)
        out.append(WandbTracker(loop, samples, sink.aliases, log))
    return [*out, ckpts, *(as_hook(h) for h in user)]


def _checkpoints(
    loop: Loop, resume: Resume | None, restore_to: Any, log: Callable[[str], None]
) -> Checkpoints:
    """The checkpoints of ``loop`` (none without a run directory), with the plan's line in the log."""
    prog, tc = loop.prog, loop.configs[0].train
    mgr = None if loop.root is None else ckpt.manager(loop.root, keep=tc.keep_checkpoints, async_save=True)
    if mgr is not None and loop.main and not tc.quiet:  # how many checkpoints, how big (the disk they take)
        log(
            ckpt.plan_line(
                frozen.without(prog, restore_to), tc.keep_checkpoints, tc.checkpoint_every, loop.root
            )
        )
    last_saved = loop.start if resume is not None else -1
    return Checkpoints(
        mgr, tc.checkpoint_every, tc.iterations, frozen.without(prog, restore_to), lambda: None, last_saved
    )


def _rollback(
    loop: Loop, resume: Resume | None, log: Callable[[str], None], ckpts: Checkpoints
) -> QualityRollback:
    """The quality rollback of ``loop`` (inert without a guard: ``train.rollback_metric``,
    ``train.rollback_guards``)."""
    prog, tc, n = loop.prog, loop.configs[0].train, len(loop.configs)
    traces: dict[str, list[list[float]]] = {}
    bases: dict[str, list[float | None]] = {}
    initial = None
    if tc.guards():
        # the state a rollback to step 0 restores (a host copy: ``init`` cannot be re-run once ``step``
        # has donated the controller's parameter arrays)
        initial = ckpt.host_copy(frozen.without(prog, loop.state if resume is None else prog.init()))
    for metric in dict.fromkeys(g.metric for g in tc.guards()):  # each guarded metric once, in order
        traces[metric] = [[float(r.get(metric, math.nan)) for r in rows] for rows in loop.rows]
        # its value at iteration 0 (the guards' reference)
        bases[metric] = [None] * n if resume is None else rollback_bases(resume.meta, metric, traces[metric])
    return QualityRollback(tc, loop.stacked, log, traces, bases, initial, ckpts)
