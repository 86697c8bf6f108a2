"""What :func:`klrl.loop.driver.drive` does around each step, as hooks over one :class:`Loop`, in the manner
of Levanter's ``Trainer.add_hook(fn, every=N)``.

The driver steps the program and records each step's row (one step late, see :mod:`klrl.loop.driver`);
everything else is a hook, and the driver calls every hook the same way, in the order of the list
(:func:`klrl.loop.wiring.hooks`: the built-in ones, the trackers, then the user's):

* ``before_step(loop)``: before a step (the state is the state after ``loop.i`` updates);
* ``on_metrics(loop, it, metrics)``: a step's host metrics, before its row is made (a hook may add keys);
* ``on_row(loop, row)``: a row was recorded, on the rows whose iteration is a multiple of ``every``;
* ``sync_due(i)`` / ``on_sync(loop, step)``: whether the state after ``i`` updates is wanted at once (its
  metrics fetched without waiting for the next step), then that state, all its rows recorded;
* ``on_note(loop, note)``: a :class:`Note` another hook asked for (a line for an event file);
* ``truncate(loop, step)``: the run rolls back to ``step``: drop what was written after it;
* ``on_stop(loop)``: the loop ended (on every way out).

A hook that needs something of the loop returns a request instead of doing it: a :class:`Note`, a
:class:`Stop` (the run ends, its state saved first or not) or a :class:`Restore` (the run rolls back
to a checkpoint: the driver asks every hook to ``truncate`` to that step). The driver acts on the first
request of a row (or before a step); what it does is the same whichever hook asked.

Every file of a run directory (a single run's, or a sweep member's) has one owner, the only code that
writes it (``tests/loop/test_driver_hooks.py`` runs a tiny run and checks each file it writes against this
table; ``*`` is any name):

=============================  =========================================================================
file                           owner
=============================  =========================================================================
``config.json``                :func:`klrl.loop.files.create_dirs` (a resume rewrites it,
                               :func:`klrl.loop.files.cut_to_checkpoint`)
``task.json``                  :func:`klrl.loop.files.create_dirs`
``sweep.json``                 :func:`klrl.loop.files.create_dirs` (a sweep's directory)
``metrics.jsonl``              :class:`MetricsSink` (its writers, :class:`klrl.io.logging.MetricsWriter`,
                               opened by :meth:`MetricsSink.open`, closed by its ``on_stop``)
``metrics.rolled_back.jsonl``  :class:`MetricsSink` (its ``truncate``)
``timing.jsonl``               :class:`MetricsSink`
``events.jsonl``               :class:`MetricsSink` (the :class:`Note` s of the other hooks)
``tb/*``                       :class:`MetricsSink` (TensorBoard: scalars, notes, the samples' text)
``samples.jsonl``              :class:`~klrl.loop.samples.Samples`
``samples.rolled_back.jsonl``  :class:`~klrl.loop.samples.Samples` (its ``truncate``)
``checkpoints/*``              :class:`Checkpoints` (a sweep's directory)
``summary.json``               :func:`klrl.loop.files.results`
``xla.log``                    :func:`klrl.loop.compile.xla_banners` (the first step's compile)
``wandb_id``, ``wandb/*``      :class:`klrl.loop.trackers.WandbTracker` (``log.wandb``)
``policy/*``                   :func:`klrl.tasks.text.save_policy` (:func:`klrl.api.run`, after the loop)
``report.md``, ``report-*``    :func:`klrl.analysis.report.write_report` (after the loop)
``.klrl.lock``                 :class:`klrl.io.lock.RunLock` (:class:`klrl.loop.reliability.RunGuard`'s)
=============================  =========================================================================

The sink opens its writers itself (:meth:`MetricsSink.open`, when the hooks are made; a resume's files
were cut back to its checkpoint before, :func:`klrl.loop.files.cut_to_checkpoint`, whose messages are the
loop's opening notes) and closes them in its ``on_stop`` with the HParams dashboard's final values; in
between only the sink writes them.

The hooks:

* :class:`Checkpoints`: the whole, stacked, state every ``train.checkpoint_every`` iterations and at
  the end (``sync_due``/``on_sync``), each with its metadata (the config, the rows so far, the rollback
  reference); ``loop.saved`` says where the last one is;
* :class:`MetricsSink`: each member's row (every key, and ``train.metric_aliases``' names in the event
  file only), the iteration's wall time (:func:`klrl.loop.metrics.timings`, between two steps' outputs
  becoming ready, :class:`ReadyTimes`), the notes, and the ``on_step`` callback;
* :class:`~klrl.loop.samples.Samples`: the step's ``_samples/*`` rows, decoded (their TensorBoard text
  a :class:`Note` to the sink);
* :class:`ProgressLine`: the tqdm bar or the plain progress lines on stdout, showing
  :attr:`ProgressLine.KEYS` (a sweep's: member means and beta's range, :func:`sweep_progress`);
* :class:`KLSignNote`: one note in the log when the penalised KL estimate's batch mean
  (``kl/reward_<est>_seq_sum``) is negative and the exact KL (``kl/exact_seq_sum``) positive;
* :class:`SkipStop`: a :class:`Stop` after ``train.max_consecutive_skips`` non-finite skips in a row;
* :class:`QualityRollback`: the traces of the guarded metrics (``train.rollback_metric``,
  ``train.rollback_guards``), their references at iteration 0 and, when one crosses its guard
  (``train.rollback_threshold``, a guard's ratio), a :class:`Restore` to the newest good checkpoint with beta
  raised (a :class:`Stop` after ``train.max_rollbacks``; :mod:`klrl.loop.reliability` decides,
  :mod:`klrl.loop.stops` words it);
* :class:`HeldOut`: the held-out evaluation of the state before a step, its ``eval/heldout/*`` keys
  (:mod:`klrl.step.evaluate`) merged into that row; a :class:`Stop` when its host reward failed;
* :class:`RewardFailure`: a host reward function that failed on a row the guard rejected: a
  :class:`Stop` with the last good state saved, the row not recorded;
* :class:`Signals`: SIGTERM/SIGINT (:class:`klrl.loop.reliability.StopSignals`): a :class:`Stop` with
  the state saved, before the next step.

Beside them: :class:`klrl.loop.trackers.WandbTracker` (``log.wandb``), :class:`klrl.loop.user.MetricFns`
(``train.metric_fns``: the ``user/*`` keys) and the user's hooks (``klrl.hook(fn, every=N)``,
``train.hooks``: :mod:`klrl.loop.user`). :func:`due` is the cadence the samples and the held-out
evaluation share. :class:`Loop` is the state they share; :class:`Row` is one recorded row as they see it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl import distributed
from klrl.config import RunConfig
from klrl.io import checkpoint as ckpt
from klrl.io.logging import MetricsWriter, Progress, hparams_of
from klrl.io.results import columns, varying_fields
from klrl.loop import fault, frozen, reliability
from klrl.loop.files import move_rolled_back
from klrl.loop.metrics import final_metrics, latest, timings, with_aliases
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
from klrl.rewards.host import RewardFunctionError


@dataclass
class Loop:
    """Where the loop stands: what the driver and the hooks share, in plain fields (a hook's own
    bookkeeping, e.g. the checkpoints' last step or the rollback's traces, stays in the hook)."""

    prog: Program
    root: Path | None  # the run's (or sweep's) directory; None: nothing written
    dirs: list[Path | None]  # one per member (None: nothing written)
    writers: list[MetricsWriter]  # one per member on process 0 when writing; [] otherwise
    state: Any  # the train state the next step takes
    rows: list[list[dict[str, Any]]]  # every member's recorded rows (aliases left out)
    start: int  # iterations done before this process started (a resume's)
    rollbacks: int = 0
    main: bool = True  # process 0 (klrl.distributed): the only one that writes files
    lrs: Any = None  # the learning rates per member (klrl.loop.metrics.learning_rates)
    i: int = -1  # iterations stepped (default: ``start``)
    # the newest step's (iteration, metrics, when its outputs were ready: ReadyTimes.watch), not yet fetched
    pending: tuple[int, Any, Callable[[], float]] | None = None
    stop: Stop | None = None  # what ended the run early (the driver sets it; None: ran to the end or going)
    stop_line: str | None = None  # the stop's line (worded once the state was saved)
    saved: str = "none yet"  # where the last good state is, for the stop lines (Checkpoints keeps it)
    checkpoint: int | None = None  # the newest checkpoint's step (None: none)
    t0: float = field(default_factory=time.time)
    opening: list[Note] = field(default_factory=list)  # the event files' first lines (a resume's)

    def __post_init__(self) -> None:
        if self.i < 0:
            self.i = self.start

    @property
    def configs(self) -> list[RunConfig]:
        return self.prog.configs

    @property
    def stacked(self) -> bool:
        return self.prog.stacked

    @property
    def iterations(self) -> int:
        return self.prog.configs[0].train.iterations

    @property
    def recorded(self) -> int:
        """Rows recorded (the first member's; every member has as many)."""
        return len(self.rows[0])

    @property
    def stopped(self) -> str | None:
        """The signal that stopped the run."""
        return self.stop.signal if self.stop is not None else None

    @property
    def stop_error(self) -> str | None:
        """Why the run stopped itself (a guard, the rollback limit): raised as
        :class:`klrl.loop.reliability.RunStopped`."""
        return self.stop_line if self.stop is not None and self.stop.raises is None else None

    @property
    def reward_stop(self) -> str | None:
        """Why a stop that raises (a failed host reward function) ended the run."""
        return self.stop_line if self.stop is not None and self.stop.raises is not None else None


@dataclass(frozen=True)
class Note:
    """A line for member ``member``'s event file at iteration ``it``: ``events.jsonl`` (``kind``, ``text``)
    or, with ``tag``, TensorBoard's text under that tag. The sink writes it (its files' one owner)."""

    member: int
    it: int
    kind: str
    text: str
    tag: str | None = None


@dataclass(frozen=True)
class Stop:
    """End the loop after the rows recorded (the pending step's row dropped; ``rewind=False``: the
    iteration count left as stepped). ``state(old)``: the state to keep instead of ``loop.state``
    (e.g. the last good parameters restamped); ``save``: checkpointed first, as the state after the rows
    recorded; ``line``: the stop's line, or ``line(loop)`` worded after the save (``loop.saved``);
    ``signal``: the signal that stopped the run (no error); ``raises``: the exception the run raises
    once its results are written (``.result``: them), else the line is the run's stop error
    (:class:`klrl.loop.reliability.RunStopped`)."""

    line: str | Callable[[Loop], str] | None = None
    save: bool = False
    state: Callable[[Any], Any] | None = None
    signal: str | None = None
    raises: type[Exception] | None = None
    rewind: bool = True


@dataclass(frozen=True)
class Restore:
    """Roll the run back to ``step``: ``state`` (the checkpoint's, e.g. with beta raised) becomes the
    train state, every hook's ``truncate(loop, step)`` cuts its output back to it, then ``notes``."""

    step: int
    state: Any
    notes: tuple[Note, ...] = ()


Request = Note | Stop | Restore


@dataclass(frozen=True)
class Row:
    """One recorded row: the step's host ``metrics`` (held-out metrics merged, samples taken out; a
    sweep's values over members), each member's row as recorded, the step's ``samples`` rows and
    ``ready``, the wall time (``time.time()``) when the step's outputs were ready (None: unknown, the
    time it is recorded stands in)."""

    it: int
    metrics: dict[str, Any]
    members: list[dict[str, float]]
    samples: dict[str, Any] = field(default_factory=dict)
    ready: float | None = None


def due(iteration: int, every: int, iterations: int) -> bool:
    """The cadence of the samples (:class:`klrl.loop.samples.Samples`) and the held-out evaluation
    (:class:`HeldOut`): iteration 0, every ``every`` iterations and the last one (``every <= 0``: never)."""
    return every > 0 and (iteration % every == 0 or iteration == iterations - 1)


class Hook:
    """A hook: nothing to do by default (see the module docstring for when each method is called).
    ``on_row`` is called on the rows whose iteration is a multiple of :attr:`every`."""

    every: int = 1

    def before_step(self, loop: Loop) -> Request | None:
        """Before step ``loop.i`` (``loop.state``: the state after ``loop.i`` updates)."""
        return None

    def on_metrics(self, loop: Loop, it: int, metrics: dict[str, Any]) -> Request | None:
        """Step ``it``'s host metrics, before its row is made (keys may be added); a :class:`Stop`:
        the row is not recorded."""
        return None

    def on_row(self, loop: Loop, row: Row) -> Request | list[Request] | None:
        """A row was recorded (``loop.rows`` ends with it)."""
        return None

    def sync_due(self, i: int) -> bool:
        """Whether the state after ``i`` updates is wanted at once (:meth:`on_sync`)."""
        return False

    def on_sync(self, loop: Loop, step: int) -> None:
        """``loop.state`` is the state after ``step`` updates, every row of it recorded."""

    def on_note(self, loop: Loop, note: Note) -> None:
        """Another hook asked for a note."""

    def truncate(self, loop: Loop, step: int) -> None:
        """The run rolls back to ``step``: what was written for the iterations from ``step`` on goes."""

    def on_stop(self, loop: Loop) -> None:
        """The loop ended (also on an exception)."""


class Signals(Hook):
    """SIGTERM/SIGINT while the loop runs (a context manager around it): the driver polls
    :attr:`received` before every iteration, then checkpoints and returns. ``signals``: those a
    :class:`~klrl.loop.reliability.RunGuard` installed before anything was built; default: new ones."""

    def __init__(self, signals: reliability.StopSignals | None, log: Callable[[str], None]):
        self.signals = signals if signals is not None else reliability.StopSignals(log)

    @property
    def received(self) -> int | None:
        return self.signals.received

    @property
    def name(self) -> str | None:
        return self.signals.name

    def before_step(self, loop: Loop) -> Request | None:
        """A signal came: stop with the state saved (no new step)."""
        if self.received is None:
            return None
        return Stop(save=True, signal=self.name)

    def __enter__(self) -> Signals:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.signals.__exit__(*exc)


class Checkpoints(Hook):
    """The whole state every ``every`` iterations, at the last one and at a stop (:meth:`save`), into
    ``mgr`` (None: ``write=False``, nothing saved); ``base_meta()``: the rollback reference to save."""

    def __init__(self, mgr: Any, every: int, iterations: int, restore_to: Any,
                 base_meta: Callable[[], Any], last_saved: int = -1):  # fmt: skip
        self.mgr, self.save_every, self.iterations = mgr, every, iterations
        self.restore_to, self.base_meta = restore_to, base_meta
        self.last_saved = last_saved  # the newest step saved (-1: none)
        self.frozen_id: dict | None = None  # the frozen reference's {path, digest} (klrl.loop.frozen)

    def due(self, i: int) -> bool:
        """Whether the state after ``i`` iterations is saved (its metrics fetched at once)."""
        return i == self.iterations or (self.save_every > 0 and i % self.save_every == 0)

    def sync_due(self, i: int) -> bool:
        return self.due(i)

    def on_sync(self, loop: Loop, step: int) -> None:
        self.save(loop, step)
        self.tell(loop)

    def truncate(self, loop: Loop, step: int) -> None:
        self.drop_after(step)
        self.tell(loop)

    def tell(self, loop: Loop) -> None:
        """``loop.saved`` and ``loop.checkpoint``: where the last good state is."""
        loop.saved = self.where_saved()
        loop.checkpoint = self.last_saved if self.last_saved >= 0 else None

    def save(self, loop: Loop, step: int) -> None:
        """``loop.state`` as checkpoint ``step`` (once), with the rows recorded so far in its metadata."""
        if self.mgr is None or step == self.last_saved:
            return
        meta = {"config": loop.configs[0].to_dict(), "version": ckpt.version(), "iteration": step,
                "metrics_lines": loop.recorded, "rollbacks": loop.rollbacks,
                "rollback_base": self.base_meta()}  # fmt: skip
        if loop.stacked:
            meta["members"] = [c.to_dict() for c in loop.configs]
        if loop.prog.frozen_ref is not None:  # left out of the checkpoint, identified (klrl.loop.frozen)
            if self.frozen_id is None:
                self.frozen_id = frozen.identity(loop.prog)
            meta[frozen.KEY] = self.frozen_id
        ckpt.save(self.mgr, step, frozen.without(loop.prog, loop.state), meta)
        fault.point("save-started", step)  # (a test's kill -9; klrl.loop.fault)
        fault.point("save-committed", step, before=self.mgr.wait_until_finished)
        self.last_saved = step

    def where_saved(self) -> str:
        """Where the last good state is, for the stop lines."""
        if self.mgr is None:
            return "not saved (write=False)"
        return f"checkpoint {self.last_saved} in {self.mgr.directory}" if self.last_saved >= 0 else "none yet"

    def steps(self) -> list[int]:
        """The complete checkpoints (after the saves in flight)."""
        self.mgr.wait_until_finished()
        return ckpt.steps(self.mgr)

    def restore(self, step: int) -> Any:
        return ckpt.restore(self.mgr, self.restore_to, step)[0]

    def drop_after(self, step: int) -> None:
        """Delete the checkpoints after ``step`` (a rollback to it; 0: the initial state)."""
        if self.mgr is None:
            return
        for s in self.steps():  # (after the saves in flight: a step being saved is deleted too)
            if s > step:
                self.mgr.delete(s)
        self.last_saved = step if step > 0 else -1

    def on_stop(self, loop: Loop) -> None:
        if self.mgr is not None:
            ckpt.finish(self.mgr)  # wait + close; a second error on the way out is dropped


class ReadyTimes:
    """When each step's outputs became ready: :meth:`watch` hands the step's metrics to a watcher
    thread, which waits for them (``jax.block_until_ready``, in the order the steps were dispatched)
    and notes the time. The step returns as soon as it is dispatched (on an accelerator; on the CPU a
    step with a host callback returns when it is done) and the loop fetches its metrics one step late,
    or with the next step's at a checkpoint: neither the return nor the fetch is the time the step
    finished, the watcher's is, and the loop's own thread waits for nothing sooner than before. Not a
    hook: the driver's own clock of the steps it dispatched."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, outputs: Any) -> Callable[[], float]:
        """``when()``: the wall time ``outputs`` became ready (waits for the watcher until then)."""
        done, box = threading.Event(), []
        self._jobs.put((outputs, done, box))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="klrl-ready-times", daemon=True)
            self._thread.start()

        def when() -> float:
            done.wait()
            return box[0]

        return when

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            outputs, done, box = job
            try:
                jax.block_until_ready(outputs)
            except Exception:  # a failed step: the loop's own fetch raises it
                pass
            box.append(time.time())
            done.set()

    def close(self) -> None:
        """The watcher thread ends (the driver's, at the loop's end)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class MetricsSink(Hook):
    """Each member's row to its ``metrics.jsonl`` and event file (``aliases``: other frameworks' names,
    there only), the iteration's wall time to ``timing.jsonl``: from the previous step's outputs being
    ready to this one's (:attr:`Row.ready`), so a step that returned before it finished and rows
    recorded together are timed as they ran (the first row of this process, or after a restore, holds
    the compile and is not timed), then ``callback(it, metrics)`` on process 0
    (:func:`klrl.loop.metrics.latest`)."""

    def __init__(self, aliases: dict[str, str], callback: Callable[[int, dict[str, Any]], Any] | None):
        self.aliases, self.callback = aliases, callback
        self.last: float | None = None  # when the previous row's step was ready

    @classmethod
    def open(cls, loop: Loop, aliases: dict[str, str], callback: Callable[..., Any] | None) -> MetricsSink:
        """The sink of ``loop`` with its writers open (``loop.writers``: one per member, on process 0 of
        a run that writes; appending to a resume's files, cut back to its checkpoint), the loop's
        opening notes (a resume's) written first."""
        sink = cls(aliases, callback)
        if loop.main and loop.root is not None:
            swept = varying_fields(loop.configs) if loop.stacked else []
            pairs = zip(loop.dirs, loop.configs, strict=True)
            loop.writers = [MetricsWriter(d, hparams=hparams_of(c, swept)) for d, c in pairs]
            for note in loop.opening:
                sink.on_note(loop, note)
        return sink

    def on_stop(self, loop: Loop) -> None:
        """Close the writers, with the HParams dashboard's final values at the last step
        (:func:`klrl.loop.metrics.final_metrics` of each member's rows)."""
        for j, w in enumerate(loop.writers):
            w.close(
                final_metrics(columns(loop.rows[j]), loop.configs[j].diag.window), step=max(loop.i - 1, 0)
            )

    def truncate(self, loop: Loop, step: int) -> None:
        """A rollback to ``step``: the rows after it move to ``metrics.rolled_back.jsonl``
        (:func:`klrl.loop.files.move_rolled_back`); the next row follows a restore: not timed."""
        move_rolled_back(loop.dirs, step, loop.main)
        self.last = None

    def on_note(self, loop: Loop, note: Note) -> None:
        if note.member >= len(loop.writers):  # (not the writing process)
            return
        w = loop.writers[note.member]
        if note.tag is None:
            w.event(note.it, note.kind, note.text)
        elif getattr(w, "_tb", None) is not None:
            w._tb.add_text(note.tag, note.text, int(note.it))

    def on_row(self, loop: Loop, row: Row) -> None:
        now = row.ready if row.ready is not None else time.time()
        dt = None if self.last is None else now - self.last
        self.last = now
        fault.point("row-before", row.it)  # (a test's kill -9; klrl.loop.fault)
        for j, w in enumerate(loop.writers):
            mj = row.members[j]
            if dt is not None and dt > 0:
                w.write_timing(row.it, timings(mj, loop.configs[j].train.batch_size, dt))
            w.write(row.it, with_aliases(mj, self.aliases) if self.aliases else mj)
        fault.point("row-after", row.it)
        if self.callback is not None and loop.main:
            self.callback(row.it, latest(loop.rows, loop.stacked))


def sweep_progress(metrics: dict[str, Any]) -> tuple[dict[str, float], str]:
    """What a sweep's progress line shows of stacked metrics (a member axis first): the member mean of
    each metric but beta, whose range across members is the text (``beta 0.01..1 (4 members, mean)``)."""
    arrays = {k: np.asarray(v, float).reshape(-1) for k, v in metrics.items()}
    n = len(next(iter(arrays.values()))) if arrays else 0
    means = {k: float(np.mean(v)) for k, v in arrays.items() if k != "ctrl/beta"}
    text = f"({n} members, mean)"
    if "ctrl/beta" in arrays:
        b = arrays["ctrl/beta"]
        lo, hi = float(np.min(b)), float(np.max(b))
        text = (f"beta {lo:.3g}" if lo == hi else f"beta {lo:.3g}..{hi:.3g}") + " " + text
    return means, text


class ProgressLine(Hook):
    """The progress bar (a terminal) or lines (``train.log_every``) showing :attr:`KEYS`; a sweep's
    shows member means and the range of beta (:func:`sweep_progress`)."""

    # (metric, label); a tuple of them: the first the row has. The KL shown is the exact one
    # (``kl/exact_seq_sum``, logged with ``kl.exact_metric``), else the k1 sample estimate, which is
    # negative at small KL; the label says which
    KEYS = (
        ("reward/task", "R"),
        ("reward/gold", "gold"),
        (("kl/exact_seq_sum", "KL/seq(exact)"), ("kl/k1_seq_sum", "KL/seq(k1)")),
        ("ctrl/beta", "beta"),
    )

    def __init__(self, progress: Progress):
        self.progress = progress

    @classmethod
    def of(cls, total: int, every: int, quiet: bool, start: int) -> ProgressLine:
        """Over a :class:`~klrl.io.logging.Progress` of ``total`` iterations showing :attr:`KEYS`."""
        return cls(Progress(total, every, quiet, start=start, keys=cls.KEYS))

    def on_row(self, loop: Loop, row: Row) -> None:
        if loop.stacked:
            means, text = sweep_progress(row.metrics)
            self.progress.update(row.it, means, extra=text)
        else:
            self.progress.update(row.it, {k: float(v) for k, v in row.metrics.items()})

    def on_stop(self, loop: Loop) -> None:
        self.progress.close()


class KLSignNote(Hook):
    """Once per run: a note when the KL estimate the reward penalises (``kl/reward_<est>_seq_sum``) has a
    negative batch mean while the exact KL (``kl/exact_seq_sum``) is positive. k1 is unbiased but noisy
    per sample, and a small batch's mean can be negative: said once, so the user knows it is not a bug.
    Differences under :data:`FLOOR` nats/sequence are float noise (iteration 0: the sampler's log-probs
    and the reference forward's differ in the last bits) and are not noted."""

    FLOOR = 1e-3

    def __init__(self, estimator: str, log: Callable[[str], None]):
        self.key, self.estimator = f"kl/reward_{estimator}_seq_sum", estimator
        self.log, self.done = log, False

    def on_row(self, loop: Loop, row: Row) -> None:
        for j, m in enumerate(row.members if not self.done else ()):
            est, exact = m.get(self.key), m.get("kl/exact_seq_sum")
            if est is None or exact is None or not (est < -self.FLOOR and exact > 0):
                continue
            d = loop.dirs[j]
            who = f"{d.name if d is not None else f'member {j:02d}'}: " if loop.stacked else ""
            b = loop.configs[j].train.batch_size
            self.log(
                f"note: iteration {row.it}: {who}the penalised KL estimate {self.key} has batch mean "
                f"{est:.3g} nats/seq while the exact KL is {exact:.3g}: {self.estimator} is unbiased "
                f"but noisy per sample and at batch {b} its mean can be negative; a larger "
                "train.batch_size averages it out, k3 is never negative (docs/kl-control.md, "
                "Estimators)"
            )
            self.done = True
            return


class SkipStop(Hook):
    """The non-finite guard's stop: a :class:`Stop` once a member's ``guard/consecutive_skips`` reaches
    ``train.max_consecutive_skips`` (:func:`klrl.loop.reliability.skip_stop`). The step after the K-th
    skip was a no-op (:mod:`klrl.step.train`): its row is dropped and, for a single run, the state (the
    one after exactly K skips) is saved."""

    def __init__(self, max_skips: int):
        self.max_skips = max_skips

    def on_row(self, loop: Loop, row: Row) -> Stop | None:
        skips = max(r[-1].get("guard/consecutive_skips", 0.0) for r in loop.rows)
        if not reliability.skip_stop(skips, self.max_skips):
            return None
        n = int(skips)
        return Stop(lambda lp: skips_message(n, self.max_skips, lp.saved), save=not loop.stacked)


class QualityRollback(Hook):
    """The quality rollback's guards (``train.rollback_metric``'s, then ``train.rollback_guards``',
    :meth:`klrl.config.fields.TrainConfig.guards`): each guarded metric's trace per member, its reference
    (the value at iteration 0) and the rollback when a guard crossed: back to the newest checkpoint good
    for every member whose metric crossed, with those members' beta x ``train.rollback_factor`` (a
    :class:`Restore`, a note naming each guard that crossed; a :class:`Stop` after
    ``train.max_rollbacks``, counted over all guards); inert without a guard. ``traces``, ``bases``: per
    guarded metric, per member. ``ckpts``: the checkpoints it reads (steps, states); ``initial``: a host
    copy of the state a rollback to step 0 restores (``init`` cannot be re-run once ``step`` donated its
    arrays)."""

    def __init__(self, tc: Any, stacked: bool, log: Callable[[str], None],
                 traces: dict[str, list[list[float]]], bases: dict[str, list[float | None]],
                 initial: Any = None, ckpts: Any = None):  # fmt: skip
        self.tc, self.guards, self.stacked, self.log = tc, tc.guards(), stacked, log
        self.traces, self.bases, self.initial, self.ckpts = traces, bases, initial, ckpts

    def base_meta(self) -> dict[str, Any] | None:
        """The references a checkpoint's metadata keeps (a resume reads them back,
        :func:`klrl.loop.files.rollback_bases`): the first guarded metric's as before guards, the others'
        per member under ``others``."""
        if not self.guards:
            return None
        b = {m: [x if x is not None and math.isfinite(x) else None for x in v] for m, v in self.bases.items()}
        first, *others = b
        out = {"metric": first, **({"values": b[first]} if self.stacked else {"value": b[first][0]})}
        return {**out, "others": {m: b[m] for m in others}} if others else out

    def who(self, j: int) -> str:
        return f"member {j:02d}: " if self.stacked else ""

    def on_row(self, loop: Loop, row: Row) -> list[Request] | None:
        """The row's guarded metrics traced (a bad reference: a note); past a guard, the rollback."""
        if not self.guards:
            return None
        out: list[Request] = []
        for metric, traces in self.traces.items():
            bases = self.bases[metric]
            for j, mj in enumerate(row.members):
                traces[j].append(mj.get(metric, math.nan))
                if bases[j] is None:
                    bases[j] = traces[j][0]
                    msg = base_message(metric, bases[j])
                    if msg is not None:
                        msg = self.who(j) + msg
                        self.log(msg)
                        out.append(Note(j, row.it, "rollback_off", msg))
        if self.crossed():
            out.append(self.roll_back(loop, self.ckpts))
        return out

    def crossed(self) -> bool:
        """Whether a member's newest value of a guarded metric is past its guard."""
        return any(
            reliability.is_bad(tr[-1], b, g.ratio)
            for g in self.guards
            for tr, b in zip(self.traces[g.metric], self.bases[g.metric], strict=True)
        )

    def decisions(self, steps: list[int]) -> dict[int, list[tuple[Any, reliability.Rollback]]]:
        """Per member, each guard that crossed with its decision (:func:`reliability.decide_rollback`)."""
        out: dict[int, list[tuple[Any, reliability.Rollback]]] = {}
        for g in self.guards:
            for j, trace in enumerate(self.traces[g.metric]):
                d = reliability.decide_rollback(trace, steps, g.ratio, self.bases[g.metric][j])
                if d is not None:
                    out.setdefault(j, []).append((g, d))
        return out

    def roll_back(self, loop: Loop, ckpts: Checkpoints) -> Restore | Stop:
        """The :class:`Restore` of the newest checkpoint good for every crossed member and guard (the other
        members replay exactly), the crossed members' beta raised, a note per guard crossed; the
        :class:`Stop` after ``train.max_rollbacks``."""
        decs = self.decisions(ckpts.steps() if ckpts.mgr is not None else [])
        tc = self.tc
        j0, ((g0, d0), *_) = next(iter(decs.items()))
        if loop.rollbacks >= tc.max_rollbacks:
            line = give_up_message(self.who(j0), g0.metric, d0, g0.ratio, loop.rollbacks, g0.spec)
            return Stop(line, rewind=False)
        target = min(d.step for ds in decs.values() for _, d in ds)
        state, old, beta = self._restored(loop, ckpts, target, list(decs))
        notes = []
        for j, ds in decs.items():
            for g, d in ds:
                msg = rollback_message(loop.rollbacks + 1, tc.max_rollbacks, self.who(j), g.metric, d,
                                       g.ratio, target, float(old[j]), float(beta[j]), g.spec)  # fmt: skip
                self.log(msg)
                notes.append(Note(j, d.crossing, "rollback", msg))
        return Restore(target, state, tuple(notes))

    def truncate(self, loop: Loop, step: int) -> None:
        for traces in self.traces.values():
            for trace in traces:
                del trace[step:]

    def _restored(
        self, loop: Loop, ckpts: Checkpoints, target: int, members: list[int]
    ) -> tuple[Any, Any, Any]:
        """Checkpoint ``target`` with the crossed ``members``' beta raised, and the restored and the new
        beta per member (flat)."""
        failed = np.asarray(distributed.to_host(loop.state.ctrl.beta), np.float32)  # beta when it crossed
        new = self.initial if target == 0 else ckpts.restore(target)
        new = frozen.restored(loop.prog, new, {}, f"checkpoint {target}")  # the frozen reference put back
        old = np.asarray(distributed.to_host(new.ctrl.beta), np.float32)
        new_beta = reliability.rollback_betas(old, failed, members, self.tc.rollback_factor)
        new = new._replace(ctrl=new.ctrl._replace(beta=new_beta))
        return new, old.reshape(-1), new_beta.reshape(-1)


class HeldOut(Hook):
    """The held-out evaluation (``prog.evaluate``) of the state after ``i`` updates, every
    ``data.eval_every`` iterations, before the step donates it; merged into row ``i``."""

    def __init__(self, prog: Program):
        self.evaluate, self.check = prog.evaluate, prog.heldout_check
        self.eval_every, self.iterations = prog.configs[0].data.eval_every, prog.configs[0].train.iterations
        self.rows: dict[int, Any] = {}  # held-out metrics waiting for their row

    def evaluated(self, loop: Loop) -> bool:
        """Evaluate ``loop.state`` if iteration ``loop.i`` is due; whether it was."""
        if (
            self.evaluate is None
            or loop.i >= self.iterations
            or not due(loop.i, self.eval_every, self.iterations)
        ):
            return False
        self.rows[loop.i] = jax.block_until_ready(self.evaluate(loop.state, loop.prog.env))
        return True

    def before_step(self, loop: Loop) -> Stop | None:
        """The evaluation when due; its host reward failed (``prog.heldout_check``): a :class:`Stop`
        with the state saved as it is (it is good: only the evaluation's reward failed) and the error
        raised once the results are written."""
        err = reward_error(self.check) if self.evaluated(loop) else None
        if err is None:
            return None
        return Stop(
            lambda lp: f"{err} (held-out evaluation); last good state: {lp.saved}",
            save=True,
            raises=RewardFunctionError,
        )

    def on_metrics(self, loop: Loop, it: int, metrics: dict[str, Any]) -> None:
        metrics.update(self.take(it))

    def take(self, it: int) -> dict[str, Any]:
        """Row ``it``'s held-out metrics on the host ({} if it has none)."""
        return distributed.to_host(self.rows.pop(it)) if it in self.rows else {}


@dataclass(frozen=True)
class Rejected:
    """Iteration ``it`` was rejected by the guard (``skipped``, per member) and a host reward function
    failed (``error``)."""

    it: int
    error: Exception
    skipped: np.ndarray

    def accepted_none(self) -> bool:
        """Whether no member accepted the iteration: several sweep device groups call the reward
        concurrently, and a group scored before the failure may have accepted it (then only an older
        checkpoint is good for every member)."""
        return bool((self.skipped > 0).all())


class RewardFailure(Hook):
    """A host reward function that failed on a row the guard rejected: :mod:`klrl.rewards.host` records
    the failure in its callback; this hook asks for it (``prog.reward_check``, :meth:`rejected`) before the
    row is recorded and ends the run (:meth:`stop`): the iteration (and any after it) was rejected, so the
    state holds the last good parameters, saved as the state after the rows recorded when no member
    accepted the iteration; the error is raised once the results are written (the command line turns it
    into one line). The held-out evaluation's reward failure is :class:`HeldOut`'s."""

    def __init__(self, prog: Program):
        self.check = prog.reward_check

    def rejected(self, it: int, m: Any) -> Rejected | None:
        """Whether row ``it`` (the step's metrics ``m``) was rejected because a host reward failed."""
        if self.check is None:
            return None
        skipped = np.asarray(distributed.to_host(m["guard/skipped"])).reshape(-1)
        e = reward_failure(self.check, skipped)
        return None if e is None else Rejected(it, e, skipped)

    def on_metrics(self, loop: Loop, it: int, metrics: dict[str, Any]) -> Stop | None:
        r = self.rejected(it, metrics)
        return None if r is None else self.stop(loop, r)

    @staticmethod
    def stop(loop: Loop, r: Rejected) -> Stop:
        """The :class:`Stop` at ``r``."""
        save = r.accepted_none()
        restamped = (lambda state: restamp(ckpt.host_copy(state), loop.rows)) if save else None
        return Stop(lambda lp: f"{r.error}; last good state: {lp.saved}", save=save, state=restamped,
                    raises=RewardFunctionError)  # fmt: skip
