"""Run directories and metric sinks: ``metrics.jsonl`` and TensorBoard (tensorboardX).

Every iteration appends one JSON object (``{"iteration": i, "<slash/name>": value, ...}``)
to ``metrics.jsonl`` and the same scalars to the event file, under the same names. A non-finite
value is written as ``"nan"``/``"inf"`` in JSON and as the float NaN/inf in the event file,
without tensorboardX's per-value "NaN or Inf found in input tensor." warning (the non-finite
guard reports those iterations itself; its ``guard/skipped`` metric counts them).

tensorboardX writes events in a background thread. If that thread fails (e.g. ENOSPC: disk full),
its traceback is not printed, the thread keeps emptying its queue (so the next ``add_scalar``
cannot block forever on a full queue) and the error is raised by the next :meth:`MetricsWriter.write`
in the caller's thread (where :class:`klrl.loop.reliability.RunGuard` turns a full disk into one line).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summaries
from tqdm import tqdm

from klrl.config import RunConfig


def new_run_dir(cfg: RunConfig) -> Path:
    """``<out_dir>/<name or timestamp>``; a taken name gets a numeric suffix, nothing is overwritten."""
    root = Path(cfg.train.out_dir)
    base = cfg.train.name or time.strftime("%Y%m%d-%H%M%S")
    path, k = root / base, 1
    while path.exists():
        path, k = root / f"{base}-{k}", k + 1
    path.mkdir(parents=True)
    return path


def _clean(v: Any) -> Any:
    v = float(v)
    return v if math.isfinite(v) else str(v)  # JSON has no NaN; keep it visible as "nan"/"inf"


class _NoNaNWarning(logging.Filter):
    """Drops tensorboardX's "NaN or Inf found in input tensor." (one per non-finite scalar)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NaN or Inf found" not in record.getMessage()


def _quiet_nan_warnings() -> None:
    log = logging.getLogger("tensorboardX.x2num")
    if not any(isinstance(f, _NoNaNWarning) for f in log.filters):
        log.addFilter(_NoNaNWarning())


_TB_ERRORS: dict[int, BaseException] = {}  # id(tensorboardX writer thread) -> the error that ended it


def _tb_thread_hook(previous: Any) -> Any:
    def hook(args: Any) -> None:
        thread = args.thread
        q = getattr(thread, "_queue", None)
        ours = type(thread).__name__ == "_EventLoggerThread" and q is not None
        if not (ours and isinstance(args.exc_value, OSError)):
            previous(args)
            return
        _TB_ERRORS[id(thread)] = args.exc_value
        while type(q.get()) is not object:  # drain until close()'s shutdown signal (a bare object())
            pass

    hook.klrl_tb = True
    return hook


def _catch_tb_thread_errors() -> None:
    if not getattr(threading.excepthook, "klrl_tb", False):
        threading.excepthook = _tb_thread_hook(threading.excepthook)


class MetricsWriter:
    """Appends metrics to ``metrics.jsonl`` and a TensorBoard event file."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, hparams: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._f = open(self.path, "a", buffering=1)
        self._tb = SummaryWriter(str(self.run_dir / "tb")) if tensorboard else None
        self._hparams = hparams
        _quiet_nan_warnings()
        _catch_tb_thread_errors()

    def _tb_error(self) -> BaseException | None:
        writer = getattr(getattr(self._tb, "file_writer", None), "event_writer", None)
        worker = getattr(writer, "_worker", None)
        return _TB_ERRORS.pop(id(worker), None) if worker is not None else None

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        row = {"iteration": int(iteration), **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            err = self._tb_error()
            if err is not None:
                raise err
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), int(iteration))

    def write_timing(self, iteration: int, metrics: dict[str, float]) -> None:
        """Wall-clock metrics (``train/iteration_s``, ``perf/tokens_per_s``): to the event file and
        ``timing.jsonl``, not ``metrics.jsonl`` (whose rows a resume reproduces bit for bit)."""
        with open(self.run_dir / "timing.jsonl", "a") as f:
            f.write(
                json.dumps({"iteration": int(iteration), **{k: _clean(v) for k, v in metrics.items()}}) + "\n"
            )
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), int(iteration))

    def event(self, iteration: int, kind: str, message: str) -> None:
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"iteration": int(iteration), "event": kind, "message": message}) + "\n")
        if self._tb is not None:
            self._tb.add_text(f"events/{kind}", message, int(iteration))

    def close(self, final: dict[str, Any] | None = None, step: int = 0) -> None:
        """Close the sinks; with ``hparams``, first write TensorBoard's HParams session into this
        same run (experiment, session start/end) and the ``final`` values as ``final/<name>``
        scalars at ``step``, the metrics the HParams dashboard shows beside the time series."""
        if self._tb is not None:
            if self._hparams is not None:
                write_hparams(self._tb, self._hparams, final or {}, step)
            self._tb.close()
        self._f.close()


def write_hparams(tb: SummaryWriter, hparams: dict[str, Any], final: dict[str, Any], step: int) -> None:
    """An HParams session in ``tb``'s own run (``SummaryWriter.add_hparams`` would open a separate
    ``<run>/<name>`` run): hyper-parameters (bool/str/number; anything else as its ``str``) and
    ``final/<name>`` metrics, the finite values of ``final``."""
    hp = {k: v if isinstance(v, bool | str | int | float) else str(v) for k, v in hparams.items()}
    metrics = {f"final/{k}": float(v) for k, v in final.items() if math.isfinite(float(v))}
    for summary in hparams_summaries(hp, metrics):
        tb.file_writer.add_summary(summary)
    for k, v in metrics.items():
        tb.add_scalar(k, v, int(step))


def hparams_of(cfg: RunConfig, swept: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The hyper-parameters a beta study compares, flat (``section/field``), for TensorBoard's
    HParams dashboard: the main config fields plus every ``swept`` ``section.field``."""
    c, k = cfg.ctrl, cfg.kl
    out = {
        "kl/beta": k.beta,
        "kl/estimator": k.estimator,
        "kl/placement": k.placement,
        "kl/loss_coef": k.loss_coef,
        "ctrl/kind": c.kind,
        "ctrl/target": c.target,
        "ctrl/unit": c.unit,
        "ctrl/horizon": c.horizon,
        "ctrl/kp": c.kp,
        "ctrl/ki": c.ki,
        "ctrl/warmup_iters": c.warmup_iters,
        "ppo/advantage": cfg.ppo.advantage,
        "optim/lr": cfg.optim.lr,
        "train/seed": cfg.train.seed,
        "task/name": cfg.task.name,
        "train/iterations": cfg.train.iterations,
    }
    if cfg.optim.critic_lr > 0:  # the critic's own learning rate (0: optim.lr)
        out["optim/critic_lr"] = cfg.optim.critic_lr
    for name in swept:
        section, field = name.split(".", 1)
        out[f"{section}/{field}"] = getattr(getattr(cfg, section), field)
    return out


def eta_seconds(done: int, total: int, first_done: int, since_first: float) -> float | None:
    """Seconds left at ``done`` of ``total`` iterations, at the rate measured since the first step of
    this process returned (``first_done`` iterations done then, ``since_first`` seconds ago): the
    compile and the iterations before a resume are not counted. None until a second step is timed."""
    n = done - first_done
    if n <= 0 or since_first <= 0:
        return None
    return max(total - done, 0) * since_first / n


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s}s"
    )


class Progress:
    """Progress with ETA: a tqdm bar on a terminal, plain lines every ``every`` iterations otherwise.

    The ETA (:func:`eta_seconds`) is timed from the first :meth:`update` (the first step returned,
    so after the compile) and counts only the iterations this process runs (``start``: those done
    before a resume). ``keys``: what a line shows, each entry ``(metric, label)`` or a tuple of them
    (the first the row has); the run loop's are :attr:`klrl.loop.hooks.ProgressLine.KEYS`."""

    def __init__(self, total: int, every: int = 1, quiet: bool = False, stream: Any = None, start: int = 0,
                 keys: Sequence[Any] = ()):  # fmt: skip
        self.total, self.every, self.quiet, self.start = total, max(int(every), 1), quiet, start
        self.keys = tuple(keys)
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.time()
        self._first: tuple[float, int] | None = None  # (time, done) at the first update
        self._bar: Any = None

    def line(self, done: int, metrics: dict[str, Any], extra: str, eta: float | None) -> str:
        shown = []  # (metric, label): the first of each ``keys`` entry the row has
        for key in self.keys:
            choices = key if isinstance(key[0], tuple) else (key,)
            shown += [c for c in choices if c[0] in metrics][:1]
        vals = " ".join(f"{n} {float(metrics[k]):.4g}" for k, n in shown)
        return " ".join(x for x in (vals, extra) if x) + f" | eta {_fmt_s(eta)}"

    def update(self, i: int, metrics: dict[str, Any], extra: str = "") -> None:
        if self.quiet:
            return
        done, now = i + 1, time.time()
        if self._first is None:
            self._first = (now, done)
        eta = eta_seconds(done, self.total, self._first[1], now - self._first[0])
        text = self.line(done, metrics, extra, eta)
        if self.tty:
            if self._bar is None:
                fmt = "{l_bar}{bar}| {n_fmt}/{total_fmt} {postfix}"
                self._bar = tqdm(total=self.total, initial=done - 1, file=self.stream, bar_format=fmt,
                                 dynamic_ncols=True, leave=True)  # fmt: skip
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(done - self._bar.n)
            if done >= self.total:
                self.close()
        elif done % self.every == 0 or done == self.total:
            print(f"[{done}/{self.total}] {text}, {now - self.t0:.0f}s", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
