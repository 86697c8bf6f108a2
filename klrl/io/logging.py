"""Run directories and metric sinks: ``metrics.jsonl`` and TensorBoard (tensorboardX).

Every iteration appends one JSON object (``{"iteration": i, "<slash/name>": value, ...}``)
to ``metrics.jsonl`` and the same scalars to the event file, under the same names. A non-finite
value is written as ``"nan"``/``"inf"`` in JSON and as the float NaN/inf in the event file,
without tensorboardX's per-value "NaN or Inf found in input tensor." warning (the non-finite
guard reports those iterations itself; its ``guard/skipped`` metric counts them).

tensorboardX writes events in a background thread. If that thread fails (e.g. ENOSPC: disk full),
its traceback is not printed, the thread keeps emptying its queue (so the next ``add_scalar``
cannot block forever on a full queue) and the error is raised by the next :meth:`MetricsWriter.write`
in the caller's thread (where :class:`klrl.reliability.RunGuard` turns a full disk into one line).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

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

    def event(self, iteration: int, kind: str, message: str) -> None:
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"iteration": int(iteration), "event": kind, "message": message}) + "\n")
        if self._tb is not None:
            self._tb.add_text(f"events/{kind}", message, int(iteration))

    def close(self, final: dict[str, Any] | None = None) -> None:
        if self._tb is not None:
            if self._hparams is not None:
                metrics = {
                    f"final/{k}": float(v) for k, v in (final or {}).items() if math.isfinite(float(v))
                }
                self._tb.add_hparams(self._hparams, metrics, name="hparams", global_step=0)
            self._tb.close()
        self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl``; a torn last line (a crash mid-write) is ignored, any other bad
    line raises :class:`klrl.io.readers.RunDirError` (see :func:`klrl.io.readers.read_jsonl`)."""
    from klrl.io import readers

    return readers.read_jsonl(path)


def hparams_of(cfg: RunConfig) -> dict[str, Any]:
    """The hyper-parameters a beta study compares, flat, for TensorBoard's hparams view."""
    c, k = cfg.ctrl, cfg.kl
    return {
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
    }


class Progress:
    """A progress line with ETA on a terminal; plain periodic lines otherwise."""

    KEYS = (("reward/task", "R"), ("kl/k1_seq_sum", "KL/seq"), ("ctrl/beta", "beta"))

    def __init__(self, total: int, every: int = 1, quiet: bool = False, stream: Any = None):
        self.total, self.every, self.quiet = total, every, quiet
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.time()

    def update(self, i: int, metrics: dict[str, Any], extra: str = "") -> None:
        if self.quiet:
            return
        done = i + 1
        el = time.time() - self.t0
        eta = el / done * (self.total - done)
        vals = " ".join(f"{n} {float(metrics[k]):.4g}" for k, n in self.KEYS if k in metrics)
        line = f"[{done}/{self.total}] {vals} {extra} | {el:.0f}s, eta {eta:.0f}s"
        if self.tty:
            width = 24
            fill = int(width * done / self.total)
            self.stream.write("\r|" + "#" * fill + "." * (width - fill) + "| " + line + "\x1b[K")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total:
            print(line, file=self.stream, flush=True)
